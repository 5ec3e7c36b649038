// The Redis serialization protocol (RESP) as sparsekvd speaks it: a parser for requests (RESP
// multibulk arrays of bulk strings, and inline commands as a person types them) and a writer for
// replies in RESP2 or RESP3.
//
// Facts taken from the RESP specification (redis.io/docs/reference/protocol-spec, read
// 2026-11-27) and from Redis 7.0's behaviour as Debian 12's redis-server shows it: a request is
// `*<n>\r\n` followed by n bulk strings `$<len>\r\n<bytes>\r\n`; any other first byte starts an
// inline command, one line split on spaces with "double" and 'single' quoting; `*0` and an empty
// inline line are no commands at all. Errors are the ones Redis sends, word for word, so that a
// client's error handling sees what it would see from Redis.
//
// The parser is stateless: it is handed everything buffered from the start of a request and
// says whether a whole request is there. When it is not, it says how many bytes the request
// needs at least, so that a large value is parsed once when it has all arrived, not once per
// read. Thread safety: the functions are pure; a RespWriter is used by one thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace sparsekv::server::resp {

struct Limits {
  // The longest bulk string a request may carry (a value, a key). Redis: proto-max-bulk-len.
  uint64_t max_bulk_bytes = 512ull << 20;
  // The most arguments of one request. Redis: 1024 * 1024.
  uint32_t max_args = 1024 * 1024;
  // The longest inline command line, and the longest `*<n>` / `$<len>` line. Redis: 64 KiB.
  size_t max_inline_bytes = 64u << 10;
  // Limits for a connection that has not authenticated (Redis: 10 arguments, 16 KiB a bulk
  // string), refused in Redis's words ("unauthenticated multibulk length").
  bool unauthenticated = false;
};

enum class Outcome {
  kCommand,   // a whole request: `args` and `consumed` are set (args may be empty: a no-op)
  kNeedMore,  // not all there yet: `need` is a lower bound on the bytes it takes from the start
  kError,     // a protocol error: `error` is the reply's text; the connection must close
};

struct Parsed {
  Outcome outcome = Outcome::kNeedMore;
  size_t consumed = 0;
  size_t need = 0;
  std::string error;
};

// Parses the request at the start of `in`. Arguments of a multibulk request are views into
// `in`; those of an inline command are unquoted into `inline_storage` (cleared first) and
// viewed there. `args` is cleared first.
Parsed ParseRequest(std::string_view in, const Limits& limits, std::vector<std::string_view>& args,
                    std::vector<std::string>& inline_storage);

// Redis's glob matching (as KEYS, SCAN MATCH and CONFIG GET use it): *, ?, [set], [^set], [a-z],
// and \ to take the next character as it is.
bool GlobMatch(std::string_view pattern, std::string_view text, bool nocase = false);

// Appends replies to a string in the protocol version the connection speaks (2 or 3).
class RespWriter {
 public:
  RespWriter(std::string& out, int protocol) : out_(out), protocol_(protocol) {}
  int protocol() const { return protocol_; }

  void Simple(std::string_view s);  // +s (no CR or LF in s)
  void Error(std::string_view s);   // -s: s starts with its code ("ERR ...", "NOAUTH ...")
  void Integer(int64_t v);
  void Bulk(std::string_view s);
  void BulkHeader(uint64_t bytes);  // $<bytes>\r\n; the caller sends the bytes, then Crlf()
  void Crlf();
  void Null();       // RESP2 $-1, RESP3 _
  void NullArray();  // RESP2 *-1, RESP3 _
  void Array(size_t n);
  void Map(size_t pairs);  // RESP3 %n, RESP2 an array of 2n
  void Set(size_t n);      // RESP3 ~n, RESP2 an array
  void Boolean(bool b);    // RESP3 #t/#f, RESP2 :1/:0
  void Verbatim(std::string_view text);  // RESP3 =<n>\r\ntxt:..., RESP2 a bulk string

 private:
  std::string& out_;
  int protocol_;
};

}  // namespace sparsekv::server::resp
