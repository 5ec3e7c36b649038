// A deterministic stand-in for libFuzzer in builds without clang: mutates a seed corpus of RESP
// requests (byte flips, truncation, length smashing, splices, inserted CR/LF and quotes) for a
// fixed number of executions and runs the RESP fuzz target. Under ASan/UBSan any out-of-bounds
// read aborts the test.
//   resp_fuzz_driver RUNS SEED
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int main(int argc, char** argv) {
  const uint64_t runs = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 100000;
  std::mt19937_64 rng(argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 1);
  const std::vector<std::string> seeds = {
      "*3\r\n$3\r\nSET\r\n$3\r\nkey\r\n$5\r\nvalue\r\n",
      "*2\r\n$3\r\nGET\r\n$3\r\nkey\r\n*1\r\n$4\r\nPING\r\n",
      "SET \"a b\\x41\\n\" 'it\\'s' plain\r\n",
      "*0\r\n*-1\r\nPING\r\n\r\n",
      "*4\r\n$4\r\nSCAN\r\n$1\r\n0\r\n$5\r\nMATCH\r\n$4\r\nk[a-c]*\r\n",
      "*2\r\n$4\r\nECHO\r\n$0\r\n\r\n",
      "$5\r\nhello\r\n",
      "*1\r\n$2147483648\r\n",
  };
  const char specials[] = {'\r', '\n', '*', '$', '"', '\'', '\\', '-', '0', '9', ' '};
  for (const auto& s : seeds) LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(s.data()), s.size());
  std::string buf;
  for (uint64_t i = 0; i < runs; ++i) {
    buf = seeds[rng() % seeds.size()];
    const int mutations = 1 + rng() % 4;
    for (int m = 0; m < mutations && !buf.empty(); ++m) {
      switch (rng() % 6) {
        case 0: buf[rng() % buf.size()] ^= static_cast<char>(1u << (rng() % 8)); break;
        case 1: buf.resize(rng() % buf.size()); break;
        case 2: buf[rng() % buf.size()] = specials[rng() % sizeof(specials)]; break;
        case 3: buf.insert(rng() % buf.size(), std::to_string(static_cast<int64_t>(rng()) >> (rng() % 64))); break;
        case 4: buf += seeds[rng() % seeds.size()]; break;
        case 5: buf.insert(rng() % buf.size(), 1, specials[rng() % sizeof(specials)]); break;
      }
    }
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(buf.data()), buf.size());
  }
  return 0;
}
