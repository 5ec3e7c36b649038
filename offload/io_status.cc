#include "io_status.h"

#include <fmt/format.h>
#include <rocksdb/status.h>

#include <cerrno>
#include <cstring>
#include <string>

namespace sparsekv::offload {

Status ErrnoStatus(int err, std::string_view what) {
  std::string msg = fmt::format("{}: {} (errno {})", what, std::strerror(err), err);
  switch (err) {
    case ENOSPC:
    case EDQUOT:
      return Status::ResourceExhausted(std::move(msg));
    case ENOENT:
      return Status::NotFound(std::move(msg));
    case EACCES:
    case EPERM:
      return Status::PermissionDenied(std::move(msg));
    case EAGAIN:
    case EINTR:
      return Status::IOError(std::move(msg), /*retryable=*/true);
    default:
      return Status::IOError(std::move(msg));
  }
}

Status FromRocksDb(const rocksdb::Status& s, std::string_view what) {
  if (s.ok()) return Status::OK();
  std::string msg = fmt::format("{}: rocksdb: {}", what, s.ToString());
  if (s.IsNotFound()) return Status::NotFound(std::move(msg));
  if (s.IsCorruption()) return Status::Corruption(std::move(msg));
  if (s.IsNoSpace()) return Status::ResourceExhausted(std::move(msg));
  if (s.IsIOError()) return Status::IOError(std::move(msg), s.IsBusy() || s.IsTryAgain());
  if (s.IsInvalidArgument()) return Status::InvalidArgument(std::move(msg));
  if (s.IsNotSupported()) return Status::NotSupported(std::move(msg));
  if (s.IsBusy() || s.IsTryAgain() || s.IsTimedOut()) return Status::Unavailable(std::move(msg));
  if (s.IsAborted()) return Status::Aborted(std::move(msg));
  return Status::Internal(std::move(msg));
}

}  // namespace sparsekv::offload
