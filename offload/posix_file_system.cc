// The POSIX FileSystem: pread/pwrite/fdatasync/fallocate on file descriptors.
#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>

#include "io_status.h"
#include "sparsekv/file_system.h"

namespace sparsekv {
namespace {

using offload::ErrnoStatus;

class PosixRandomRWFile final : public RandomRWFile {
 public:
  PosixRandomRWFile(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  ~PosixRandomRWFile() override { ::close(fd_); }

  Status Write(uint64_t offset, std::span<const std::byte> data) override {
    uint64_t done = 0;
    while (done < data.size()) {
      const ssize_t n =
          ::pwrite(fd_, data.data() + done, data.size() - done, static_cast<off_t>(offset + done));
      if (n < 0) {
        if (errno == EINTR) continue;
        return ErrnoStatus(errno, fmt::format("pwrite {} at {}", path_, offset + done));
      }
      if (n == 0)
        return Status::IOError(fmt::format("pwrite {} at {} wrote nothing", path_, offset + done));
      done += static_cast<uint64_t>(n);
    }
    return Status::OK();
  }

  Result<uint64_t> Read(uint64_t offset, std::span<std::byte> out) override {
    uint64_t done = 0;
    while (done < out.size()) {
      const ssize_t n =
          ::pread(fd_, out.data() + done, out.size() - done, static_cast<off_t>(offset + done));
      if (n < 0) {
        if (errno == EINTR) continue;
        return ErrnoStatus(errno, fmt::format("pread {} at {}", path_, offset + done));
      }
      if (n == 0) break;  // end of file
      done += static_cast<uint64_t>(n);
    }
    return done;
  }

  Status Sync() override {
    if (::fdatasync(fd_) != 0) return ErrnoStatus(errno, fmt::format("fdatasync {}", path_));
    return Status::OK();
  }

  Status Truncate(uint64_t size) override {
    if (::ftruncate(fd_, static_cast<off_t>(size)) != 0) {
      return ErrnoStatus(errno, fmt::format("ftruncate {} to {}", path_, size));
    }
    return Status::OK();
  }

  Status Allocate(uint64_t offset, uint64_t length) override {
    if (::fallocate(fd_, 0, static_cast<off_t>(offset), static_cast<off_t>(length)) == 0)
      return Status::OK();
    if (errno != EOPNOTSUPP) {
      return ErrnoStatus(errno, fmt::format("fallocate {} [{}, +{})", path_, offset, length));
    }
    // File systems without fallocate: extend the size; blocks come on first write.
    struct stat st;
    if (::fstat(fd_, &st) != 0) return ErrnoStatus(errno, fmt::format("fstat {}", path_));
    if (static_cast<uint64_t>(st.st_size) < offset + length &&
        ::ftruncate(fd_, static_cast<off_t>(offset + length)) != 0) {
      return ErrnoStatus(errno, fmt::format("ftruncate {} to {}", path_, offset + length));
    }
    return Status::OK();
  }

  Result<uint64_t> Size() override {
    struct stat st;
    if (::fstat(fd_, &st) != 0) return ErrnoStatus(errno, fmt::format("fstat {}", path_));
    return static_cast<uint64_t>(st.st_size);
  }

  const std::string& path() const override { return path_; }
  int fd() const override { return fd_; }

 private:
  const std::string path_;
  const int fd_;
};

class PosixFileSystem final : public FileSystem {
 public:
  Result<std::unique_ptr<RandomRWFile>> OpenRandomRW(const std::string& path,
                                                     const FileOpenOptions& options) override {
    int flags = O_RDWR | O_CLOEXEC;
    if (options.create) flags |= O_CREAT;
    if (options.direct) flags |= O_DIRECT;
    if (options.dsync) flags |= O_DSYNC;
    int fd;
    do {
      fd = ::open(path.c_str(), flags, 0644);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) {
      if (errno == EINVAL && options.direct) {
        return Status::NotSupported(
            fmt::format("open {}: the file system does not support O_DIRECT", path));
      }
      return ErrnoStatus(errno, fmt::format("open {}", path));
    }
    return std::unique_ptr<RandomRWFile>(new PosixRandomRWFile(path, fd));
  }

  Status CreateDirs(const std::string& path) override {
    std::error_code ec;
    std::filesystem::create_directories(path, ec);
    if (ec) return ErrnoStatus(ec.value(), fmt::format("create directory {}", path));
    return Status::OK();
  }

  Result<std::vector<std::string>> ListDir(const std::string& path) override {
    std::vector<std::string> names;
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(path, ec))
      names.push_back(e.path().filename().string());
    if (ec) return ErrnoStatus(ec.value(), fmt::format("list directory {}", path));
    return names;
  }

  Status DeleteFile(const std::string& path) override {
    if (::unlink(path.c_str()) != 0) return ErrnoStatus(errno, fmt::format("unlink {}", path));
    return Status::OK();
  }

  Result<bool> FileExists(const std::string& path) override {
    struct stat st;
    if (::stat(path.c_str(), &st) == 0) return true;
    if (errno == ENOENT) return false;
    return ErrnoStatus(errno, fmt::format("stat {}", path));
  }

  Status SyncDir(const std::string& path) override {
    const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return ErrnoStatus(errno, fmt::format("open directory {}", path));
    const int rc = ::fsync(fd);
    const int err = errno;
    ::close(fd);
    if (rc != 0) return ErrnoStatus(err, fmt::format("fsync directory {}", path));
    return Status::OK();
  }
};

}  // namespace

FileSystem* FileSystem::Default() {
  static PosixFileSystem* fs = new PosixFileSystem();  // never destroyed: files may outlive statics
  return fs;
}

}  // namespace sparsekv
