"""vllm.config: the fields of VllmConfig a KV connector reads."""

from dataclasses import dataclass, field
from typing import Any

from vllm.config.kv_transfer import KVTransferConfig


@dataclass
class ModelConfig:
    model: str = "facebook/opt-125m"
    max_model_len: int = 8192


@dataclass
class CacheConfig:
    block_size: int = 16
    cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    num_gpu_blocks: int | None = None


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    rank: int = 0


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    disable_hybrid_kv_cache_manager: bool = False


@dataclass
class VllmConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_transfer_config: KVTransferConfig | None = None
    additional_config: Any = None
