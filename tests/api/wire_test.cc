#include "protocol/wire.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>

namespace sparsekv::wire {
namespace {

using ::testing::HasSubstr;

WireHash H(uint8_t seed) {
  WireHash h{};
  for (size_t i = 0; i < h.size(); ++i) h[i] = std::byte(seed + i);
  return h;
}

TEST(Wire, HeaderRoundTripAndChecksum) {
  FrameHeader h;
  h.opcode = Opcode::kGet;
  h.flags = kFlagResponse;
  h.request_id = 0x1122334455667788ull;
  h.payload_bytes = 1234;
  auto bytes = EncodeHeader(h);
  auto back = DecodeHeader(bytes, kMaxPayloadBytes);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->opcode, Opcode::kGet);
  EXPECT_EQ(back->request_id, h.request_id);
  EXPECT_EQ(back->payload_bytes, 1234u);
  // Every single-bit flip of the header is caught.
  for (size_t bit = 0; bit < kHeaderBytes * 8; ++bit) {
    auto bad = bytes;
    bad[bit / 8] ^= std::byte(1u << (bit % 8));
    EXPECT_FALSE(DecodeHeader(bad, kMaxPayloadBytes).ok()) << "bit " << bit;
  }
}

TEST(Wire, HeaderErrorsNameTheFault) {
  FrameHeader h;
  h.payload_bytes = 100;
  auto bytes = EncodeHeader(h);
  EXPECT_THAT(std::string(DecodeHeader(std::span(bytes).first(10), 1000).status().message()),
              HasSubstr("expected 32"));
  EXPECT_EQ(DecodeHeader(bytes, 99).status().code(), StatusCode::kResourceExhausted);
  auto bad_magic = bytes;
  bad_magic[0] = std::byte{'X'};
  EXPECT_THAT(std::string(DecodeHeader(bad_magic, 1000).status().message()), HasSubstr("magic"));
}

TEST(Wire, FramePayloadChecksum) {
  std::vector<std::byte> payload(64, std::byte{1});
  auto frame = EncodeFrame(Opcode::kPut, 0, 5, payload);
  auto h = DecodeHeader(frame, kMaxPayloadBytes);
  ASSERT_TRUE(h.ok());
  auto body = std::span(frame).subspan(kHeaderBytes);
  EXPECT_TRUE(VerifyPayload(*h, body).ok());
  frame[kHeaderBytes + 10] ^= std::byte{4};
  EXPECT_EQ(VerifyPayload(*h, body).code(), StatusCode::kCorruption);
  EXPECT_FALSE(VerifyPayload(*h, body.first(10)).ok());
}

// A PUT sent gathered (the client's path) must be byte for byte the frame EncodeFrame makes of
// Encode(request): the daemon cannot tell them apart.
TEST(Wire, APutSentAsPiecesIsTheEncodedFrame) {
  std::vector<std::vector<std::byte>> values;
  for (size_t n : {size_t{0}, size_t{1}, size_t{4095}, size_t{70000}, size_t{0}, size_t{33}}) {
    std::vector<std::byte> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = std::byte(static_cast<uint8_t>(i * 7 + n));
    values.push_back(std::move(v));
  }
  // Every shape: no item, one, empty bundles first, last and in the middle.
  for (size_t first = 0; first <= values.size(); ++first) {
    for (size_t count = 0; first + count <= values.size(); ++count) {
      PutRequest req;
      for (size_t i = first; i < first + count; ++i) req.items.push_back({H(static_cast<uint8_t>(i)), values[i]});
      const std::vector<std::byte> payload = Encode(req);
      std::vector<std::byte> framing;
      const auto pieces = EncodePieces(req, framing);
      std::vector<std::byte> joined;
      for (const auto& piece : pieces) joined.insert(joined.end(), piece.begin(), piece.end());
      ASSERT_EQ(joined, payload) << "items [" << first << ", +" << count << ")";
      EXPECT_EQ(PayloadChecksum(pieces), PayloadChecksum(payload));
      const std::vector<std::byte> frame = EncodeFrame(Opcode::kPut, 0, 77, payload);
      const auto header = EncodeFrameHeader(Opcode::kPut, 0, 77, pieces);
      EXPECT_TRUE(std::equal(header.begin(), header.end(), frame.begin()));
      auto back = DecodePutRequest(joined, kMaxPayloadBytes);
      ASSERT_TRUE(back.ok()) << back.status().ToString();
      ASSERT_EQ(back->items.size(), count);
    }
  }
  // The checksum of pieces is that of their concatenation however they are cut.
  std::vector<std::byte> all(values[3]);
  const std::span<const std::byte> whole(all);
  const std::span<const std::byte> cut[3] = {whole.first(1), whole.subspan(1, 4096), whole.subspan(4097)};
  EXPECT_EQ(PayloadChecksum(cut), PayloadChecksum(whole));
  all[5000] ^= std::byte{1};
  EXPECT_NE(PayloadChecksum(cut), PayloadChecksum(values[3]));
}

TEST(Wire, MessagesRoundTrip) {
  HelloRequest hello{kProtocolVersion, "ns", "tok", "engine", true};
  auto hr = DecodeHelloRequest(Encode(hello));
  ASSERT_TRUE(hr.ok());
  EXPECT_EQ(hr->namespace_name, "ns");
  EXPECT_EQ(hr->token, "tok");
  EXPECT_TRUE(hr->want_shared_memory);

  HelloReply hreply{77, 1u << 20, 128, 64u << 20, "sparsekvd test", 3ull << 30};
  auto hre = Encode(hreply);
  auto hrr = DecodeHelloReply(hre);
  ASSERT_TRUE(hrr.ok()) << hrr.status().ToString();
  EXPECT_EQ(hrr->session_id, 77u);
  EXPECT_EQ(hrr->shm_staging_bytes, 64u << 20);
  EXPECT_EQ(hrr->server_version, "sparsekvd test");
  EXPECT_EQ(hrr->shm_arena_bytes, 3ull << 30);
  hre.pop_back();  // cut short: refused
  EXPECT_FALSE(DecodeHelloReply(hre).ok());

  std::vector<std::byte> b1(10, std::byte{1}), b2(3, std::byte{2});
  PutRequest put{{PutItem{H(1), b1}, PutItem{H(2), b2}}};
  auto enc = Encode(put);
  auto pr = DecodePutRequest(enc, 1024);
  ASSERT_TRUE(pr.ok());
  ASSERT_EQ(pr->items.size(), 2u);
  EXPECT_EQ(pr->items[1].hash, H(2));
  EXPECT_EQ(pr->items[1].bundle.size(), 3u);
  EXPECT_EQ(pr->items[0].bundle[9], std::byte{1});
  EXPECT_EQ(DecodePutRequest(enc, 5).status().code(), StatusCode::kInvalidArgument);  // bundle over limit

  GetReply get{{GetItem{{}, b1}, GetItem{{StatusCode::kPermissionDenied, "other namespace"}, {}}}};
  auto genc = Encode(get);
  auto gr = DecodeGetReply(genc, 1024);
  ASSERT_TRUE(gr.ok());
  EXPECT_EQ(gr->items[1].status.code, StatusCode::kPermissionDenied);
  EXPECT_EQ(gr->items[1].status.message, "other namespace");
  EXPECT_EQ(gr->items[0].bundle.size(), b1.size());
  // A verdict of 1 turns an item into Corruption without its bytes; other values are refused.
  GetReply bad_get{{GetItem{{}, b1, 1}}};
  auto bge = Encode(bad_get);
  auto bgr = DecodeGetReply(bge, 1024);
  ASSERT_TRUE(bgr.ok());
  EXPECT_EQ(bgr->items[0].status.code, StatusCode::kCorruption);
  EXPECT_TRUE(bgr->items[0].bundle.empty());
  bge.back() = std::byte{7};
  EXPECT_FALSE(DecodeGetReply(bge, 1024).ok());
  // Deferred items (protocol 3): one status byte, kDeferredCode, nothing after it; a verdict
  // other than 0 on one is malformed, and the code is meaningless in any other reply.
  GetReply partial{{GetItem{{}, b1}, GetItem{{}, {}, 0, true}, GetItem{{}, {}, 0, true}}};
  auto penc = Encode(partial);
  EXPECT_EQ(penc.size(), 4 + (1 + 4 + b1.size()) + 1 + 1 + 3);
  auto pr2 = DecodeGetReply(penc, 1024);
  ASSERT_TRUE(pr2.ok()) << pr2.status().ToString();
  EXPECT_FALSE(pr2->items[0].deferred);
  EXPECT_TRUE(pr2->items[1].deferred);
  EXPECT_TRUE(pr2->items[2].deferred);
  EXPECT_EQ(pr2->items[0].bundle.size(), b1.size());
  penc.back() = std::byte{1};
  EXPECT_FALSE(DecodeGetReply(penc, 1024).ok());
  StatusListReply deferred_status{{ItemStatus{}}};
  auto denc = Encode(deferred_status);
  denc[4] = std::byte{kDeferredCode};
  EXPECT_FALSE(DecodeStatusListReply(denc).ok());

  LookupReply lr{2, {1, 2, 0}};
  auto lrr = DecodeLookupReply(Encode(lr));
  ASSERT_TRUE(lrr.ok());
  EXPECT_EQ(lrr->prefix_blocks, 2u);
  EXPECT_EQ(lrr->tiers, lr.tiers);

  EventBatch ev{42, {EventRecord{1, 1, {H(3)}}, EventRecord{3, 0, {}}}};
  auto er = DecodeEventBatch(Encode(ev));
  ASSERT_TRUE(er.ok());
  EXPECT_EQ(er->sequence, 42u);
  EXPECT_EQ(er->events[1].type, 3);

  ShmGetReply sg{{ItemStatus{}, ItemStatus{StatusCode::kNotFound, "gone"}}, {ShmSlot{H(4), 8192, 77}}, {}};
  auto sgr = DecodeShmGetReply(Encode(sg));
  ASSERT_TRUE(sgr.ok());
  ASSERT_EQ(sgr->slots.size(), 1u);
  EXPECT_EQ(sgr->slots[0].offset, 8192u);
}

TEST(Wire, MalformedPayloadsAreRefused) {
  // A count that promises more items than the bytes can hold.
  PayloadWriter w;
  w.U32(1000);
  w.Bytes(H(1));
  EXPECT_THAT(std::string(DecodeHashList(w.bytes()).status().message()), HasSubstr("only 16 bytes follow"));
  // Trailing bytes.
  auto ok = Encode(HashList{{H(1)}});
  ok.push_back(std::byte{0});
  EXPECT_THAT(std::string(DecodeHashList(ok).status().message()), HasSubstr("trailing"));
  // A string whose length runs past the end.
  PayloadWriter s;
  s.U16(1);
  s.U32(0x7fffffff);
  EXPECT_FALSE(DecodeHelloRequest(s.bytes()).ok());
  // Empty namespace.
  EXPECT_FALSE(DecodeHelloRequest(Encode(HelloRequest{kProtocolVersion, "", "", "", false})).ok());
  // Unknown status code in a reply.
  PayloadWriter st;
  st.U32(1);
  st.U8(200);
  EXPECT_FALSE(DecodeStatusListReply(st.bytes()).ok());
  // LOOKUP prefix longer than the list.
  PayloadWriter lk;
  lk.U32(5);
  lk.U32(1);
  lk.U8(1);
  EXPECT_FALSE(DecodeLookupReply(lk.bytes()).ok());
}

// HINT and HINT_DROP: round trips, and what is refused.
// Write leases (issue 47): HELLO's flag bit 1, the reply's trailing byte only when asked, and
// PUT_LEASE / PUT_COMMIT.
TEST(Wire, WriteLeaseMessagesRoundTrip) {
  HelloRequest hello{kProtocolVersion, "ns", "tok", "engine", true};
  hello.want_write_leases = true;
  auto enc = Encode(hello);
  EXPECT_EQ(enc.back(), std::byte{3});
  auto hr = DecodeHelloRequest(enc);
  ASSERT_TRUE(hr.ok());
  EXPECT_TRUE(hr->want_shared_memory && hr->want_write_leases);
  enc.back() = std::byte{2};  // leases without shared memory: refused
  EXPECT_FALSE(DecodeHelloRequest(enc).ok());
  hello.want_shared_memory = false;  // bit 1 is only sent with bit 0
  EXPECT_EQ(Encode(hello).back(), std::byte{0});

  HelloReply old{77, 1u << 20, 128, 64u << 20, "sparsekvd", 3ull << 30};
  auto plain = DecodeHelloReply(Encode(old));
  ASSERT_TRUE(plain.ok());
  EXPECT_FALSE(plain->write_leases.has_value());  // what every reply to an old client looks like
  HelloReply granted = old;
  granted.write_leases = true;
  EXPECT_EQ(Encode(granted).size(), Encode(old).size() + 1);
  auto with = DecodeHelloReply(Encode(granted));
  ASSERT_TRUE(with.ok());
  EXPECT_EQ(with->write_leases, std::optional<bool>(true));

  PutLeaseRequest lease{{{H(1), 65536}, {H(2), 0}}};
  auto lr = DecodePutLeaseRequest(Encode(lease));
  ASSERT_TRUE(lr.ok());
  ASSERT_EQ(lr->items.size(), 2u);
  EXPECT_EQ(lr->items[0].hash, H(1));
  EXPECT_EQ(lr->items[0].bytes, 65536u);
  PutCommitRequest commit{42, 7, {1, 0, ~uint64_t{0}}};
  auto cr = DecodePutCommitRequest(Encode(commit));
  ASSERT_TRUE(cr.ok());
  EXPECT_EQ(cr->lease, 42u);
  EXPECT_EQ(cr->first, 7u);
  EXPECT_EQ(cr->checksums, commit.checksums);
  auto cut = Encode(commit);
  cut.pop_back();
  EXPECT_FALSE(DecodePutCommitRequest(cut).ok());
  EXPECT_EQ(OpcodeName(Opcode::kPutLease), "PUT_LEASE");
  EXPECT_EQ(OpcodeName(Opcode::kPutCommit), "PUT_COMMIT");
}

// Local reads (issue 47): HELLO's flag bit 2, the reply's two trailing bytes when asked, the
// SHM_GET reply's lend part, and TOUCH.
TEST(Wire, LocalReadMessagesRoundTrip) {
  HelloRequest hello{kProtocolVersion, "ns", "tok", "engine", true};
  hello.want_lend_table = true;
  auto enc = Encode(hello);
  EXPECT_EQ(enc.back(), std::byte{5});
  auto hr = DecodeHelloRequest(enc);
  ASSERT_TRUE(hr.ok());
  EXPECT_TRUE(hr->want_shared_memory && hr->want_lend_table && !hr->want_write_leases);
  hello.want_write_leases = true;
  EXPECT_EQ(Encode(hello).back(), std::byte{7});
  for (uint8_t bad : {2, 4, 6, 8, 255}) {  // bits 1 and 2 only with bit 0; no other bit
    enc.back() = std::byte{bad};
    EXPECT_FALSE(DecodeHelloRequest(enc).ok()) << int(bad);
  }
  hello.want_shared_memory = false;
  EXPECT_EQ(Encode(hello).back(), std::byte{0});

  HelloReply old{77, 1u << 20, 128, 64u << 20, "sparsekvd", 3ull << 30};
  HelloReply lend = old;
  lend.lend_table = 2;  // asked without write leases: the lease byte (0) comes first anyway
  EXPECT_EQ(Encode(lend).size(), Encode(old).size() + 2);
  auto lr = DecodeHelloReply(Encode(lend));
  ASSERT_TRUE(lr.ok());
  EXPECT_EQ(lr->lend_table, std::optional<uint8_t>(2));
  EXPECT_EQ(lr->write_leases, std::optional<bool>(false));
  auto bad_flag = Encode(lend);
  bad_flag.back() = std::byte{3};
  EXPECT_FALSE(DecodeHelloReply(bad_flag).ok());
  bad_flag.push_back(std::byte{0});  // three trailing bytes: nothing sends that
  EXPECT_FALSE(DecodeHelloReply(bad_flag).ok());

  ShmGetReply sg{{ItemStatus{}, ItemStatus{StatusCode::kNotFound, "gone"}, ItemStatus{}},
                 {ShmSlot{H(4), 8192, 77}, ShmSlot{H(5), 1 << 20, 4096}},
                 {LendInfo{9, 4096, 0x1234}, LendInfo{}}};
  auto sgr = DecodeShmGetReply(Encode(sg));
  ASSERT_TRUE(sgr.ok()) << sgr.status().ToString();
  ASSERT_EQ(sgr->lend.size(), 2u);
  EXPECT_EQ(sgr->lend[0].token, 9u);
  EXPECT_EQ(sgr->lend[0].record_offset, 4096u);
  EXPECT_EQ(sgr->lend[0].checksum, 0x1234u);
  EXPECT_EQ(sgr->lend[1].token, 0u);
  // A lend part that does not name every slot is refused, as is a cut one.
  ShmGetReply short_lend = sg;
  short_lend.lend.pop_back();
  EXPECT_FALSE(DecodeShmGetReply(Encode(short_lend)).ok());
  auto cut = Encode(sg);
  cut.pop_back();
  EXPECT_FALSE(DecodeShmGetReply(cut).ok());
  // Without a lend part, the reply is what it always was.
  ShmGetReply plain = sg;
  plain.lend.clear();
  EXPECT_EQ(Encode(plain).size() + 4 + 2 * 20, Encode(sg).size());
  EXPECT_EQ(OpcodeName(Opcode::kTouch), "TOUCH");
  EXPECT_TRUE(DecodeHeader(EncodeFrame(Opcode::kTouch, 0, 1, Encode(HashList{{H(1)}})), kMaxPayloadBytes).ok());
}

TEST(Wire, HintRoundTripAndRefusals) {
  auto req = DecodeHintRequest(Encode(HintRequest{2500, {H(1), H(2)}}));
  ASSERT_TRUE(req.ok()) << req.status().ToString();
  EXPECT_EQ(req->ttl_ms, 2500u);
  ASSERT_EQ(req->hashes.size(), 2u);
  EXPECT_EQ(req->hashes[1], H(2));
  EXPECT_THAT(std::string(DecodeHintRequest(Encode(HintRequest{0, {H(1)}})).status().message()),
              HasSubstr("at least 1 ms"));
  auto trailing = Encode(HintRequest{1, {}});
  trailing.push_back(std::byte{0});
  EXPECT_FALSE(DecodeHintRequest(trailing).ok());
  EXPECT_FALSE(DecodeHintRequest(std::vector<std::byte>(3)).ok());
  auto reply = DecodeHintReply(Encode(HintReply{77, 5, 3, 2}));
  ASSERT_TRUE(reply.ok()) << reply.status().ToString();
  EXPECT_EQ(reply->hint, 77u);
  EXPECT_EQ(reply->found, 5u);
  EXPECT_EQ(reply->in_memory, 3u);
  EXPECT_EQ(reply->prefetching, 2u);
  EXPECT_FALSE(DecodeHintReply(Encode(HintReply{1, 2, 3, 0})).ok()) << "more in memory than found";
  EXPECT_FALSE(DecodeHintReply(Encode(HintReply{1, 2, 1, 2})).ok()) << "more prefetching than below memory";
  auto drop = DecodeHintDrop(EncodeHintDrop(9));
  ASSERT_TRUE(drop.ok());
  EXPECT_EQ(*drop, 9u);
  EXPECT_FALSE(DecodeHintDrop(std::vector<std::byte>(7)).ok());
  EXPECT_EQ(OpcodeName(Opcode::kHint), "HINT");
  EXPECT_EQ(OpcodeName(Opcode::kHintDrop), "HINT_DROP");
}

// GET_RANGES round trips, and every way a request can be refused, by name.
TEST(Wire, GetRangesRoundTripAndLimits) {
  GetRangesRequest req;
  req.items.push_back({H(1), {{0, 1}, {4032, 664}, {UINT64_MAX - 7, 7}}});
  req.items.push_back({H(2), {{5, 5}}});
  auto back = DecodeGetRangesRequest(Encode(req), kMaxPayloadBytes);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ASSERT_EQ(back->items.size(), 2u);
  EXPECT_EQ(back->items[0].hash, H(1));
  ASSERT_EQ(back->items[0].ranges.size(), 3u);
  EXPECT_EQ(back->items[0].ranges[1].offset, 4032u);
  EXPECT_EQ(back->items[0].ranges[1].bytes, 664u);
  EXPECT_EQ(back->items[0].ranges[2].offset, UINT64_MAX - 7);
  EXPECT_EQ(back->items[1].ranges[0].bytes, 5u);
  // The reply's bound: 4 + (5 + max(672, 256)) + (5 + max(5, 256)).
  EXPECT_EQ(GetRangesReplyBound(req), 4u + 677u + 261u);
  EXPECT_FALSE(DecodeGetRangesRequest(Encode(req), 4 + 677 + 260).ok());
  EXPECT_TRUE(DecodeGetRangesRequest(Encode(req), 4 + 677 + 261).ok());

  auto refused = [](GetRangesRequest m, const char* why) {
    auto r = DecodeGetRangesRequest(Encode(m), kMaxPayloadBytes);
    ASSERT_FALSE(r.ok()) << why;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << why;
    EXPECT_THAT(r.status().ToString(), HasSubstr(why));
  };
  refused(GetRangesRequest{{{H(1), {}}}}, "names no range");
  refused(GetRangesRequest{{{H(1), {{3, 0}}}}}, "range of 0 bytes");
  refused(GetRangesRequest{{{H(1), {{UINT64_MAX - 3, 7}}}}}, "past 2^64");
  {
    GetRangesRequest many;
    many.items.push_back({H(1), std::vector<ByteRange>(40000, ByteRange{0, 1})});
    many.items.push_back({H(2), std::vector<ByteRange>(30000, ByteRange{0, 1})});
    refused(many, "more than 65536 ranges");
  }
  // A count the payload cannot hold, and bytes left over.
  PayloadWriter w;
  w.U32(1);
  w.Bytes(H(1));
  w.U32(1000);
  w.U64(0);
  w.U32(1);
  EXPECT_FALSE(DecodeGetRangesRequest(w.bytes(), kMaxPayloadBytes).ok());
  std::vector<std::byte> extra = Encode(req);
  extra.push_back(std::byte{0});
  EXPECT_FALSE(DecodeGetRangesRequest(extra, kMaxPayloadBytes).ok());

  GetRangesReply reply;
  const std::vector<std::byte> bytes = {std::byte{1}, std::byte{2}, std::byte{3}};
  reply.items.push_back({ItemStatus{}, bytes});
  reply.items.push_back({ItemStatus{StatusCode::kNotFound, "gone"}, {}});
  const std::vector<std::byte> encoded = Encode(reply);  // the decoded bytes are views into it
  auto rb = DecodeGetRangesReply(encoded);
  ASSERT_TRUE(rb.ok());
  ASSERT_EQ(rb->items.size(), 2u);
  EXPECT_TRUE(std::equal(rb->items[0].bytes.begin(), rb->items[0].bytes.end(), bytes.begin(), bytes.end()));
  EXPECT_EQ(rb->items[1].status.code, StatusCode::kNotFound);
  EXPECT_EQ(rb->items[1].status.message, "gone");
  EXPECT_EQ(OpcodeName(Opcode::kGetRanges), "GET_RANGES");
}

}  // namespace
}  // namespace sparsekv::wire
