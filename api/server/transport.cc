#include "server/transport.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <thread>

namespace sparsekv::server {

namespace asio = boost::asio;

Result<asio::ip::tcp::endpoint> ParseTcp(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) {
    return Status::InvalidArgument(fmt::format("listen address '{}' is not HOST:PORT", address));
  }
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
  if (host == "localhost") host = "127.0.0.1";
  boost::system::error_code ec;
  auto ip = asio::ip::make_address(host, ec);
  if (ec) return Status::InvalidArgument(fmt::format("listen address '{}': '{}' is not an IP address", address, host));
  unsigned long port = 0;
  try {
    port = std::stoul(address.substr(colon + 1));
  } catch (...) {
    port = 70000;
  }
  if (port > 65535) return Status::InvalidArgument(fmt::format("listen address '{}': bad port", address));
  return asio::ip::tcp::endpoint(ip, static_cast<uint16_t>(port));
}

// Claims `path` for a listening Unix socket. Nothing there, or a stale socket file (nobody
// accepts on it: ECONNREFUSED) is fine, and the stale file is removed; a socket a process still
// accepts on is never removed, since that would cut its clients off for good. The probe connects
// without blocking, so a listener whose backlog is full (EAGAIN) counts as alive too.
Status ClaimUnixPath(const std::string& path) {
  struct stat st{};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return Status::OK();
    return Status::IOError(fmt::format("unix socket path {}: {}", path, std::strerror(errno)));
  }
  if (!S_ISSOCK(st.st_mode)) {
    return Status::AlreadyExists(
        fmt::format("unix socket path {} exists and is not a socket; expected a socket file or nothing there", path));
  }
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  if (path.size() >= sizeof(sa.sun_path)) {
    return Status::InvalidArgument(
        fmt::format("unix socket path {} is {} bytes; at most {} fit", path, path.size(), sizeof(sa.sun_path) - 1));
  }
  std::memcpy(sa.sun_path, path.c_str(), path.size() + 1);
  const int probe = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (probe < 0) return Status::IOError(fmt::format("unix socket {}: socket(): {}", path, std::strerror(errno)));
  int rc;
  do {
    rc = ::connect(probe, reinterpret_cast<const sockaddr*>(&sa), sizeof(sa));
  } while (rc != 0 && errno == EINTR);
  const int err = rc == 0 ? 0 : errno;
  std::string owner;
  if (rc == 0) {
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (::getsockopt(probe, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0 && cred.pid > 0) {
      owner = fmt::format(" (pid {})", cred.pid);
    }
  }
  ::close(probe);
  if (rc == 0 || err == EAGAIN) {
    return Status::AlreadyExists(fmt::format(
        "unix socket {} is in use: another daemon{} accepts connections on it; stop it or choose another "
        "unix_socket",
        path, owner));
  }
  if (err == ENOENT) return Status::OK();  // removed meanwhile
  if (err != ECONNREFUSED) {
    return Status::IOError(fmt::format("unix socket {}: cannot tell whether a daemon serves it (connect: {}); "
                                       "left in place",
                                       path, std::strerror(err)));
  }
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    return Status::IOError(fmt::format("unix socket {}: cannot remove the stale socket file: {}", path,
                                       std::strerror(errno)));
  }
  spdlog::info("removed the stale socket file {} (nobody accepted on it)", path);
  return Status::OK();
}


// Constant-time comparison, so a token cannot be guessed byte by byte from reply timing.
bool TokenEquals(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned char>(x ^ y);
  }
  return diff == 0;
}

DirectoryLock::DirectoryLock(const std::string& dir) {
  fd_ = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd_ < 0) return;
  for (int i = 0; i < 200; ++i) {
    if (::flock(fd_, LOCK_EX | LOCK_NB) == 0) return;
    if (errno != EWOULDBLOCK && errno != EINTR) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  spdlog::warn("could not lock directory {} while claiming its unix socket; going on without", dir);
  ::close(fd_);
  fd_ = -1;
}

Result<std::unique_ptr<asio::ip::tcp::acceptor>> ListenTcp(asio::io_context& io, const std::string& address,
                                                            std::string_view what, int backlog) {
  SPARSEKV_ASSIGN_OR_RETURN(auto ep, ParseTcp(address));
  boost::system::error_code ec;
  auto acceptor = std::make_unique<asio::ip::tcp::acceptor>(io);
  acceptor->open(ep.protocol(), ec);
  if (!ec) acceptor->set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) acceptor->bind(ep, ec);
  if (!ec) acceptor->listen(backlog, ec);
  if (ec) return Status::IOError(fmt::format("{} {}: {}", what, address, ec.message()));
  return acceptor;
}

std::string BoundAddress(const asio::ip::tcp::acceptor& acceptor) {
  boost::system::error_code ec;
  const auto bound = acceptor.local_endpoint(ec);
  return ec ? std::string() : fmt::format("{}:{}", bound.address().to_string(), bound.port());
}

Status UnixListener::Listen(asio::io_context& io, const std::string& path, std::string_view what) {
  DirectoryLock dir_lock(std::filesystem::path(path).parent_path().string());
  SPARSEKV_RETURN_IF_ERROR(ClaimUnixPath(path));
  boost::system::error_code ec;
  auto acceptor = std::make_unique<asio::local::stream_protocol::acceptor>(io);
  asio::local::stream_protocol::endpoint ep(path);
  acceptor->open(ep.protocol(), ec);
  if (!ec) acceptor->bind(ep, ec);
  if (ec) return Status::IOError(fmt::format("{} unix:{}: {}", what, path, ec.message()));
  path_ = path;
  struct stat st{};
  if (::stat(path.c_str(), &st) == 0) bound_ = std::make_pair(st.st_dev, st.st_ino);
  acceptor->listen(asio::socket_base::max_listen_connections, ec);
  if (ec) return Status::IOError(fmt::format("{} unix:{}: {}", what, path, ec.message()));
  acceptor_ = std::move(acceptor);
  return Status::OK();
}

void UnixListener::Release() {
  if (!bound_) return;
  struct stat st{};
  if (::stat(path_.c_str(), &st) == 0 && st.st_dev == bound_->first && st.st_ino == bound_->second) {
    ::unlink(path_.c_str());
  } else {
    spdlog::warn("unix socket {} no longer names this daemon's socket; left in place", path_);
  }
  bound_.reset();
}

}  // namespace sparsekv::server
