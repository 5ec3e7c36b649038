"""vllm/v1/core/kv_cache_utils.py: block hashes (chained over the prefix) and the resolution of
the scheduler and hash block sizes."""

import hashlib
import math
import pickle
from dataclasses import dataclass
from typing import Any, NewType

BlockHash = NewType("BlockHash", bytes)
NONE_HASH = BlockHash(b"\0" * 32)


def sha256(input: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(input, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def hash_block_tokens(hash_function, parent_block_hash, curr_block_token_ids, extra_keys=None) -> BlockHash:
    if not parent_block_hash:
        parent_block_hash = NONE_HASH
    return BlockHash(hash_function((parent_block_hash, tuple(curr_block_token_ids), extra_keys)))


def get_request_block_hasher(block_size: int, caching_hash_fn):
    """A function of a request answering the hashes of its full blocks not hashed yet."""

    def request_block_hasher(request) -> list[BlockHash]:
        start = len(request.block_hashes) * block_size
        prev = request.block_hashes[-1] if request.block_hashes else None
        out = []
        while start + block_size <= request.num_tokens:
            h = hash_block_tokens(caching_hash_fn, prev, request.all_token_ids[start:start + block_size])
            out.append(h)
            prev = h
            start += block_size
        return out

    return request_block_hasher


@dataclass
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    _block_hash: BlockHash | None = None
    is_null: bool = False

    @property
    def block_hash(self):
        return self._block_hash


def resolve_kv_cache_block_sizes(kv_cache_config, vllm_config) -> tuple[int, int]:
    """(scheduler_block_size, hash_block_size): one group: the cache block size (times DCP);
    several: the LCM and the GCD of the groups' block sizes."""
    dcp = int(vllm_config.parallel_config.decode_context_parallel_size or 1)
    groups = kv_cache_config.kv_cache_groups
    if len(groups) <= 1:
        size = int(groups[0].kv_cache_spec.block_size if groups else vllm_config.cache_config.block_size) * dcp
        return size, size
    sizes = [int(g.kv_cache_spec.block_size) for g in groups]
    return math.lcm(*sizes), math.gcd(*sizes)
