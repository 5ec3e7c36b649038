#include "toy_decoder.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <cmath>
#include <cstring>

#include "sparsekv/bf16.h"
#include "sparsekv/paged_cache_view.h"

namespace sparsekv::bench {
namespace {

uint64_t SplitMix(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Values in [-2, 2) with 24 random bits each.
void FillRow(uint64_t key, float* out, uint32_t n) {
  for (uint32_t i = 0; i < n; ++i)
    out[i] = static_cast<float>(SplitMix(key) >> 40) * (4.0f / 16777216.0f) - 2.0f;
}


}  // namespace

Result<std::unique_ptr<ToyDecoder>> ToyDecoder::Create(const CacheManager& manager, uint64_t seed) {
  std::unique_ptr<ToyDecoder> d(new ToyDecoder(manager, seed));
  const BlockGeometry& geo = manager.geometry();
  for (uint32_t q = 0; q < geo.pools.size(); ++q) {
    Pool p;
    p.index = q;
    p.geo = geo.pools[q];
    if (p.geo.spec.kind != CacheKind::kCompressorState) {
      SPARSEKV_ASSIGN_OR_RETURN(PageCodec c, PageCodec::Create(p.geo.spec.format, p.geo.spec.dims,
                                                               p.geo.entries_per_block));
      p.codec = c;
    }
    if (p.geo.spec.kind != CacheKind::kCompressorState && p.geo.spec.ratio > 1)
      p.state_pool = geo.PoolIndex(p.geo.layers[0], CacheKind::kCompressorState);
    d->pools_.push_back(std::move(p));
  }
  for (uint32_t q = 0; q < geo.pools.size(); ++q) {
    const KindSpec& k = geo.pools[q].spec;
    const bool mla_format = k.format == StorageFormat::kBf16 || k.format == StorageFormat::kFp8V4 ||
                            k.format == StorageFormat::kFp8DsMla || k.format == StorageFormat::kC8Mla;
    if (!mla_format || k.dims < kMlaValueDims) continue;
    if (k.kind == CacheKind::kMlaLatent) d->main_pool_ = static_cast<int>(q);
    if (k.kind == CacheKind::kSwaWindow && d->main_pool_ < 0) d->main_pool_ = static_cast<int>(q);
    if (k.kind == CacheKind::kCsaCompressed && d->extra_pool_ < 0) d->extra_pool_ = static_cast<int>(q);
  }
  if (d->main_pool_ >= 0 && d->extra_pool_ >= 0 &&
      geo.pools[d->main_pool_].spec.dims != geo.pools[d->extra_pool_].spec.dims)
    d->extra_pool_ = -1;
  if (d->main_pool_ >= 0 && !manager.options().metadata_only) {
    SPARSEKV_ASSIGN_OR_RETURN(d->mla_, SparseMla::Create({}));
  }
  return d;
}

Result<uint64_t> ToyDecoder::Step(SequenceId seq, uint64_t t, TokenId token) {
  const BlockGeometry& geo = manager_.geometry();
  const uint32_t bt = geo.block_tokens;
  const uint64_t block = t / bt;
  tables_.resize(pools_.size());
  for (const Pool& p : pools_) SPARSEKV_RETURN_IF_ERROR(manager_.GetBlockTable(seq, p.index, &tables_[p.index]));
  auto page = [&](const Pool& p, uint64_t b, uint32_t slot) -> std::byte* {
    const std::vector<PageId>& table = tables_[p.index];
    if (b >= table.size() || table[b] == kInvalidPage) return nullptr;
    return manager_.pool(p.index).PageData(table[b]) + uint64_t{slot} * p.geo.layer_stride;
  };
  auto missing = [&](const Pool& p, uint64_t b) {
    return Status::FailedPrecondition(
        fmt::format("toy decoder: token {}: pool {} has no page for block {}", t, p.index, b));
  };
  XXH3_state_t* h = XXH3_createState();
  struct Free {
    XXH3_state_t* h;
    ~Free() { XXH3_freeState(h); }
  } free_h{h};
  auto read_entry = [&](const Pool& p, uint64_t e) -> Status {  // entry e of the kind, layer slot 0
    const uint32_t per = p.geo.entries_per_block;
    std::byte* pg = page(p, e / per, 0);
    if (pg == nullptr) return missing(p, e / per);
    acc_.resize(p.geo.spec.dims);
    p.codec->DecodeEntryFp32(pg, static_cast<uint32_t>(e % per), acc_.data());
    XXH3_64bits_update(h, acc_.data(), acc_.size() * sizeof(float));
    return Status::OK();
  };

  // A sequence's compressor starts from zeros (its first block's state page is a fresh page,
  // holding whatever its last user left).
  if (t == 0) {
    for (const Pool& p : pools_) {
      if (p.geo.spec.kind != CacheKind::kCompressorState) continue;
      std::byte* pg = page(p, 0, 0);
      if (pg == nullptr) return missing(p, 0);
      std::memset(pg, 0, p.geo.block_stride);
    }
  }
  // ---- what the layers read before this token's rows exist: the history and the state ----
  XXH3_64bits_reset_withSeed(h, seed_ ^ t);
  for (const Pool& p : pools_) {
    if (p.geo.spec.kind == CacheKind::kCompressorState) {
      const std::byte* pg = page(p, block, 0);
      if (pg == nullptr) return missing(p, block);
      XXH3_64bits_update(h, pg, p.geo.bytes_per_entry);
      continue;
    }
    const uint64_t n = t / p.geo.spec.ratio;  // entries written before this token
    if (n == 0) continue;
    // The window holds the last block_tokens - 1 rows at least (a window of at most a block).
    const uint64_t oldest =
        p.geo.spec.kind == CacheKind::kSwaWindow && n > bt - 1 ? n - (bt - 1) : 0;
    uint64_t mix = seed_ ^ t ^ (uint64_t{p.index} << 40);
    const uint64_t any = oldest + SplitMix(mix) % (n - oldest);
    for (uint64_t e : {n - 1, any, oldest}) SPARSEKV_RETURN_IF_ERROR(read_entry(p, e));
  }
  const uint64_t pre = XXH3_64bits_digest(h);
  const uint64_t key0 =
      XXH3_64bits_withSeed(&pre, sizeof pre, seed_ ^ (uint64_t{static_cast<uint32_t>(token)} << 24) ^ t);

  // ---- write ----
  // Compressor states first (the compressed entries this token closes are computed from them).
  for (const Pool& p : pools_) {
    if (p.geo.spec.kind != CacheKind::kCompressorState) continue;
    const uint32_t R = p.geo.spec.state_rows, D = p.geo.spec.dims;
    const auto row = static_cast<uint32_t>(t % R);
    for (uint32_t l = 0; l < p.geo.layers.size(); ++l) {
      std::byte* pg = page(p, block, l);
      if (pg == nullptr) return missing(p, block);
      auto* kv = reinterpret_cast<float*>(pg);
      FillRow(key0 ^ (uint64_t{p.index} << 48) ^ (uint64_t{l} << 32), kv + uint64_t{row} * D, D);
      FillRow(key0 ^ (uint64_t{p.index} << 48) ^ (uint64_t{l} << 32) ^ 0x5c0e, kv + uint64_t{R + row} * D, D);
    }
  }
  for (const Pool& p : pools_) {
    if (p.geo.spec.kind == CacheKind::kCompressorState) continue;
    const uint32_t r = p.geo.spec.ratio, dims = p.geo.spec.dims;
    if ((t + 1) % r != 0) continue;  // per-token kinds: r == 1, every token
    const auto entry = static_cast<uint32_t>((t % bt) / r);
    row_.resize(dims);
    for (uint32_t l = 0; l < p.geo.layers.size(); ++l) {
      std::byte* pg = page(p, block, l);
      if (pg == nullptr) return missing(p, block);
      if (r == 1 || p.state_pool < 0) {
        FillRow(key0 ^ (uint64_t{p.index} << 48) ^ (uint64_t{l} << 32) ^ 0x70c, row_.data(), dims);
      } else {
        // From the layer's running state: a fixed-order weighted sum over its rows.
        const Pool& sp = pools_[static_cast<size_t>(p.state_pool)];
        const int slot = sp.geo.LayerSlot(p.geo.layers[l]);
        const std::byte* spg = slot < 0 ? nullptr : page(sp, block, static_cast<uint32_t>(slot));
        if (spg == nullptr) return missing(sp, block);
        const auto* kv = reinterpret_cast<const float*>(spg);
        const uint32_t R = sp.geo.spec.state_rows, D = sp.geo.spec.dims;
        const float* score = kv + uint64_t{R} * D;
        for (uint32_t d = 0; d < dims; ++d) {
          const uint32_t c = (d * 7u) % D;
          float acc = 0;
          for (uint32_t i = 0; i < R; ++i) acc += kv[uint64_t{i} * D + c] * score[uint64_t{i} * D + c];
          row_[d] = acc / static_cast<float>(R);
        }
      }
      SPARSEKV_RETURN_IF_ERROR(p.codec->WriteTokens(pg, entry, RowsView::Fp32(row_.data(), 1, dims)));
    }
  }

  // ---- the output: the new entries, and attention over the main cache ----
  XXH3_64bits_reset_withSeed(h, pre);
  for (const Pool& p : pools_) {
    if (p.geo.spec.kind == CacheKind::kCompressorState || (t + 1) % p.geo.spec.ratio != 0) continue;
    SPARSEKV_RETURN_IF_ERROR(read_entry(p, t / p.geo.spec.ratio));
  }
  if (mla_ != nullptr && main_pool_ >= 0) {
    const Pool& mp = pools_[static_cast<size_t>(main_pool_)];
    const uint32_t D = mp.geo.spec.dims;
    SPARSEKV_ASSIGN_OR_RETURN(PagedCacheView view,
                              PagedCacheView::ForLayer(manager_.pool(mp.index), mp.geo, mp.geo.layers[0]));
    std::vector<int32_t> main_idx, extra_idx;
    uint64_t mix = key0 ^ 0x3a;
    const uint64_t n = t + 1;
    const uint64_t lo = mp.geo.spec.kind == CacheKind::kSwaWindow && n > bt ? n - bt : 0;
    for (int i = 0; i < 16; ++i) {
      const uint64_t e = i == 0 ? t : lo + SplitMix(mix) % (n - lo);
      main_idx.push_back(PhysicalIndex(tables_[mp.index], mp.geo.entries_per_block, e));
    }
    SparseMlaBatch batch;
    if (extra_pool_ >= 0) {
      const Pool& xp = pools_[static_cast<size_t>(extra_pool_)];
      const uint64_t xn = n / xp.geo.spec.ratio;
      for (int i = 0; i < 8 && xn > 0; ++i) {
        const uint64_t e = i == 0 ? xn - 1 : SplitMix(mix) % xn;
        extra_idx.push_back(PhysicalIndex(tables_[xp.index], xp.geo.entries_per_block, e));
      }
      if (!extra_idx.empty()) {
        SparseMlaSource x;
        SPARSEKV_ASSIGN_OR_RETURN(x.view, PagedCacheView::ForLayer(manager_.pool(xp.index), xp.geo,
                                                                   xp.geo.layers[0]));
        x.indices = extra_idx.data();
        x.top_k = static_cast<uint32_t>(extra_idx.size());
        batch.extra = x;
      }
    }
    constexpr uint32_t kHeads = 2;
    std::vector<float> qf(uint64_t{kHeads} * D);
    FillRow(key0 ^ 0x9, qf.data(), static_cast<uint32_t>(qf.size()));
    std::vector<uint16_t> q(qf.size());
    for (size_t i = 0; i < q.size(); ++i) q[i] = Bf16FromFloat(qf[i]);
    std::vector<float> out(uint64_t{kHeads} * kMlaValueDims), lse(kHeads);
    batch.q = q.data();
    batch.q_type = RowType::kBf16;
    batch.tokens = 1;
    batch.heads = kHeads;
    batch.softmax_scale = 1.0f / std::sqrt(static_cast<float>(D));
    batch.main.view = view;
    batch.main.indices = main_idx.data();
    batch.main.top_k = static_cast<uint32_t>(main_idx.size());
    SPARSEKV_RETURN_IF_ERROR(mla_->Run(batch, SparseMlaOutput{out.data(), lse.data()}));
    XXH3_64bits_update(h, out.data(), out.size() * sizeof(float));
    XXH3_64bits_update(h, lse.data(), lse.size() * sizeof(float));
  }
  return XXH3_64bits_digest(h);
}

Status ToyDecoder::Prepare(CacheManager& manager, SequenceId seq, uint64_t t) {
  SPARSEKV_ASSIGN_OR_RETURN(SlotAllocation alloc, manager.AllocateSlots(seq, t + 1));
  for (const PageCopy& c : alloc.copies) {
    std::memcpy(manager.pool(c.pool).PageData(c.dst), manager.pool(c.pool).PageData(c.src),
                manager.geometry().pools[c.pool].block_stride);
  }
  return Status::OK();
}

Status ToyDecoder::Run(CacheManager& manager, SequenceId seq, uint64_t count,
                       std::vector<TokenId>* tokens, std::vector<uint64_t>* digests,
                       const AppendFn& append, const CommitFn& commit) {
  for (uint64_t i = 0; i < count; ++i) {
    const uint64_t t = tokens->size() - 1;
    SPARSEKV_RETURN_IF_ERROR(Prepare(manager, seq, t));
    SPARSEKV_ASSIGN_OR_RETURN(const uint64_t digest, Step(seq, t, tokens->back()));
    if (digests != nullptr) digests->push_back(digest);
    SPARSEKV_RETURN_IF_ERROR(commit(seq, t + 1));
    const TokenId next = NextToken(digest);
    tokens->push_back(next);
    SPARSEKV_RETURN_IF_ERROR(append(seq, std::span<const TokenId>(&next, 1)));
  }
  return Status::OK();
}

Status ToyDecoder::Replay(CacheManager& manager, SequenceId seq, std::span<const TokenId> tokens,
                          uint64_t from, uint64_t to, const std::function<Status(SequenceId, uint64_t)>& commit,
                          uint64_t* mismatches, std::vector<uint64_t>* digests) {
  for (uint64_t t = from; t < to; ++t) {
    SPARSEKV_RETURN_IF_ERROR(Prepare(manager, seq, t));
    SPARSEKV_ASSIGN_OR_RETURN(const uint64_t digest, Step(seq, t, tokens[t]));
    if (digests != nullptr) digests->push_back(digest);
    if (t + 1 < tokens.size() && NextToken(digest) != tokens[t + 1]) ++*mismatches;
    SPARSEKV_RETURN_IF_ERROR(commit(seq, t + 1));
  }
  return Status::OK();
}

}  // namespace sparsekv::bench
