"""vllm/distributed/kv_transfer/kv_connector/factory.py as of a4cd9d0d28bdb41db8dfe0acdafac2bf2f608630:
how an out-of-tree connector named by kv_connector_module_path is found and constructed (no
connectors are registered here)."""

import importlib
from typing import cast

from vllm.distributed.kv_transfer.kv_connector.base import KVConnectorBase, KVConnectorBaseType
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole, supports_hma
from vllm.logger import init_logger
from vllm.utils.func_utils import supports_kw

logger = init_logger(__name__)


class KVConnectorFactory:
    _registry: dict = {}

    @classmethod
    def create_connector(cls, config, role: KVConnectorRole, kv_cache_config=None) -> KVConnectorBase:
        kv_transfer_config = config.kv_transfer_config
        if kv_transfer_config is None:
            raise ValueError("kv_transfer_config must be set to create a connector")
        connector_cls, compat_sig = cls._get_connector_class_with_compat(kv_transfer_config)
        hma_enabled = not config.scheduler_config.disable_hybrid_kv_cache_manager
        if hma_enabled and not supports_hma(connector_cls):
            raise ValueError(
                f"Connector {connector_cls.__name__} does not support HMA but HMA is enabled. "
                "Please set `--disable-hybrid-kv-cache-manager`.")
        logger.info("Creating v1 connector with name: %s and engine_id: %s", connector_cls.__name__,
                    kv_transfer_config.engine_id)
        if compat_sig:
            return connector_cls(config, role)
        return connector_cls(config, role, kv_cache_config)

    @classmethod
    def _get_connector_class_with_compat(cls, kv_transfer_config):
        connector_name = kv_transfer_config.kv_connector
        if connector_name is None:
            raise ValueError("Connector name is not set in KVTransferConfig")
        compat_sig = False
        if connector_name in cls._registry:
            connector_cls = cls._registry[connector_name]()
        else:
            connector_module_path = kv_transfer_config.kv_connector_module_path
            if connector_module_path is None:
                raise ValueError(f"Unsupported connector type: {connector_name}")
            connector_module = importlib.import_module(connector_module_path)
            try:
                connector_cls = getattr(connector_module, connector_name)
            except AttributeError as e:
                raise AttributeError(f"Class {connector_name} not found in {connector_module_path}") from e
            connector_cls = cast(type[KVConnectorBaseType], connector_cls)
            if not supports_kw(connector_cls, "kv_cache_config"):
                compat_sig = True
        return connector_cls, compat_sig

    @classmethod
    def get_connector_class(cls, kv_transfer_config):
        connector_cls, _ = cls._get_connector_class_with_compat(kv_transfer_config)
        return connector_cls
