// The RESP codec and key mapping on their own: requests as Redis parses them (multibulk, inline
// with quoting, the errors word for word), replies in RESP2 and RESP3, glob matching, and how a
// key names its record (a collision reads as a miss).
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "server/resp_keys.h"
#include "server/resp_protocol.h"

namespace resp = sparsekv::server::resp;

namespace {

struct One {
  resp::Parsed p;
  std::vector<std::string> args;
};

One Parse(std::string_view in, resp::Limits limits = {}) {
  std::vector<std::string_view> args;
  std::vector<std::string> storage;
  One o;
  o.p = resp::ParseRequest(in, limits, args, storage);
  o.args.assign(args.begin(), args.end());
  return o;
}

TEST(RespParser, MultibulkWithBinaryBytes) {
  const std::string in = std::string("*3\r\n$3\r\nSET\r\n$4\r\na\r\nb\r\n$3\r\n\0x\n\r\nrest", 36);
  One o = Parse(in);
  ASSERT_EQ(o.p.outcome, resp::Outcome::kCommand);
  EXPECT_EQ(o.p.consumed, in.size() - 4);
  ASSERT_EQ(o.args.size(), 3u);
  EXPECT_EQ(o.args[1], "a\r\nb");
  EXPECT_EQ(o.args[2], std::string("\0x\n", 3));
}

TEST(RespParser, EveryPrefixNeedsMoreThanItHas) {
  const std::string in = "*2\r\n$4\r\nECHO\r\n$10\r\n0123456789\r\n";
  for (size_t n = 0; n < in.size(); ++n) {
    One o = Parse(in.substr(0, n));
    ASSERT_EQ(o.p.outcome, resp::Outcome::kNeedMore) << n;
    EXPECT_GT(o.p.need, n) << n;
  }
  EXPECT_EQ(Parse(in).p.outcome, resp::Outcome::kCommand);
}

TEST(RespParser, LargeBulkAsksForItsWholeLength) {
  One o = Parse("*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1000000\r\nabc");
  ASSERT_EQ(o.p.outcome, resp::Outcome::kNeedMore);
  EXPECT_GE(o.p.need, 1000000u);
}

TEST(RespParser, ErrorsAreRedisWords) {
  resp::Limits l;
  l.max_bulk_bytes = 1024;
  EXPECT_EQ(Parse("*1\r\n$2147483648\r\n", l).p.error, "ERR Protocol error: invalid bulk length");
  EXPECT_EQ(Parse("*1\r\n$-1\r\n", l).p.error, "ERR Protocol error: invalid bulk length");
  EXPECT_EQ(Parse("*1\r\n$1025\r\n", l).p.error, "ERR Protocol error: invalid bulk length");
  EXPECT_EQ(Parse("*99999999\r\n", l).p.error, "ERR Protocol error: invalid multibulk length");
  EXPECT_EQ(Parse("*x\r\n", l).p.error, "ERR Protocol error: invalid multibulk length");
  EXPECT_EQ(Parse("*1\r\n:5\r\n", l).p.error, "ERR Protocol error: expected '$', got ':'");
  EXPECT_EQ(Parse("SET \"a b\r\n", l).p.error, "ERR Protocol error: unbalanced quotes in request");
  EXPECT_EQ(Parse("SET \"a\"b c\r\n", l).p.error, "ERR Protocol error: unbalanced quotes in request");
  EXPECT_EQ(Parse(std::string(70000, 'a'), l).p.error, "ERR Protocol error: too big inline request");
  EXPECT_EQ(Parse("*" + std::string(70000, '1'), l).p.error, "ERR Protocol error: too big mbulk count string");
}

TEST(RespParser, EmptyAndNegativeCountsAreNoCommands) {
  for (const char* in : {"*0\r\n", "*-1\r\n", "\r\n", "   \n"}) {
    One o = Parse(in);
    EXPECT_EQ(o.p.outcome, resp::Outcome::kCommand) << in;
    EXPECT_TRUE(o.args.empty()) << in;
    EXPECT_EQ(o.p.consumed, std::strlen(in)) << in;
  }
}

TEST(RespParser, InlineQuoting) {
  One o = Parse("set \"a\\x41\\n\\\"q\" 'it\\'s' plain\n");
  ASSERT_EQ(o.p.outcome, resp::Outcome::kCommand);
  ASSERT_EQ(o.args.size(), 4u);
  EXPECT_EQ(o.args[0], "set");
  EXPECT_EQ(o.args[1], "aA\n\"q");
  EXPECT_EQ(o.args[2], "it's");
  EXPECT_EQ(o.args[3], "plain");
  One crlf = Parse("PING\r\n");
  ASSERT_EQ(crlf.args.size(), 1u);
  EXPECT_EQ(crlf.args[0], "PING");
}

TEST(RespWriter, Resp2AndResp3) {
  std::string two, three;
  resp::RespWriter w2(two, 2), w3(three, 3);
  for (auto* w : {&w2, &w3}) {
    w->Null();
    w->Map(1);
    w->Bulk("k");
    w->Integer(-7);
    w->Boolean(true);
    w->Error("ERR x\r\ny");
  }
  EXPECT_EQ(two, "$-1\r\n*2\r\n$1\r\nk\r\n:-7\r\n:1\r\n-ERR x  y\r\n");
  EXPECT_EQ(three, "_\r\n%1\r\n$1\r\nk\r\n:-7\r\n#t\r\n-ERR x  y\r\n");
}

TEST(RespGlob, AsRedisMatches) {
  EXPECT_TRUE(resp::GlobMatch("*", ""));
  EXPECT_TRUE(resp::GlobMatch("k*", "key"));
  EXPECT_FALSE(resp::GlobMatch("k*", "akey"));
  EXPECT_TRUE(resp::GlobMatch("h?llo", "hello"));
  EXPECT_TRUE(resp::GlobMatch("h[ae]llo", "hallo"));
  EXPECT_FALSE(resp::GlobMatch("h[^e]llo", "hello"));
  EXPECT_TRUE(resp::GlobMatch("h[a-b]llo", "hbllo"));
  EXPECT_TRUE(resp::GlobMatch("a\\*b", "a*b"));
  EXPECT_FALSE(resp::GlobMatch("a\\*b", "axb"));
  EXPECT_TRUE(resp::GlobMatch("*kv_bytes", "chunk:17kv_bytes"));
  EXPECT_TRUE(resp::GlobMatch("*a*b*c*", "xxaxxbxxcxx"));
  EXPECT_FALSE(resp::GlobMatch("*a*b*c*", "xxaxxcxxbxx"));
  EXPECT_TRUE(resp::GlobMatch("SAVE", "save", true));
}

TEST(RespKeys, BridgeKeysNameNativeHashes) {
  const std::string hex = "0123456789abcdef00112233445566ff";
  ASSERT_TRUE(resp::IsBridgeKey(hex));
  EXPECT_FALSE(resp::IsBridgeKey("0123456789ABCDEF00112233445566ff"));  // upper case: an ordinary key
  EXPECT_FALSE(resp::IsBridgeKey(hex.substr(1)));
  const auto h = resp::KeyHash(hex);
  EXPECT_EQ(resp::BridgeKeyOf(h), hex);
  EXPECT_EQ(resp::HeaderBytes(hex), 0u);
  uint64_t lo, hi;
  std::memcpy(&lo, h.data(), 8);
  std::memcpy(&hi, h.data() + 8, 8);
  EXPECT_EQ(hi, 0x0123456789abcdefull);
  EXPECT_EQ(lo, 0x00112233445566ffull);
}

TEST(RespKeys, AnotherKeysRecordIsAMiss) {
  const std::string value = "the value";
  std::vector<std::byte> rec(resp::HeaderBytes("alpha") + value.size());
  resp::WriteHeader("alpha", value.size(), rec.data());
  std::memcpy(rec.data() + resp::HeaderBytes("alpha"), value.data(), value.size());
  auto v = resp::ValueOf(rec, "alpha", 1);
  ASSERT_TRUE(v.has_value());
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(v->data()), v->size()), value);
  // A record read under a hash that another key collides with: the key comparison refuses it.
  EXPECT_FALSE(resp::ValueOf(rec, "alphb", 1).has_value());
  EXPECT_FALSE(resp::ValueOf(rec, "alph", 1).has_value());
  // A damaged length, a native block's bytes: misses, never garbage.
  auto bad = rec;
  bad[8] = std::byte{0x7f};
  EXPECT_FALSE(resp::ValueOf(bad, "alpha", 1).has_value());
  std::vector<std::byte> native(64, std::byte{0x11});
  EXPECT_FALSE(resp::ValueOf(native, "alpha", 1).has_value());
  EXPECT_NE(resp::KeyHash("alpha"), resp::KeyHash("alphb"));
}

TEST(RespKeys, ADeadlineIsKeptInTheRecordAndAValuePastItIsNeverReturned) {
  const std::string value = "expiring";
  const int64_t deadline = 1'700'000'000'123;
  ASSERT_EQ(resp::HeaderBytes("k", true), resp::kExpiringHeaderBytes + 1);
  std::vector<std::byte> rec(resp::HeaderBytes("k", true) + value.size());
  resp::WriteHeader("k", value.size(), rec.data(), deadline);
  std::memcpy(rec.data() + resp::HeaderBytes("k", true), value.data(), value.size());
  const auto parsed = resp::Parse(rec, "k");
  ASSERT_TRUE(parsed.has_value());
  EXPECT_EQ(parsed->deadline_ms, deadline);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(parsed->value.data()), parsed->value.size()), value);
  EXPECT_TRUE(resp::ValueOf(rec, "k", deadline - 1).has_value());
  EXPECT_FALSE(resp::ValueOf(rec, "k", deadline).has_value());  // expired at the deadline, as Redis
  EXPECT_FALSE(resp::ValueOf(rec, "k", deadline + 1).has_value());
  // The fixed part alone says the deadline is 8 bytes further on.
  const auto fixed = resp::ReadFixedHeader(std::span<const std::byte>(rec).first(resp::kFixedHeaderBytes));
  ASSERT_TRUE(fixed.has_value());
  EXPECT_FALSE(fixed->deadline_known);
  EXPECT_EQ(fixed->header_bytes(), resp::kExpiringHeaderBytes + 1);
  // A deadline of 0 in an "SKVE" record is never written: damaged, a miss.
  auto zero = rec;
  std::memset(zero.data() + resp::kFixedHeaderBytes, 0, 8);
  EXPECT_FALSE(resp::Parse(zero, "k").has_value());
  // A plain record has no deadline.
  std::vector<std::byte> plain(resp::HeaderBytes("k") + value.size());
  resp::WriteHeader("k", value.size(), plain.data());
  std::memcpy(plain.data() + resp::HeaderBytes("k"), value.data(), value.size());
  EXPECT_EQ(resp::Parse(plain, "k")->deadline_ms, 0);
  EXPECT_TRUE(resp::ValueOf(plain, "k", INT64_MAX).has_value());
}

}  // namespace
