#include "sparsekv/block_hash.h"

#include <fmt/format.h>
#include <openssl/evp.h>

#include <cstdlib>
#include <cstring>
#include <memory>

#include "allocator/xxhash_dispatch.h"

namespace sparsekv {
namespace {

constexpr std::string_view kRootTag = "sparsekv.block-hash.v1";
constexpr std::string_view kSha256RootTag = "sparsekv.block-hash.v1.sha256";
// Seeds of the two XXH3 chains: any two distinct constants make them independent.
constexpr uint64_t kHashSeed = 0;
constexpr uint64_t kCheckSeed = 0x9e3779b97f4a7c15ull;

BlockHash FromXxh(XXH128_hash_t h) {
  return BlockHash{h.low64, h.high64};
}

// Reads 16 bytes of a SHA-256 digest as a BlockHash (little-endian words).
BlockHash FromBytes(const unsigned char* p) {
  BlockHash h;
  std::memcpy(&h.lo, p, 8);
  std::memcpy(&h.hi, p + 8, 8);
  return h;
}

BlockHash XxhChain(uint64_t seed, const BlockHash& parent, std::span<const TokenId> tokens,
                   std::string_view extra) {
  XXH3_state_t state;
  XXH3_128bits_reset_withSeed(&state, seed);
  XXH3_128bits_update(&state, &parent, sizeof(parent));
  XXH3_128bits_update(&state, tokens.data(), tokens.size_bytes());
  const uint64_t extra_len = extra.size();
  if (!extra.empty()) XXH3_128bits_update(&state, extra.data(), extra.size());
  XXH3_128bits_update(&state, &extra_len, sizeof(extra_len));
  return FromXxh(XXH3_128bits_digest(&state));
}

struct EvpCtxFree {
  void operator()(EVP_MD_CTX* c) const { EVP_MD_CTX_free(c); }
};

// SHA-256 of the concatenated pieces, split into (hash, check).
BlockDigest Sha256(std::initializer_list<std::string_view> pieces) {
  thread_local std::unique_ptr<EVP_MD_CTX, EvpCtxFree> ctx(EVP_MD_CTX_new());
  unsigned char md[32];
  unsigned int len = 0;
  // Failures here mean an OpenSSL without SHA-256 or out of memory; neither can be recovered
  // from per block, and a zero digest would silently alias every block.
  if (!ctx || EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) != 1) std::abort();
  for (std::string_view p : pieces) {
    if (!p.empty() && EVP_DigestUpdate(ctx.get(), p.data(), p.size()) != 1) std::abort();
  }
  if (EVP_DigestFinal_ex(ctx.get(), md, &len) != 1 || len != 32) std::abort();
  return BlockDigest{FromBytes(md), FromBytes(md + 16)};
}

std::string_view Bytes(const void* p, size_t n) {
  return {static_cast<const char*>(p), n};
}

}  // namespace

std::string BlockHash::ToHex() const {
  return fmt::format("{:016x}{:016x}", hi, lo);
}

std::string_view HashModeName(HashMode mode) {
  switch (mode) {
    case HashMode::kXxh3:
      return "xxh3";
    case HashMode::kSha256:
      return "sha256";
  }
  return "?";
}

Result<HashMode> ParseHashMode(std::string_view name) {
  if (name == "xxh3") return HashMode::kXxh3;
  if (name == "sha256") return HashMode::kSha256;
  return Status::InvalidArgument(
      fmt::format("hash mode '{}' is unknown; expected xxh3 or sha256", name));
}

BlockHasher::BlockHasher(HashMode mode, uint32_t block_tokens)
    : mode_(mode), block_tokens_(block_tokens) {}

BlockDigest BlockHasher::Root(std::string_view salt) const {
  if (mode_ == HashMode::kSha256) return Sha256({kSha256RootTag, salt});
  XXH3_state_t state;
  BlockDigest d;
  for (int which = 0; which < 2; ++which) {
    XXH3_128bits_reset_withSeed(&state, which == 0 ? kHashSeed : kCheckSeed);
    XXH3_128bits_update(&state, kRootTag.data(), kRootTag.size());
    XXH3_128bits_update(&state, salt.data(), salt.size());
    (which == 0 ? d.hash : d.check) = FromXxh(XXH3_128bits_digest(&state));
  }
  return d;
}

BlockDigest BlockHasher::Next(const BlockDigest& parent, std::span<const TokenId> tokens,
                              std::string_view extra_keys) const {
  if (mode_ == HashMode::kSha256) {
    const uint64_t extra_len = extra_keys.size();
    return Sha256({Bytes(&parent.hash, 16), Bytes(&parent.check, 16),
                   Bytes(tokens.data(), tokens.size_bytes()), extra_keys,
                   Bytes(&extra_len, sizeof(extra_len))});
  }
  return BlockDigest{XxhChain(kHashSeed, parent.hash, tokens, extra_keys),
                     XxhChain(kCheckSeed, parent.check, tokens, extra_keys)};
}

size_t BlockHasher::HashFullBlocks(const BlockDigest& parent, std::span<const TokenId> tokens,
                                   std::string_view extra_keys,
                                   std::vector<BlockDigest>* out) const {
  const size_t n = tokens.size() / block_tokens_;
  BlockDigest prev = parent;
  for (size_t b = 0; b < n; ++b) {
    prev = Next(prev, tokens.subspan(b * block_tokens_, block_tokens_), extra_keys);
    out->push_back(prev);
  }
  return n;
}

}  // namespace sparsekv
