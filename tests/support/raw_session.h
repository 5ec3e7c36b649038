// Hand-made sessions for the daemon tests that speak the wire protocol themselves (what a
// client of its own, or a hostile one, does): reading whole buffers, and a HELLO over the Unix
// socket with the descriptors its reply passes.
#pragma once

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <array>
#include <cstring>
#include <string>
#include <vector>

#include "protocol/wire.h"

namespace sparsekv::testing {

// Receives exactly `n` bytes; false when the peer closed or the receive failed (a timeout).
inline bool RecvAll(int fd, void* p, size_t n) {
  auto* b = static_cast<std::byte*>(p);
  size_t got = 0;
  while (got < n) {
    const ssize_t k = recv(fd, b + got, n - got, 0);
    if (k <= 0) return false;
    got += static_cast<size_t>(k);
  }
  return true;
}

// Connects to the Unix socket `path` (receives time out after 10 s), says `hello` and reads the
// reply into `reply`, with the descriptors it carried in `fds` (staging, arena, lend table, as
// granted). Fatal test failures on any error: call it under ASSERT_NO_FATAL_FAILURE.
inline void RawHello(const std::string& path, const wire::HelloRequest& hello, int* sock, std::vector<int>* fds,
                     wire::HelloReply* reply) {
  *sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(*sock, 0);
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  std::memcpy(sa.sun_path, path.c_str(), path.size() + 1);
  ASSERT_EQ(connect(*sock, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0) << std::strerror(errno);
  timeval tv{10, 0};
  setsockopt(*sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  const auto frame = wire::EncodeFrame(wire::Opcode::kHello, 0, 1, wire::Encode(hello));
  ASSERT_EQ(send(*sock, frame.data(), frame.size(), MSG_NOSIGNAL), static_cast<ssize_t>(frame.size()));
  std::array<std::byte, wire::kHeaderBytes> hb;
  const ssize_t k = wire::RecvWithFds(*sock, hb.data(), hb.size(), 0, fds);
  ASSERT_GT(k, 0);
  ASSERT_TRUE(RecvAll(*sock, hb.data() + k, hb.size() - static_cast<size_t>(k)));
  auto h = wire::DecodeHeader(hb, wire::kMaxPayloadBytes);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  std::vector<std::byte> p(h->payload_bytes);
  ASSERT_TRUE(RecvAll(*sock, p.data(), p.size()));
  auto r = wire::DecodeHelloReply(p);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  *reply = *r;
}

}  // namespace sparsekv::testing
