#include "sparsekv/status.h"

namespace sparsekv {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kInvalidArgument: return "InvalidArgument";
    case StatusCode::kNotFound: return "NotFound";
    case StatusCode::kAlreadyExists: return "AlreadyExists";
    case StatusCode::kResourceExhausted: return "ResourceExhausted";
    case StatusCode::kFailedPrecondition: return "FailedPrecondition";
    case StatusCode::kCorruption: return "Corruption";
    case StatusCode::kIOError: return "IOError";
    case StatusCode::kPermissionDenied: return "PermissionDenied";
    case StatusCode::kUnavailable: return "Unavailable";
    case StatusCode::kAborted: return "Aborted";
    case StatusCode::kNotSupported: return "NotSupported";
    case StatusCode::kOutOfRange: return "OutOfRange";
    case StatusCode::kInternal: return "Internal";
  }
  return "Unknown";
}

Status::Status(StatusCode code, std::string message, bool retryable, bool data_loss) {
  if (code != StatusCode::kOk) {
    rep_ = std::make_unique<Rep>(Rep{code, retryable, data_loss, std::move(message)});
  }
}

Status::Status(const Status& other)
    : rep_(other.rep_ ? std::make_unique<Rep>(*other.rep_) : nullptr) {}

Status& Status::operator=(const Status& other) {
  if (this != &other) rep_ = other.rep_ ? std::make_unique<Rep>(*other.rep_) : nullptr;
  return *this;
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string s(StatusCodeName(rep_->code));
  s += ": ";
  s += rep_->message;
  return s;
}

Status Status::WithContext(std::string_view context) const {
  if (ok()) return Status();
  std::string msg(context);
  msg += ": ";
  msg += rep_->message;
  return Status(rep_->code, std::move(msg), rep_->retryable, rep_->data_loss);
}

}  // namespace sparsekv
