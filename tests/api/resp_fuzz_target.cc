// Fuzz target for the RESP request parser (api/server/resp_protocol.h). The input is served as a
// connection would serve it: requests parsed one after another from the front. Checked on every
// input: a whole request consumes at least one byte and no more than there is; arguments lie in
// the input or in the inline storage; "need more" asks for more than is there; the same bytes
// arriving one at a time give the same requests; every request re-encoded as a multibulk
// parses back to the same arguments. GlobMatch runs on pieces of the input. Built with libFuzzer
// when clang is there, and linked into a deterministic mutation driver in every build.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "server/resp_protocol.h"

namespace resp = sparsekv::server::resp;

namespace {

void Check(bool ok) {
  if (!ok) std::abort();
}

struct Served {
  std::vector<std::vector<std::string>> requests;
  bool error = false;
};

Served Serve(std::string_view in, const resp::Limits& limits, bool check) {
  Served out;
  std::vector<std::string_view> args;
  std::vector<std::string> storage;
  size_t at = 0;
  while (at < in.size()) {
    const std::string_view rest = in.substr(at);
    resp::Parsed p = resp::ParseRequest(rest, limits, args, storage);
    if (p.outcome == resp::Outcome::kNeedMore) {
      if (check) Check(p.need > rest.size());
      break;
    }
    if (p.outcome == resp::Outcome::kError) {
      if (check) Check(!p.error.empty() && p.error.rfind("ERR Protocol error: ", 0) == 0);
      out.error = true;
      break;
    }
    if (check) {
      Check(p.consumed > 0 && p.consumed <= rest.size());
      for (std::string_view a : args) {
        bool inside = a.data() >= rest.data() && a.data() + a.size() <= rest.data() + rest.size();
        for (const std::string& s : storage) inside = inside || (a.data() == s.data() && a.size() == s.size());
        Check(inside || a.empty());
      }
    }
    std::vector<std::string> copy(args.begin(), args.end());
    if (!copy.empty()) out.requests.push_back(std::move(copy));
    at += p.consumed;
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  resp::Limits limits;
  limits.max_bulk_bytes = 1u << 16;
  limits.max_args = 4096;
  limits.max_inline_bytes = 1024;
  const Served whole = Serve(in, limits, true);

  // The bytes as a slow client sends them: each request parsed from every prefix until whole.
  if (size <= 512) {
    std::vector<std::string_view> args;
    std::vector<std::string> storage;
    size_t at = 0, got = 0;
    for (size_t end = 1; end <= size && at < size; ++end) {
      resp::Parsed p = resp::ParseRequest(in.substr(at, end - at), limits, args, storage);
      if (p.outcome == resp::Outcome::kError) break;
      if (p.outcome != resp::Outcome::kCommand) continue;
      if (!args.empty()) {
        Check(got < whole.requests.size());
        const auto& w = whole.requests[got++];
        Check(w.size() == args.size());
        for (size_t i = 0; i < args.size(); ++i) Check(w[i] == args[i]);
      }
      at += p.consumed;
    }
  }

  // Every request re-encoded as a multibulk parses back the same.
  for (const auto& r : whole.requests) {
    std::string enc = "*" + std::to_string(r.size()) + "\r\n";
    for (const auto& a : r) enc += "$" + std::to_string(a.size()) + "\r\n" + a + "\r\n";
    const Served again = Serve(enc, limits, true);
    Check(!again.error && again.requests.size() == 1 && again.requests[0] == r);
  }

  // Glob matching on two halves of the input: must not crash, and "*" matches anything.
  const std::string_view pat = in.substr(0, size / 2), text = in.substr(size / 2);
  (void)resp::GlobMatch(pat.substr(0, 64), text.substr(0, 256));
  (void)resp::GlobMatch(pat.substr(0, 64), text.substr(0, 256), true);
  Check(resp::GlobMatch("*", text));
  return 0;
}
