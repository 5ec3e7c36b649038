// GET /metrics from a daemon's Prometheus endpoint on loopback, for the daemon tests.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <string>

namespace sparsekv::testing {

// The whole HTTP response ("" when nothing answers on `port`).
inline std::string ScrapeMetrics(uint16_t port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return "";
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string body;
  if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0) {
    const char req[] = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
    if (send(fd, req, sizeof(req) - 1, MSG_NOSIGNAL) == static_cast<ssize_t>(sizeof(req) - 1)) {
      char buf[4096];
      ssize_t n;
      while ((n = recv(fd, buf, sizeof(buf), 0)) > 0) body.append(buf, static_cast<size_t>(n));
    }
  }
  close(fd);
  return body;
}

// The value of the unlabelled metric `name` on the daemon's /metrics at `port`; -1 when absent.
inline double MetricValue(uint16_t port, const std::string& name) {
  const std::string m = ScrapeMetrics(port);
  const std::string key = "\n" + name + " ";
  const size_t at = m.find(key);
  return at == std::string::npos ? -1 : std::stod(m.substr(at + key.size()));
}

}  // namespace sparsekv::testing
