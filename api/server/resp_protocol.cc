#include "server/resp_protocol.h"

#include <fmt/format.h>

#include <cctype>
#include <charconv>

namespace sparsekv::server::resp {
namespace {

constexpr std::string_view kCrlf = "\r\n";

// A whole decimal integer (optional '-'), nothing else; false otherwise.
bool ParseInt(std::string_view s, int64_t& out) {
  if (s.empty() || s.size() > 20) return false;
  const char* first = s.data();
  if (*first == '+') return false;
  auto [p, ec] = std::from_chars(first, s.data() + s.size(), out);
  return ec == std::errc() && p == s.data() + s.size();
}

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

bool IsSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

// Splits an inline command line as redis-cli and Redis do: words separated by white space, a
// word in "double quotes" takes the escapes \n \r \t \b \a \\ \" and \xHH, one in 'single quotes'
// only \'. A closing quote must end its word. False on unbalanced quotes.
bool SplitInline(std::string_view line, std::vector<std::string>& out) {
  size_t i = 0;
  const size_t n = line.size();
  while (true) {
    while (i < n && IsSpace(line[i])) ++i;
    if (i >= n) return true;
    std::string word;
    bool in_double = false, in_single = false, done = false;
    while (!done) {
      if (in_double) {
        if (i >= n) return false;
        const char c = line[i];
        if (c == '\\' && i + 3 < n && line[i + 1] == 'x' && HexDigit(line[i + 2]) >= 0 && HexDigit(line[i + 3]) >= 0) {
          word += static_cast<char>(HexDigit(line[i + 2]) * 16 + HexDigit(line[i + 3]));
          i += 4;
        } else if (c == '\\' && i + 1 < n) {
          const char e = line[i + 1];
          switch (e) {
            case 'n': word += '\n'; break;
            case 'r': word += '\r'; break;
            case 't': word += '\t'; break;
            case 'b': word += '\b'; break;
            case 'a': word += '\a'; break;
            default: word += e; break;
          }
          i += 2;
        } else if (c == '"') {
          if (i + 1 < n && !IsSpace(line[i + 1])) return false;
          ++i;
          done = true;
        } else {
          word += c;
          ++i;
        }
      } else if (in_single) {
        if (i >= n) return false;
        const char c = line[i];
        if (c == '\\' && i + 1 < n && line[i + 1] == '\'') {
          word += '\'';
          i += 2;
        } else if (c == '\'') {
          if (i + 1 < n && !IsSpace(line[i + 1])) return false;
          ++i;
          done = true;
        } else {
          word += c;
          ++i;
        }
      } else {
        if (i >= n) {
          done = true;
          break;
        }
        const char c = line[i];
        if (IsSpace(c)) {
          done = true;
        } else if (c == '"') {
          in_double = true;
          ++i;
        } else if (c == '\'') {
          in_single = true;
          ++i;
        } else {
          word += c;
          ++i;
        }
      }
    }
    out.push_back(std::move(word));
  }
}

Parsed Error(std::string msg) {
  Parsed p;
  p.outcome = Outcome::kError;
  p.error = std::move(msg);
  return p;
}

Parsed NeedMore(size_t need) {
  Parsed p;
  p.outcome = Outcome::kNeedMore;
  p.need = need;
  return p;
}

Parsed ParseInline(std::string_view in, const Limits& limits, std::vector<std::string_view>& args,
                   std::vector<std::string>& storage) {
  const size_t nl = in.find('\n');
  if (nl == std::string_view::npos) {
    if (in.size() > limits.max_inline_bytes) return Error("ERR Protocol error: too big inline request");
    return NeedMore(in.size() + 1);
  }
  if (nl > limits.max_inline_bytes) return Error("ERR Protocol error: too big inline request");
  std::string_view line = in.substr(0, nl);
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  if (!SplitInline(line, storage)) return Error("ERR Protocol error: unbalanced quotes in request");
  for (const std::string& s : storage) args.emplace_back(s);
  Parsed p;
  p.outcome = Outcome::kCommand;
  p.consumed = nl + 1;
  return p;
}

}  // namespace

Parsed ParseRequest(std::string_view in, const Limits& limits, std::vector<std::string_view>& args,
                    std::vector<std::string>& inline_storage) {
  args.clear();
  inline_storage.clear();
  if (in.empty()) return NeedMore(1);
  if (in[0] != '*') return ParseInline(in, limits, args, inline_storage);

  size_t pos = 0;
  // `*<n>\r\n`
  size_t eol = in.find(kCrlf);
  if (eol == std::string_view::npos) {
    if (in.size() > limits.max_inline_bytes) return Error("ERR Protocol error: too big mbulk count string");
    return NeedMore(in.size() + 1);
  }
  if (eol > limits.max_inline_bytes) return Error("ERR Protocol error: too big mbulk count string");
  int64_t count = 0;
  if (!ParseInt(in.substr(1, eol - 1), count)) return Error("ERR Protocol error: invalid multibulk length");
  if (count > static_cast<int64_t>(limits.max_args)) {
    return Error(limits.unauthenticated ? "ERR Protocol error: unauthenticated multibulk length"
                                        : "ERR Protocol error: invalid multibulk length");
  }
  pos = eol + 2;
  if (count <= 0) {
    Parsed p;
    p.outcome = Outcome::kCommand;
    p.consumed = pos;
    return p;
  }
  // Reserve for what has arrived, not for what the count claims: a count of a million with
  // nothing behind it costs nothing.
  args.reserve(static_cast<size_t>(std::min<int64_t>(count, 1024)));
  for (int64_t i = 0; i < count; ++i) {
    if (pos >= in.size()) return NeedMore(pos + 4 * static_cast<size_t>(count - i));
    if (in[pos] != '$') {
      const char c = in[pos];
      return Error(fmt::format("ERR Protocol error: expected '$', got '{}'", std::isprint(static_cast<unsigned char>(c)) ? c : ' '));
    }
    eol = in.find(kCrlf, pos);
    if (eol == std::string_view::npos) {
      if (in.size() - pos > limits.max_inline_bytes) return Error("ERR Protocol error: too big bulk count string");
      return NeedMore(in.size() + 1);
    }
    if (eol - pos > limits.max_inline_bytes) return Error("ERR Protocol error: too big bulk count string");
    int64_t len = 0;
    if (!ParseInt(in.substr(pos + 1, eol - pos - 1), len) || len < 0) {
      return Error("ERR Protocol error: invalid bulk length");
    }
    if (static_cast<uint64_t>(len) > limits.max_bulk_bytes) {
      return Error(limits.unauthenticated ? "ERR Protocol error: unauthenticated bulk length"
                                          : "ERR Protocol error: invalid bulk length");
    }
    const size_t start = eol + 2;
    const size_t end = start + static_cast<size_t>(len);
    if (in.size() < end + 2) return NeedMore(end + 2 + 4 * static_cast<size_t>(count - i - 1));
    if (in[end] != '\r' || in[end + 1] != '\n') return Error("ERR Protocol error: expected CRLF after a bulk string");
    args.push_back(in.substr(start, static_cast<size_t>(len)));
    pos = end + 2;
  }
  Parsed p;
  p.outcome = Outcome::kCommand;
  p.consumed = pos;
  return p;
}

bool GlobMatch(std::string_view pattern, std::string_view text, bool nocase) {
  auto lower = [nocase](char c) { return nocase ? static_cast<char>(std::tolower(static_cast<unsigned char>(c))) : c; };
  size_t p = 0, t = 0;
  // Backtracking point for the last '*': the pattern position after it and the text position
  // it has eaten up to.
  size_t star_p = std::string_view::npos, star_t = 0;
  while (t < text.size()) {
    if (p < pattern.size()) {
      const char pc = pattern[p];
      if (pc == '*') {
        while (p < pattern.size() && pattern[p] == '*') ++p;
        if (p == pattern.size()) return true;
        star_p = p;
        star_t = t;
        continue;
      }
      bool ok = false;
      size_t next = p + 1;
      if (pc == '?') {
        ok = true;
      } else if (pc == '[') {
        size_t q = p + 1;
        bool negate = false;
        if (q < pattern.size() && pattern[q] == '^') {
          negate = true;
          ++q;
        }
        bool match = false;
        while (q < pattern.size() && pattern[q] != ']') {
          if (pattern[q] == '\\' && q + 1 < pattern.size()) {
            ++q;
            if (lower(pattern[q]) == lower(text[t])) match = true;
            ++q;
          } else if (q + 2 < pattern.size() && pattern[q + 1] == '-' && pattern[q + 2] != ']') {
            char a = lower(pattern[q]), b = lower(pattern[q + 2]);
            if (a > b) std::swap(a, b);
            const char c = lower(text[t]);
            if (c >= a && c <= b) match = true;
            q += 3;
          } else {
            if (lower(pattern[q]) == lower(text[t])) match = true;
            ++q;
          }
        }
        next = q < pattern.size() ? q + 1 : q;  // past ']' (an unclosed set ends the pattern)
        ok = negate ? !match : match;
      } else if (pc == '\\' && p + 1 < pattern.size()) {
        ok = lower(pattern[p + 1]) == lower(text[t]);
        next = p + 2;
      } else {
        ok = lower(pc) == lower(text[t]);
      }
      if (ok) {
        p = next;
        ++t;
        continue;
      }
    }
    if (star_p == std::string_view::npos) return false;
    p = star_p;
    t = ++star_t;
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

void RespWriter::Simple(std::string_view s) {
  out_ += '+';
  out_ += s;
  out_ += kCrlf;
}

void RespWriter::Error(std::string_view s) {
  out_ += '-';
  // An error line cannot hold CR or LF: Redis replaces them with spaces.
  for (char c : s) out_ += (c == '\r' || c == '\n') ? ' ' : c;
  out_ += kCrlf;
}

void RespWriter::Integer(int64_t v) { fmt::format_to(std::back_inserter(out_), ":{}\r\n", v); }

void RespWriter::BulkHeader(uint64_t bytes) { fmt::format_to(std::back_inserter(out_), "${}\r\n", bytes); }

void RespWriter::Crlf() { out_ += kCrlf; }

void RespWriter::Bulk(std::string_view s) {
  BulkHeader(s.size());
  out_ += s;
  out_ += kCrlf;
}

void RespWriter::Null() { out_ += protocol_ >= 3 ? "_\r\n" : "$-1\r\n"; }

void RespWriter::NullArray() { out_ += protocol_ >= 3 ? "_\r\n" : "*-1\r\n"; }

void RespWriter::Array(size_t n) { fmt::format_to(std::back_inserter(out_), "*{}\r\n", n); }

void RespWriter::Map(size_t pairs) {
  if (protocol_ >= 3) {
    fmt::format_to(std::back_inserter(out_), "%{}\r\n", pairs);
  } else {
    Array(2 * pairs);
  }
}

void RespWriter::Set(size_t n) {
  if (protocol_ >= 3) {
    fmt::format_to(std::back_inserter(out_), "~{}\r\n", n);
  } else {
    Array(n);
  }
}

void RespWriter::Boolean(bool b) {
  if (protocol_ >= 3) {
    out_ += b ? "#t\r\n" : "#f\r\n";
  } else {
    out_ += b ? ":1\r\n" : ":0\r\n";
  }
}

void RespWriter::Verbatim(std::string_view text) {
  if (protocol_ < 3) return Bulk(text);
  fmt::format_to(std::back_inserter(out_), "={}\r\ntxt:", text.size() + 4);
  out_ += text;
  out_ += kCrlf;
}

}  // namespace sparsekv::server::resp
