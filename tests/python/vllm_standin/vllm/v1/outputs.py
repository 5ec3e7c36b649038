from dataclasses import dataclass, field
from typing import Any


@dataclass
class KVConnectorOutput:
    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    kv_connector_stats: Any = None
    kv_cache_events: Any = None
    invalid_block_ids: set[int] = field(default_factory=set)
    expected_finished_count: int = 0

    def is_empty(self):
        return not (self.finished_sending or self.finished_recving or self.kv_connector_stats
                    or self.kv_cache_events or self.invalid_block_ids)
