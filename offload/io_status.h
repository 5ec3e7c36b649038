// Status from errno and from rocksdb::Status, for the offload subsystem's files and indexes.
#pragma once

#include <string_view>

#include "sparsekv/status.h"

namespace rocksdb {
class Status;
}

namespace sparsekv::offload {

// `what` says what was being done ("pwrite /d/slab-1048576.dat at 4096"). EIO and most others
// map to IOError, ENOSPC and EDQUOT to ResourceExhausted (retryable), ENOENT to NotFound,
// EACCES and EPERM to PermissionDenied, EAGAIN and EINTR to retryable IOError.
Status ErrnoStatus(int err, std::string_view what);

// RocksDB's status as ours: Corruption keeps data_loss, IOError and NoSpace keep their meaning.
Status FromRocksDb(const rocksdb::Status& s, std::string_view what);

}  // namespace sparsekv::offload
