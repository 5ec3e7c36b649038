"""sparsekv.sglang against SGLang releases other than the one it was read at: stand-ins for
SGLang's modules (``sglang.srt.mem_cache.hicache_storage`` with a real ``HiCacheStorage`` ABC,
less the names an older release lacks; ``StorageMetrics`` where a release keeps it), a fresh copy
of the backend module loaded against them (the ``sparsekv.sglang`` the other tests use is left
as it is), and the backend constructed through a stand-in of SGLang's ``StorageBackendFactory``
dynamic path (``storage/backend_factory.py`` at the commit named in sparsekv/sglang.py: import
``module_path``, take ``class_name``, refuse with ``TypeError`` what does not subclass
``HiCacheStorage``, construct ``cls(storage_config, kwargs)``), then driven against a real
sparsekvd."""

import abc
import dataclasses
import enum
import importlib
import importlib.util
import itertools
import logging
import sys
import types
from typing import Any, Dict, List, Optional

import pytest

torch = pytest.importorskip("torch")

from sparsekv import sglang as sk  # noqa: E402
from test_sglang_backend import BytesPerPagePool, MLAPool, numbered, slots  # noqa: E402
from daemon_process import Daemon  # noqa: E402  (on sys.path through test_sglang_backend)

HICACHE = "sglang.srt.mem_cache.hicache_storage"
METRICS_NEW = "sglang.srt.observability.metrics_collector"
METRICS_OLD = "sglang.srt.metrics.collector"
V2_NAMES = ("PoolName", "PoolHitPolicy", "PoolTransfer", "PoolTransferResult")


def fake_hicache_storage(without=()):
    """A module with the shape of SGLang's mem_cache/hicache_storage.py (its seven names, the
    abstract methods of HiCacheStorage), less the names in `without`. Without PoolHitPolicy its
    PoolTransfer has no hit_policy field either."""
    m = types.ModuleType(HICACHE)

    @dataclasses.dataclass
    class HiCacheStorageConfig:
        tp_rank: int
        tp_size: int
        pp_rank: int
        pp_size: int
        attn_cp_rank: int
        attn_cp_size: int
        is_mla_model: bool
        enable_storage_metrics: bool
        is_page_first_layout: bool
        model_name: Optional[str]
        dp_rank: int = 0
        dp_size: int = 1
        tp_lcm_size: Optional[int] = None
        should_split_heads: bool = False
        extra_config: Optional[dict] = None

    @dataclasses.dataclass
    class HiCacheStorageExtraInfo:
        prefix_keys: Optional[List[str]] = None
        extra_info: Optional[dict] = None

    class PoolName(str, enum.Enum):
        KV = "kv"
        INDEXER = "indexer"

    class PoolHitPolicy(str, enum.Enum):
        ALL_PAGES = "all_pages"
        TRAILING_PAGES = "trailing_pages"

    fields = [("name", Any), ("host_indices", Any, dataclasses.field(default=None)),
              ("device_indices", Any, dataclasses.field(default=None)),
              ("keys", Optional[List[str]], dataclasses.field(default=None))]
    if "PoolHitPolicy" not in without:
        fields.append(("hit_policy", Any, dataclasses.field(default=PoolHitPolicy.ALL_PAGES)))
    PoolTransfer = dataclasses.make_dataclass("PoolTransfer", fields)

    @dataclasses.dataclass
    class PoolTransferResult:
        kv_hit_pages: int
        extra_pool_hit_pages: Dict[str, int]

    class HiCacheStorage(abc.ABC):
        def register_mem_pool_host(self, mem_pool_host):
            self.mem_pool_host = mem_pool_host

        def register_mem_host_pool_v2(self, host_pool, host_pool_name):
            if not hasattr(self, "registered_pools"):
                self.registered_pools = {}
            self.registered_pools[host_pool_name] = host_pool

        @abc.abstractmethod
        def get(self, key, target_location=None, target_sizes=None): ...

        @abc.abstractmethod
        def batch_get(self, keys, target_locations=None, target_sizes=None): ...

        @abc.abstractmethod
        def set(self, key, value=None, target_location=None, target_sizes=None): ...

        @abc.abstractmethod
        def batch_set(self, keys, values=None, target_locations=None, target_sizes=None): ...

        @abc.abstractmethod
        def exists(self, key): ...

        def batch_exists(self, keys, extra_info=None):
            for i, key in enumerate(keys):
                if not self.exists(key):
                    return i
            return len(keys)

        def clear(self):
            pass

        def get_stats(self):
            return None

    for name, value in dict(HiCacheStorage=HiCacheStorage, HiCacheStorageConfig=HiCacheStorageConfig,
                            HiCacheStorageExtraInfo=HiCacheStorageExtraInfo, PoolName=PoolName,
                            PoolHitPolicy=PoolHitPolicy, PoolTransfer=PoolTransfer,
                            PoolTransferResult=PoolTransferResult).items():
        if name not in without:
            setattr(m, name, value)
    return m


def fake_metrics(module_name):
    """StorageMetrics as that release keeps it: the four lists, plus prefetch_occupied_ratios (a
    list) in the old module or prefetch_stats (a dict) in the new one."""
    m = types.ModuleType(module_name)
    extra = ("prefetch_occupied_ratios", List[float], dataclasses.field(default_factory=list)) \
        if module_name == METRICS_OLD else ("prefetch_stats", Dict[str, float], dataclasses.field(default_factory=dict))
    m.StorageMetrics = dataclasses.make_dataclass("StorageMetrics", [
        ("prefetch_pgs", List[int], dataclasses.field(default_factory=list)),
        ("backup_pgs", List[int], dataclasses.field(default_factory=list)),
        ("prefetch_bandwidth", List[float], dataclasses.field(default_factory=list)),
        ("backup_bandwidth", List[float], dataclasses.field(default_factory=list)), extra])
    return m


class StorageBackendFactory:
    """The dynamic path of SGLang's factory (create_backend -> _create_dynamic_backend ->
    _load_backend_class), against the HiCacheStorage of `hicache_storage`."""

    def __init__(self, hicache_storage):
        self.base = hicache_storage.HiCacheStorage

    def create_backend(self, backend_name, storage_config, mem_pool_host, **kwargs):
        if backend_name != "dynamic" or storage_config.extra_config is None:
            raise ValueError(f"Unknown storage backend '{backend_name}'")
        config = storage_config.extra_config
        for field in ("backend_name", "module_path", "class_name"):
            if field not in config:
                raise ValueError(f"Missing required field '{field}'")
        module = importlib.import_module(config["module_path"])
        backend_class = getattr(module, config["class_name"])
        if not issubclass(backend_class, self.base):
            raise TypeError(f"Backend class {config['class_name']} must inherit from HiCacheStorage")
        return backend_class(storage_config, kwargs)


_copies = itertools.count()


@pytest.fixture
def load_against(monkeypatch):
    """load_against({module name: module}) -> a fresh copy of sparsekv/sglang.py imported with
    exactly those SGLang modules in place (and no other SGLang), registered under its own name so
    that the factory can import it. Everything is undone after the test."""
    def load(modules):
        for parent in ("sglang", "sglang.srt", "sglang.srt.mem_cache", "sglang.srt.metrics",
                       "sglang.srt.observability"):
            monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
        for name in (HICACHE, METRICS_NEW, METRICS_OLD):
            monkeypatch.delitem(sys.modules, name, raising=False)
        for name, module in modules.items():
            monkeypatch.setitem(sys.modules, name, module)
        name = f"sparsekv._sglang_against_fake_{next(_copies)}"
        spec = importlib.util.spec_from_file_location(name, sk.__file__)
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, module)
        spec.loader.exec_module(module)
        return module
    return load


@pytest.fixture(scope="module")
def daemon():
    d = Daemon(host_bytes="256MiB")
    yield d
    d.stop()


def storage_config(hs, module, address, **extra):
    return hs.HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=True,
        enable_storage_metrics=True, is_page_first_layout=True, model_name="deepseek-ai/DeepSeek-V3.2",
        extra_config={"backend_name": "sparsekv", "module_path": module.__name__, "class_name": "SparseKVStorage",
                      "interface_v1": 1, "address": address, **extra})


def module_warnings(caplog, module):
    return [r.getMessage() for r in caplog.records if r.name == module.__name__ and r.levelno == logging.WARNING]


@pytest.mark.parametrize("without", [("PoolHitPolicy",), V2_NAMES], ids=["no-PoolHitPolicy", "no-v2-names"])
def test_an_older_sglang_attaches_through_its_factory(daemon, caplog, load_against, without):
    """An SGLang without PoolHitPolicy (or without any of the hybrid-pool names): the module
    takes what it has, still subclasses its HiCacheStorage (so its factory constructs the
    backend, no TypeError), says once what it stands in for, and the backend works, hit
    policies read by value."""
    hs = fake_hicache_storage(without)
    with caplog.at_level(logging.WARNING):
        mod = load_against({HICACHE: hs, METRICS_NEW: fake_metrics(METRICS_NEW)})
    n = 3
    keys = numbered(n, 0x6f0_0000 + 0x1000 * len(without))
    kv, ix = MLAPool("page_first", n), BytesPerPagePool("page_first", n)
    for p in range(n):
        kv.fill(p * 64, 40 + p)
        ix.fill(p * 64, 50 + p)
    cfg = storage_config(hs, mod, daemon.unix)
    backend = StorageBackendFactory(hs).create_backend("dynamic", cfg, kv)  # TypeError if not a subclass
    assert isinstance(backend, hs.HiCacheStorage)
    assert mod.SGLANG is True and mod.HiCacheStorage is hs.HiCacheStorage
    assert mod.HiCacheStorageConfig is hs.HiCacheStorageConfig
    assert mod.SGLANG_MISSING == tuple(n for n in V2_NAMES if n in without)
    warned = module_warnings(caplog, mod)
    assert len(warned) == 1, warned
    assert all(name in warned[0] for name in without), warned
    assert all(name not in warned[0] for name in ("HiCacheStorage,", "StorageMetrics") + tuple(
        n for n in V2_NAMES if n not in without)), warned

    assert backend.batch_exists(keys) == 0  # nothing registered yet
    backend.register_mem_pool_host(kv)
    backend.register_mem_host_pool_v2(ix, "indexer")
    transfer = mod.PoolTransfer  # SGLang's where it has one, else the stand-in
    assert backend.batch_set_v2([transfer(name="indexer", host_indices=slots(0, n), keys=keys)]) == {
        "indexer": [True] * n}
    assert backend.batch_set_v1(keys, slots(0, n)) == [True] * n
    r = backend.batch_exists_v2(keys, [transfer(name="indexer")])  # no policy given: all pages
    assert (r.kv_hit_pages, r.extra_pool_hit_pages["indexer"]) == (n, n)
    if "PoolHitPolicy" in without and "PoolTransfer" not in without:
        assert not hasattr(transfer(name="indexer"), "hit_policy")
    else:  # a plain string policy, as an SGLang without the enum would hand it
        r = backend.batch_exists_v2(keys, [transfer(name="indexer", keys=keys[-1:], hit_policy="trailing_pages")])
        assert (r.kv_hit_pages, r.extra_pool_hit_pages["indexer"]) == (n, 1)
    backend.close()


def test_a_release_without_its_hicache_storage_class_is_named(load_against, caplog):
    """Should a release lack HiCacheStorage itself, the one warning says that its factory will
    refuse the backend (rather than failing silently)."""
    with caplog.at_level(logging.WARNING):
        mod = load_against({HICACHE: fake_hicache_storage(("HiCacheStorage",)), METRICS_NEW: fake_metrics(METRICS_NEW)})
    warned = module_warnings(caplog, mod)
    assert len(warned) == 1 and "HiCacheStorage" in warned[0] and "refuses" in warned[0], warned
    assert mod.SGLANG is False


@pytest.mark.parametrize("where", [METRICS_NEW, METRICS_OLD, None], ids=["new-location", "old-location", "neither"])
def test_storage_metrics_come_from_where_the_release_keeps_them(daemon, caplog, load_against, where):
    """get_stats answers an instance of the installed release's StorageMetrics, at
    sglang.srt.observability.metrics_collector or at the older sglang.srt.metrics.collector,
    which SGLang's collector checks with isinstance. Found in neither, the one warning says so."""
    hs = fake_hicache_storage()
    metrics = fake_metrics(where) if where else None
    with caplog.at_level(logging.WARNING):
        mod = load_against({HICACHE: hs, **({where: metrics} if where else {})})
    warned = module_warnings(caplog, mod)
    backend = StorageBackendFactory(hs).create_backend("dynamic", storage_config(hs, mod, daemon.unix), None)
    backend.register_mem_pool_host(MLAPool("page_first", 2))
    keys = numbered(2, 0x6f1_0000 + 0x1000 * [METRICS_NEW, METRICS_OLD, None].index(where))
    assert backend.batch_set_v1(keys, slots(0, 2)) == [True, True]
    assert backend.batch_get_v1(keys, slots(0, 2)) == [True, True]
    stats = backend.get_stats()
    if where is None:
        assert mod.STORAGE_METRICS_MODULE is None
        assert len(warned) == 1 and "StorageMetrics" in warned[0], warned
    else:
        assert isinstance(stats, metrics.StorageMetrics)  # what log_storage_metrics asserts
        assert stats.prefetch_pgs == [2] and stats.backup_pgs == [2]
        assert mod.STORAGE_METRICS_MODULE == where
        assert warned == []
    assert stats.sparsekv["hits"] == 2
    backend.close()
