"""vllm/v1/kv_cache_interface.py: the KV cache specs, groups and config (fields a connector reads;
V4's fields as its sparse_swa.py and compressor pass them)."""

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    block_size: int


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    page_size_padded: int | None = None


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    head_size_v: int | None = None
    sliding_window: int | None = None
    attention_chunk_size: int | None = None


@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    cache_dtype_str: str | None = None
    compress_ratio: int = 1
    alignment: int | None = None
    model_version: str | None = None


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    sliding_window: int


@dataclass(frozen=True, kw_only=True)
class SlidingWindowMLASpec(SlidingWindowSpec):
    cache_dtype_str: str | None = None
    compress_ratio: int = 1
    alignment: int | None = None
    model_version: str | None = None


@dataclass(frozen=True, kw_only=True)
class MambaSpec(KVCacheSpec):
    shapes: tuple = ()
    dtypes: tuple = ()


@dataclass(frozen=True, kw_only=True)
class UniformTypeKVCacheSpecs(KVCacheSpec):
    """Layers of one attention type whose per-layer specs (page sizes) differ, as one group."""
    kv_cache_specs: dict[str, KVCacheSpec]


@dataclass
class KVCacheTensor:
    size: int
    shared_by: list[str]


@dataclass
class KVCacheGroupSpec:
    layer_names: list[str]
    kv_cache_spec: KVCacheSpec


@dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_tensors: list[KVCacheTensor]
    kv_cache_groups: list[KVCacheGroupSpec] = field(default_factory=list)
