// BlockHash and BlockHasher: the prefix-hash chain that names a token block's content.
//
// The digest of block i is a function of the digest of block i-1, the block's token ids and the
// sequence's extra keys (adapter id, ...). Block 0's parent is a root derived from the
// namespace salt, so equal prompts in one namespace get equal digests in every process and
// after every restart, and namespaces never share a digest. Only full blocks are hashed.
//
// A digest is two independent 128-bit values: `hash`, the key a prefix index, a router and the
// KV events use, and `check`, kept beside the key and compared on every hit, so that a collision
// of the key alone is detected instead of serving another prompt's KV. In kXxh3 mode both are
// XXH3-128 chains with different seeds (fast, not collision-resistant against an adversary);
// in kSha256 mode they are the two halves of one SHA-256 chain over the full 256-bit parent,
// for multi-tenant deployments.
//
// Hash input, block i (little-endian):
//   parent (16 bytes: parent.hash for `hash`, parent.check for `check`; kSha256: both, 32 bytes)
//   || token ids (4 bytes each) || extra keys || uint64 byte length of the extra keys
// Roots: kXxh3: XXH3-128 of "sparsekv.block-hash.v1" || salt, seeds as above; kSha256:
// SHA-256("sparsekv.block-hash.v1.sha256" || salt).
//
// Thread safety: a BlockHasher is immutable after construction; share it freely.
#pragma once

#include <bit>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "sparsekv/status.h"

namespace sparsekv {

static_assert(std::endian::native == std::endian::little,
              "block hashes are defined over little-endian token bytes");

using TokenId = uint32_t;

// 128 bits; `hi` first in the canonical (hex) form.
struct BlockHash {
  uint64_t lo = 0;
  uint64_t hi = 0;

  bool operator==(const BlockHash&) const = default;
  // 32 lowercase hex digits, hi then lo.
  std::string ToHex() const;
};

// For unordered containers. The bits are already uniform: no mixing needed.
struct BlockHashHasher {
  size_t operator()(const BlockHash& h) const { return static_cast<size_t>(h.lo); }
};

// One block's place in the chain: the index key and the independent verification value.
struct BlockDigest {
  BlockHash hash;
  BlockHash check;
  bool operator==(const BlockDigest&) const = default;
};

enum class HashMode : uint8_t {
  kXxh3 = 0,  // XXH3-128 chains: about 0.1 us per 512-token block per chain
  kSha256,    // SHA-256: collision-resistant, about 15x slower
};
std::string_view HashModeName(HashMode mode);
Result<HashMode> ParseHashMode(std::string_view name);  // "xxh3" or "sha256"

class BlockHasher {
 public:
  // Preconditions: block_tokens >= 1.
  BlockHasher(HashMode mode, uint32_t block_tokens);

  HashMode mode() const { return mode_; }
  uint32_t block_tokens() const { return block_tokens_; }

  // The parent of block 0 in namespace `salt`.
  BlockDigest Root(std::string_view salt) const;

  // Digest of one full block. Precondition: tokens.size() == block_tokens().
  BlockDigest Next(const BlockDigest& parent, std::span<const TokenId> tokens,
                   std::string_view extra_keys) const;

  // Appends to `out` the digests of every full block of `tokens`, chained from `parent`; a
  // trailing partial block is not hashed. Returns the number of digests appended.
  size_t HashFullBlocks(const BlockDigest& parent, std::span<const TokenId> tokens,
                        std::string_view extra_keys, std::vector<BlockDigest>* out) const;

 private:
  HashMode mode_;
  uint32_t block_tokens_;
};

}  // namespace sparsekv
