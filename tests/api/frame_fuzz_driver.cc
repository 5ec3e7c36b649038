// A deterministic stand-in for libFuzzer in builds without clang: mutates a seed corpus of valid
// frames (bit flips, truncation, length and count smashing, splices) for a fixed number of
// executions and runs the same target. Under ASan/UBSan any out-of-bounds read aborts the test.
//   frame_fuzz_driver RUNS SEED
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "protocol/wire.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace sw = sparsekv::wire;

std::vector<std::vector<uint8_t>> SeedCorpus() {
  std::vector<std::vector<uint8_t>> seeds;
  auto add = [&](sw::Opcode op, const std::vector<std::byte>& payload) {
    auto f = sw::EncodeFrame(op, 0, 7, payload);
    seeds.emplace_back(reinterpret_cast<const uint8_t*>(f.data()), reinterpret_cast<const uint8_t*>(f.data()) + f.size());
  };
  sw::WireHash h{};
  for (size_t i = 0; i < h.size(); ++i) h[i] = std::byte(i * 7);
  add(sw::Opcode::kHello,
      sw::Encode(sw::HelloRequest{sw::kProtocolVersion, "tenant-a", "secret", "engine-0", true}));
  add(sw::Opcode::kLookup, sw::Encode(sw::HashList{{h, h, h}}));
  std::vector<std::byte> bundle(100, std::byte{0x5a});
  add(sw::Opcode::kPut, sw::Encode(sw::PutRequest{{sw::PutItem{h, bundle}, sw::PutItem{h, bundle}}}));
  add(sw::Opcode::kGet, sw::Encode(sw::GetReply{{sw::GetItem{{}, bundle}, sw::GetItem{{sparsekv::StatusCode::kNotFound, "no"}, {}}}}));
  add(sw::Opcode::kPin, sw::Encode(sw::PinRequest{{h}, 3}));
  add(sw::Opcode::kEvent, sw::Encode(sw::EventBatch{9, {sw::EventRecord{1, 2, {h, h}}}}));
  add(sw::Opcode::kError, sw::Encode(sw::ErrorReply{sparsekv::StatusCode::kPermissionDenied, "nope"}));
  add(sw::Opcode::kShmPut, sw::Encode(sw::ShmPutRequest{{sw::ShmSlot{h, 4096, 100}}}));
  add(sw::Opcode::kShmGet, sw::Encode(sw::ShmGetReply{{{}}, {sw::ShmSlot{h, 0, 64}}, {sw::LendInfo{3, 0, 9}}}));
  return seeds;
}

int main(int argc, char** argv) {
  const uint64_t runs = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 100000;
  std::mt19937_64 rng(argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 1);
  const auto seeds = SeedCorpus();
  for (const auto& s : seeds) LLVMFuzzerTestOneInput(s.data(), s.size());
  std::vector<uint8_t> buf;
  for (uint64_t i = 0; i < runs; ++i) {
    buf = seeds[rng() % seeds.size()];
    const int mutations = 1 + rng() % 4;
    for (int m = 0; m < mutations && !buf.empty(); ++m) {
      switch (rng() % 6) {
        case 0: buf[rng() % buf.size()] ^= uint8_t(1u << (rng() % 8)); break;   // bit flip
        case 1: buf.resize(rng() % buf.size()); break;                          // truncate
        case 2: {                                                                // smash a u32
          if (buf.size() >= 4) {
            const size_t at = rng() % (buf.size() - 3);
            const uint32_t v = (rng() % 2) ? 0xffffffffu : uint32_t(rng());
            std::memcpy(&buf[at], &v, 4);
          }
          break;
        }
        case 3: {                                                                // splice
          const auto& other = seeds[rng() % seeds.size()];
          const size_t cut = rng() % (buf.size() + 1);
          buf.resize(cut);
          buf.insert(buf.end(), other.begin() + (rng() % other.size()), other.end());
          break;
        }
        case 4: buf.push_back(uint8_t(rng())); break;                             // append
        case 5: buf[rng() % buf.size()] = uint8_t(rng()); break;                   // random byte
      }
    }
    LLVMFuzzerTestOneInput(buf.data(), buf.size());
  }
  std::printf("%llu executions, no crash\n", static_cast<unsigned long long>(runs));
  return 0;
}
