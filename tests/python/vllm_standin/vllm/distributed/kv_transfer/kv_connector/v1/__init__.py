from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
    supports_hma,
)

__all__ = ["KVConnectorRole", "KVConnectorBase_V1", "supports_hma", "SupportsHMA"]
