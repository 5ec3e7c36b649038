from collections.abc import Sequence
from dataclasses import dataclass

from vllm.v1.core.kv_cache_utils import KVCacheBlock


@dataclass
class KVCacheBlocks:
    """The blocks of a request per KV cache group: blocks[i][j] is block j of group i."""
    blocks: tuple[Sequence[KVCacheBlock], ...]

    def __add__(self, other: "KVCacheBlocks") -> "KVCacheBlocks":
        return KVCacheBlocks(tuple(list(a) + list(b) for a, b in zip(self.blocks, other.blocks)))

    def get_block_ids(self, allow_none: bool = False) -> tuple[list[int], ...] | None:
        if allow_none and all(len(g) == 0 for g in self.blocks):
            return None
        return tuple([blk.block_id for blk in group] for group in self.blocks)

    def get_unhashed_block_ids(self) -> list[int]:
        assert len(self.blocks) == 1, "Only one group is supported"
        return [blk.block_id for blk in self.blocks[0] if blk.block_hash is None]
