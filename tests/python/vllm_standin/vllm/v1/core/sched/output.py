"""vllm/v1/core/sched/output.py: what the scheduler hands the workers each step."""

from dataclasses import dataclass, field
from typing import Any


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int] | None
    mm_features: list = field(default_factory=list)
    sampling_params: Any = None
    pooling_params: Any = None
    block_ids: tuple[list[int], ...] = ()
    num_computed_tokens: int = 0
    lora_request: Any = None


@dataclass
class CachedRequestData:
    req_ids: list[str]
    resumed_req_ids: set[str]
    new_token_ids: list[list[int]]
    all_token_ids: dict[str, list[int]]
    new_block_ids: list[tuple[list[int], ...] | None]
    num_computed_tokens: list[int]
    num_output_tokens: list[int]

    @classmethod
    def make_empty(cls) -> "CachedRequestData":
        return cls(req_ids=[], resumed_req_ids=set(), new_token_ids=[], all_token_ids={}, new_block_ids=[],
                   num_computed_tokens=[], num_output_tokens=[])


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    num_common_prefix_blocks: list[int] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)
    free_encoder_mm_hashes: list[str] = field(default_factory=list)
    kv_connector_metadata: Any = None
