// Status and Result<T>: sparsekv's one error convention.
//
// Every fallible call returns a [[nodiscard]] Status (or Result<T> for a value). A Status is a
// code, a message that names what was wrong and what was expected, and flags in the manner of
// RocksDB's IOStatus: `retryable` (the same call may succeed later: a full tier, a busy
// device) and `data_loss` (stored data was found damaged). No exception crosses a module
// boundary. An OK status owns no memory. Thread safety: a Status is a value; distinct objects
// may be used from different threads.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>

namespace sparsekv {

enum class StatusCode : uint8_t {
  kOk = 0,
  kInvalidArgument,     // the caller's input is malformed or out of range
  kNotFound,            // the key or object does not exist
  kAlreadyExists,       // creation of something that is there
  kResourceExhausted,   // pool, tier, budget or queue full
  kFailedPrecondition,  // the object is in the wrong state for the call
  kCorruption,          // stored bytes failed a check
  kIOError,             // the operating system said no
  kPermissionDenied,    // a client asked for what its namespace may not see
  kUnavailable,         // a peer or service is not reachable now
  kAborted,             // the operation was cancelled
  kNotSupported,        // a valid request this build or configuration cannot serve
  kOutOfRange,          // an index past the end
  kInternal,            // a broken invariant: a bug in sparsekv
};

std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message, bool retryable = false, bool data_loss = false);
  Status(const Status& other);
  Status& operator=(const Status& other);
  Status(Status&&) noexcept = default;
  Status& operator=(Status&&) noexcept = default;
  ~Status() = default;

  static Status OK() { return Status(); }
  static Status InvalidArgument(std::string msg) { return {StatusCode::kInvalidArgument, std::move(msg)}; }
  static Status NotFound(std::string msg) { return {StatusCode::kNotFound, std::move(msg)}; }
  static Status AlreadyExists(std::string msg) { return {StatusCode::kAlreadyExists, std::move(msg)}; }
  static Status ResourceExhausted(std::string msg) {
    return {StatusCode::kResourceExhausted, std::move(msg), /*retryable=*/true};
  }
  static Status FailedPrecondition(std::string msg) {
    return {StatusCode::kFailedPrecondition, std::move(msg)};
  }
  static Status Corruption(std::string msg) {
    return {StatusCode::kCorruption, std::move(msg), false, /*data_loss=*/true};
  }
  static Status IOError(std::string msg, bool retryable = false) {
    return {StatusCode::kIOError, std::move(msg), retryable};
  }
  static Status PermissionDenied(std::string msg) { return {StatusCode::kPermissionDenied, std::move(msg)}; }
  static Status Unavailable(std::string msg) { return {StatusCode::kUnavailable, std::move(msg), true}; }
  static Status Aborted(std::string msg) { return {StatusCode::kAborted, std::move(msg)}; }
  static Status NotSupported(std::string msg) { return {StatusCode::kNotSupported, std::move(msg)}; }
  static Status OutOfRange(std::string msg) { return {StatusCode::kOutOfRange, std::move(msg)}; }
  static Status Internal(std::string msg) { return {StatusCode::kInternal, std::move(msg)}; }

  bool ok() const { return rep_ == nullptr; }
  StatusCode code() const { return rep_ ? rep_->code : StatusCode::kOk; }
  std::string_view message() const { return rep_ ? std::string_view(rep_->message) : std::string_view(); }
  bool retryable() const { return rep_ && rep_->retryable; }
  bool data_loss() const { return rep_ && rep_->data_loss; }
  bool Is(StatusCode c) const { return code() == c; }

  // "InvalidArgument: block_tokens 100 is not a multiple of ..." ("OK" when ok).
  std::string ToString() const;
  // Returns a copy whose message is "context: message".
  Status WithContext(std::string_view context) const;
  // For the rare place where a status may be dropped on purpose; says so at the call site.
  void IgnoreError() const {}

 private:
  struct Rep {
    StatusCode code;
    bool retryable;
    bool data_loss;
    std::string message;
  };
  std::unique_ptr<Rep> rep_;
};

// A value or the Status that says why there is none. Holds a non-OK status when it holds no value.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT: implicit, as a return value
  // From anything T converts from (as absl::StatusOr): `return payload;` in a Result<Reply>.
  template <typename U,
            typename = std::enable_if_t<std::is_convertible_v<U&&, T> && !std::is_same_v<std::decay_t<U>, T> &&
                                        !std::is_same_v<std::decay_t<U>, Status>>>
  Result(U&& value) : v_(T(std::forward<U>(value))) {}  // NOLINT
  Result(Status status) : v_(std::move(status)) {  // NOLINT
    if (std::get<Status>(v_).ok()) v_ = Status::Internal("Result constructed from an OK status");
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  // OK when a value is held.
  Status status() const { return ok() ? Status::OK() : std::get<Status>(v_); }
  // Preconditions: ok().
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace sparsekv

#define SPARSEKV_CONCAT_INNER_(a, b) a##b
#define SPARSEKV_CONCAT_(a, b) SPARSEKV_CONCAT_INNER_(a, b)

// Returns the status of `expr` from the enclosing function when it is not OK.
#define SPARSEKV_RETURN_IF_ERROR(expr)                   \
  do {                                                   \
    ::sparsekv::Status sparsekv_status_ = (expr);        \
    if (!sparsekv_status_.ok()) return sparsekv_status_; \
  } while (0)

// `lhs = value of expr`, or returns its status from the enclosing function.
#define SPARSEKV_ASSIGN_OR_RETURN(lhs, expr) \
  SPARSEKV_ASSIGN_OR_RETURN_IMPL_(SPARSEKV_CONCAT_(sparsekv_result_, __LINE__), lhs, expr)
#define SPARSEKV_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                    \
  if (!tmp.ok()) return tmp.status();                   \
  lhs = std::move(tmp).value()
