"""vllm.config.kv_transfer.KVTransferConfig (the fields and helpers a connector reads)."""

import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]


@dataclass
class KVTransferConfig:
    kv_connector: str | None = None
    engine_id: str | None = None
    kv_buffer_device: str = "cuda"
    kv_buffer_size: float = 1e9
    kv_role: KVRole | None = None
    kv_rank: int | None = None
    kv_parallel_size: int = 1
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_connector_module_path: str | None = None

    def __post_init__(self):
        if self.engine_id is None:
            self.engine_id = str(uuid.uuid4())
        if self.kv_role is not None and self.kv_role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise ValueError(f"Unsupported kv_role: {self.kv_role}")
        if self.kv_connector is not None and self.kv_role is None:
            raise ValueError("Please specify kv_role when kv_connector is set")

    @property
    def is_kv_transfer_instance(self) -> bool:
        return self.kv_connector is not None and self.kv_role in ("kv_producer", "kv_consumer", "kv_both")

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key, default) -> Any:
        return self.kv_connector_extra_config.get(key, default)
