// Fuzz target for the frame parser: a header, then the payload decoder its opcode selects (and,
// to reach every decoder, the one the input's last byte selects). Built with libFuzzer when
// clang is available, and linked into a deterministic mutation driver in every build.
#include <cstddef>
#include <cstdint>
#include <span>

#include "protocol/wire.h"

namespace sw = sparsekv::wire;

static void DecodeAs(uint16_t op, std::span<const std::byte> p) {
  switch (op % (sw::kMaxOpcode + 1)) {
    case 1: (void)sw::DecodeHelloRequest(p); (void)sw::DecodeHelloReply(p); break;
    case 2: (void)sw::DecodeHashList(p); (void)sw::DecodeLookupReply(p); break;
    case 3: (void)sw::DecodePutRequest(p, 1u << 20); (void)sw::DecodeStatusListReply(p); break;
    case 4: (void)sw::DecodeGetReply(p, 1u << 20); break;
    case 5: (void)sw::DecodePinRequest(p); break;
    case 10: (void)sw::DecodeEventBatch(p); break;
    case 11: (void)sw::DecodeErrorReply(p); break;
    case 12: (void)sw::DecodeShmPutRequest(p); break;
    case 13: (void)sw::DecodeShmGetReply(p); break;
    case 16: (void)sw::DecodeGetRangesRequest(p, 1u << 20); (void)sw::DecodeGetRangesReply(p); break;
    case 21: (void)sw::DecodeHintRequest(p); (void)sw::DecodeHintReply(p); break;
    case 22: (void)sw::DecodeHintDrop(p); break;
    default: (void)sw::DecodeHashList(p); break;
  }
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const std::byte> in(reinterpret_cast<const std::byte*>(data), size);
  auto header = sw::DecodeHeader(in, sw::kMaxPayloadBytes);
  if (header.ok() && in.size() >= sw::kHeaderBytes) {
    auto payload = in.subspan(sw::kHeaderBytes);
    if (payload.size() > header->payload_bytes) payload = payload.first(header->payload_bytes);
    if (sw::VerifyPayload(*header, payload).ok()) DecodeAs(static_cast<uint16_t>(header->opcode), payload);
  }
  if (size > 0) DecodeAs(data[size - 1], in.first(size - 1));
  return 0;
}
