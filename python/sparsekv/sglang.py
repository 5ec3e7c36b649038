"""sparsekv as SGLang's HiCache L3 storage backend (``--hicache-storage-backend dynamic``).

SGLang's hierarchical cache keeps KV pages on the GPU, then in a host memory pool, then in an
"L3" store behind the ``HiCacheStorage`` interface. ``SparseKVStorage`` is such a store, backed
by a running ``sparsekvd``. Start SGLang with::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "sparsekv",
        "module_path": "sparsekv.sglang", "class_name": "SparseKVStorage", "interface_v1": 1,
        "address": "unix:/path/to/sparsekvd.sock", "namespace": "default", "token": ""}'

The contract was read from SGLang's source (sgl-project/sglang): ``mem_cache/hicache_storage.py``,
``mem_cache/storage/backend_factory.py`` and ``managers/cache_controller.py`` at commit
001067fffe33427bee0ed2f007fb7551a1d76b44; ``mem_cache/hybrid_cache/hybrid_cache_controller.py``
at 00343773d3293d382f0b39101f36b656d30ad2f0; ``StorageMetrics`` in
``srt/observability/metrics_collector.py`` at 016d8605e45876180312e29d6988e1de06562472 and, in
older releases, ``srt/metrics/collector.py`` (read at 00ae9c1590d2d0bb6c0bfff39e312c34ae3dd538);
the host pools of ``mem_cache/pool_host/`` at the commits named in the README. Facts used here:

* The dynamic factory imports ``module_path``, takes ``class_name``, requires a subclass of
  SGLang's ``HiCacheStorage`` (else ``TypeError``) and constructs it as
  ``cls(storage_config, kwargs)``, ``kwargs`` being a dict (empty); the controller then calls
  ``register_mem_pool_host`` and, for hybrid models (DeepSeek V3.2's indexer, V4's compressed
  pools), the hybrid controller registers every pool of its group through
  ``register_mem_host_pool_v2(host_pool, name)``. No pool is known before those calls.
* The controller moves pages zero-copy (``batch_get_v1``/``batch_set_v1``) only when the dynamic
  backend's extra config has a true ``interface_v1``; otherwise it uses the generic path:
  ``batch_set(keys, [pool.get_data_page(first slot of the page) ...]) -> bool``,
  ``batch_exists(keys, extra_info) -> int`` (the leading run present) and
  ``batch_get(keys, [pool.get_dummy_flat_data_page() ...]) -> [tensor or None]``, each page then
  copied in with ``set_from_flat_data_page``. Hybrid models ask ``batch_exists_v2`` for the hit
  and still move the KV by the path above, the side pools by ``batch_get_v2``/``batch_set_v2``.
* Keys are 64-hex page hashes chained over the prefix, without any rank: the backend adds its
  own. MLA models (DeepSeek) write from TP rank 0 only and every TP rank reads the same pages.
* ``host_indices`` holds ``page_size`` token slots per page; a page's bytes are where the pool's
  ``get_page_buffer_meta(host_indices)`` says: one (pointer, size) per page for the
  ``page_first`` layouts, one per layer per page for ``layer_first`` (MHA: K and V each).
* ``batch_get_v1`` and ``batch_set_v1`` answer one bool per page; ``batch_exists_v2`` a
  ``PoolTransferResult(kv_hit_pages, extra_pool_hit_pages)`` whose KV hit honours every pool's
  hit policy (``all_pages``: every page of the prefix; ``trailing_pages``: only the last N,
  N = the transfer's keys); ``batch_get_v2``/``batch_set_v2`` ``{pool name: [bool per page]}``.
* ``get_stats`` hands SGLang's collector a ``StorageMetrics``, which it checks with
  ``isinstance``: the class is the one of the release installed, wherever it keeps it.
* ``PoolName``, ``PoolHitPolicy``, ``PoolTransfer`` and ``PoolTransferResult`` came with the
  hybrid-pool (v2) interface; releases before it have only ``HiCacheStorage``,
  ``HiCacheStorageConfig`` and ``HiCacheStorageExtraInfo``. Each name is taken from SGLang where
  it has it and stood in for where it does not (one warning says which), so the class always
  subclasses the ``HiCacheStorage`` SGLang's factory checks against. Hit policies and pool
  names are compared by their values, which is all a stand-in needs.
* The controller's threads never survive an exception out of the backend: every failure here
  becomes a miss, ``0`` or ``False``, and the next call reconnects.

How pages are filed in sparsekv: one value per (pool, page, piece), its 16-byte key the
BLAKE2b-128 of ``sglang|<model>|<ranks>|<pool>|<page hash>|<pieces>x<bytes>|<piece>``, where
``<ranks>`` is ``mla`` for rank-replicated models (all TP ranks share one copy) or
``tp<rank>of<size>``, then ``pp<rank>of<size>`` and ``cp<rank>of<size>`` when those are above
1. The piece count and size are part of the key, so a worker with another layout or geometry
misses instead of reading bytes laid out otherwise. The generic path files a page as one flat
piece (``<piece>`` = ``flat``) of the size of the pool's flat data page. Values move between the
host pool and the daemon with no Python-level copy: ``Client.get_into`` straight into the pool's
pages (over the Unix socket out of the daemon's shared memory, one memcpy), and ``Client.put``
from them.
"""

import collections as _collections
import ctypes as _ctypes
import hashlib as _hashlib
import importlib as _importlib
import logging as _logging
import threading as _threading
import time as _time
from abc import ABC as _ABC
from dataclasses import dataclass as _dataclass, field as _field
from enum import Enum as _Enum
from typing import Any, List, Optional

from . import Client, Error
from ._plugin import check_options as _check_options

_log = _logging.getLogger(__name__)


def _import(name):
    """The module `name`, or None where this SGLang has no such module."""
    try:
        return _importlib.import_module(name)
    except ImportError:
        return None


# ---- stand-ins, with SGLang's names, fields and values (see the docstring) ----

class _PoolName(str, _Enum):
    KV = "kv"
    MAMBA = "mamba"
    SWA = "swa"
    INDEXER = "indexer"
    DEEPSEEK_V4_C4 = "deepseek_v4_c4"
    DEEPSEEK_V4_C4_INDEXER = "deepseek_v4_c4_indexer"
    DEEPSEEK_V4_C128 = "deepseek_v4_c128"
    DEEPSEEK_V4_C4_STATE = "deepseek_v4_c4_state"
    DEEPSEEK_V4_C4_INDEXER_STATE = "deepseek_v4_c4_indexer_state"
    DEEPSEEK_V4_C128_STATE = "deepseek_v4_c128_state"
    DRAFT = "draft"
    DRAFT_INDEXER = "draft_indexer"
    DRAFT_SWA = "draft_swa"

    def __str__(self):
        return self.value


class _PoolHitPolicy(str, _Enum):
    ALL_PAGES = "all_pages"
    TRAILING_PAGES = "trailing_pages"


@_dataclass
class _HiCacheStorageConfig:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    is_mla_model: bool = False
    enable_storage_metrics: bool = False
    is_page_first_layout: bool = True
    model_name: Optional[str] = None
    dp_rank: int = 0
    dp_size: int = 1
    tp_lcm_size: Optional[int] = None
    should_split_heads: bool = False
    extra_config: Optional[dict] = None


@_dataclass
class _HiCacheStorageExtraInfo:
    prefix_keys: Optional[List[str]] = None
    extra_info: Optional[dict] = None


@_dataclass
class _PoolTransfer:
    name: Any
    host_indices: Any = None
    device_indices: Any = None
    keys: Optional[List[str]] = None
    hit_policy: Any = "all_pages"
    nodes_to_load: Optional[List[Any]] = None
    indices_from_pool: Any = None


@_dataclass
class _PoolTransferResult:
    kv_hit_pages: int = 0
    extra_pool_hit_pages: dict = _field(default_factory=dict)


class _HiCacheStorage(_ABC):
    def register_mem_pool_host(self, mem_pool_host):
        self.mem_pool_host = mem_pool_host

    def register_mem_host_pool_v2(self, host_pool, host_pool_name):
        if not hasattr(self, "registered_pools"):
            self.registered_pools = {}
        self.registered_pools[host_pool_name] = host_pool

    def clear(self):
        return None

    def get_stats(self):
        return None


class _StorageMetrics:  # SGLang's four lists, as get_stats hands them to its collector
    def __init__(self):
        self.prefetch_pgs = []
        self.backup_pgs = []
        self.prefetch_bandwidth = []
        self.backup_bandwidth = []


# ---- what the installed SGLang has, name by name ----

_HICACHE_MODULE = "sglang.srt.mem_cache.hicache_storage"
# Where releases keep StorageMetrics, newest first.
_METRICS_MODULES = ("sglang.srt.observability.metrics_collector", "sglang.srt.metrics.collector")
# What is lost without each name (a stand-in of the same name and values is used instead).
_WITHOUT = {
    "HiCacheStorage": "SparseKVStorage cannot subclass SGLang's HiCacheStorage, so SGLang's factory refuses it",
    "HiCacheStorageConfig": "a stand-in config is used only when none is given",
    "HiCacheStorageExtraInfo": "nothing (extra_info is not read)",
    "PoolName": "pool names are compared as plain strings",
    "PoolHitPolicy": "hit policies are read by value ('all_pages', 'trailing_pages'; none given: all_pages)",
    "PoolTransfer": "the hybrid-pool (v2) calls take any object with name/keys/host_indices",
    "PoolTransferResult": "batch_exists_v2 answers a stand-in with kv_hit_pages and extra_pool_hit_pages",
    "StorageMetrics": "get_stats answers a stand-in that SGLang's collector rejects: keep storage metrics off",
}

try:
    _sglang_storage = _import(_HICACHE_MODULE)
except Exception as e:  # noqa: BLE001 - an SGLang that fails to import its own module: stand-ins
    _log.warning("sparsekv.sglang: importing %s failed (%s: %s); using stand-ins for every SGLang type",
                 _HICACHE_MODULE, type(e).__name__, e)
    _sglang_storage = None

_MISSING = []


def _take(name, stand_in):
    real = getattr(_sglang_storage, name, None) if _sglang_storage is not None else None
    if real is None:
        if _sglang_storage is not None:
            _MISSING.append(name)
        return stand_in
    return real


HiCacheStorage = _take("HiCacheStorage", _HiCacheStorage)
HiCacheStorageConfig = _take("HiCacheStorageConfig", _HiCacheStorageConfig)
HiCacheStorageExtraInfo = _take("HiCacheStorageExtraInfo", _HiCacheStorageExtraInfo)
PoolName = _take("PoolName", _PoolName)
PoolHitPolicy = _take("PoolHitPolicy", _PoolHitPolicy)
PoolTransfer = _take("PoolTransfer", _PoolTransfer)
PoolTransferResult = _take("PoolTransferResult", _PoolTransferResult)

StorageMetrics = None
STORAGE_METRICS_MODULE = None  # where this SGLang keeps StorageMetrics (None: the stand-in)
if _sglang_storage is not None:
    for _module_name in _METRICS_MODULES:
        try:
            _metrics = _import(_module_name)
        except Exception:  # noqa: BLE001 - a module that fails to import: try the other place
            _metrics = None
        if _metrics is not None and getattr(_metrics, "StorageMetrics", None) is not None:
            StorageMetrics, STORAGE_METRICS_MODULE = _metrics.StorageMetrics, _module_name
            break
    if StorageMetrics is None:
        _MISSING.append("StorageMetrics")
if StorageMetrics is None:
    StorageMetrics = _StorageMetrics

# True when SparseKVStorage subclasses SGLang's own HiCacheStorage (what its factory requires).
SGLANG = HiCacheStorage is not _HiCacheStorage
# The names this SGLang lacks, stood in for (empty without SGLang or with a complete one).
SGLANG_MISSING = tuple(_MISSING)
if SGLANG_MISSING:
    _log.warning("sparsekv.sglang: the installed SGLang lacks %s; each is stood in for: %s",
                 ", ".join(SGLANG_MISSING), "; ".join(f"{n}: {_WITHOUT[n]}" for n in SGLANG_MISSING))


__all__ = ["SparseKVStorage", "SGLANG", "SGLANG_MISSING", "PoolName", "PoolHitPolicy", "PoolTransfer",
           "PoolTransferResult", "HiCacheStorageConfig", "HiCacheStorageExtraInfo", "StorageMetrics"]

_OPTIONS = {
    # name: (type check, description, default)
    "address": (lambda v: isinstance(v, str) and (v.startswith("unix:") or ":" in v),
                "a sparsekvd address, 'unix:PATH' or 'HOST:PORT'", "unix:var/sparsekvd.sock"),
    "namespace": (lambda v: isinstance(v, str) and 0 < len(v) <= 256, "a namespace name (1 to 256 bytes)", "default"),
    "token": (lambda v: isinstance(v, str) and len(v) <= 256, "a string of at most 256 bytes", ""),
    "transport": (lambda v: v in ("auto", "shm", "socket"), "'auto', 'shm' or 'socket'", "auto"),
    "timeout": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 3600,
                "seconds, a number in (0, 3600]", 10.0),
    "reconnect_interval": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 600,
                           "seconds, a number in [0, 600]", 1.0),
    "key_tag": (lambda v: isinstance(v, str) and len(v) <= 128, "a string of at most 128 bytes", ""),
    # Pages batch_exists finds are about to be prefetched: they are hinted to the daemon for this
    # long (protected from eviction, brought up into host memory). 0: no hints.
    "hint_ttl": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 600,
                 "seconds, a number in [0, 600]", 10.0),
}
# Keys of the extra config that belong to SGLang, not to this backend (read by its controller and
# factory at the commits above).
_SGLANG_KEYS = {"backend_name", "module_path", "class_name", "interface_v1", "prefetch_threshold",
                "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "prefetch_timeout_max",
                "hicache_storage_pass_prefix_keys", "tp_lcm_size"}


def _options(extra):
    """This backend's options from the extra config. A bad value of a known key raises ValueError
    naming the key; a key nobody here knows (a newer SGLang's, or a typo) is warned about,
    naming the closest known key, and otherwise ignored (_plugin.check_options)."""
    return _check_options(extra, _OPTIONS, "sparsekv HiCache backend", "extra config", _SGLANG_KEYS, log=_log)


def _name(pool):
    return pool.value if isinstance(pool, _Enum) else str(pool)


def _policy(transfer):
    """A transfer's hit policy by value: 'all_pages' (the default) or 'trailing_pages'."""
    policy = getattr(transfer, "hit_policy", None)
    return "all_pages" if policy is None else _name(policy)


class SparseKVStorage(HiCacheStorage):
    """SGLang HiCache L3 storage in sparsekvd. Construct as SGLang's dynamic factory does:
    ``SparseKVStorage(storage_config, kwargs)``; options come from
    ``storage_config.extra_config`` (address, namespace, token, transport, timeout,
    reconnect_interval, key_tag, hint_ttl); a bad value raises ValueError naming its key, a key
    this backend does not know is warned about. With a true ``interface_v1`` (as SGLang reads
    it) the KV moves by ``batch_*_v1``, otherwise by the generic ``batch_set``/``batch_get``;
    ``batch_exists`` and ``batch_exists_v2`` look for the KV pages where that path files them."""

    def __init__(self, storage_config=None, kwargs=None):
        if storage_config is None:  # SGLang's own config has no defaults for the ranks
            storage_config = _HiCacheStorageConfig()
        self.storage_config = storage_config
        extra = getattr(storage_config, "extra_config", None)
        self.options = _options(extra)
        # SGLang's controller moves the KV zero-copy only with a true interface_v1; otherwise it
        # uses batch_set/batch_get with flat pages, which file the KV under other keys.
        self.interface_v1 = bool(extra.get("interface_v1", 0)) if isinstance(extra, dict) else False
        cfg = storage_config
        ranks = ["mla" if getattr(cfg, "is_mla_model", False) else
                 f"tp{getattr(cfg, 'tp_rank', 0)}of{getattr(cfg, 'tp_size', 1)}"]
        if getattr(cfg, "pp_size", 1) > 1:
            ranks.append(f"pp{cfg.pp_rank}of{cfg.pp_size}")
        if getattr(cfg, "attn_cp_size", 1) > 1:
            ranks.append(f"cp{cfg.attn_cp_rank}of{cfg.attn_cp_size}")
        model = getattr(cfg, "model_name", None) or ""
        self._prefix = "|".join(["sglang", self.options["key_tag"], model, ".".join(ranks)])
        self.mem_pool_host = None
        self.registered_pools = {}
        self._lock = _threading.Lock()
        self._client = None
        self._next_connect = 0.0
        self._written = set()  # keys this instance stored (clear() deletes them)
        self._flat_bytes = {}  # id(pool) -> (pool, bytes of its flat data page)
        self._metrics = StorageMetrics()
        self._latencies = {"get": [], "set": [], "exists": []}  # the last 1,024 calls' seconds each
        self.counters = {"hits": 0, "misses": 0, "bytes_read": 0, "bytes_written": 0, "errors": 0,
                         "get_seconds": 0.0, "set_seconds": 0.0, "exists_seconds": 0.0, "reconnects": 0,
                         "hints": 0, "hinted_keys": 0, "hints_refused": 0}
        self._hints = _collections.deque()  # (hint id, monotonic expiry) of this client's live hints
        self._connect(raise_errors=False)  # a daemon not up yet is tried again at the first call

    # ---- connection ----

    def _connect(self, raise_errors=True):
        o = self.options
        shm = o["transport"] == "shm" or (o["transport"] == "auto" and o["address"].startswith("unix:"))
        try:
            c = Client(o["address"], o["namespace"], o["token"], client_name="sglang-hicache",
                       shared_memory=shm, timeout=float(o["timeout"]))
        except Error:
            self._next_connect = _time.monotonic() + float(o["reconnect_interval"])
            if raise_errors:
                raise
            return None
        with self._lock:
            old, self._client = self._client, c
        if old is not None:
            old.close()
        return c

    def _get_client(self):
        c = self._client
        if c is not None:
            return c
        if _time.monotonic() < self._next_connect:
            return None
        self.counters["reconnects"] += 1
        return self._connect(raise_errors=False)

    def _failed(self, c):
        """A call on `c` failed: it is dropped, and the next call connects again."""
        self.counters["errors"] += 1
        with self._lock:
            if self._client is c:
                self._client = None
                self._next_connect = _time.monotonic() + float(self.options["reconnect_interval"])
        try:
            c.close()
        except Exception:  # noqa: BLE001 - closing a broken client must not raise
            pass

    def close(self):
        with self._lock:
            c, self._client = self._client, None
        if c is not None:
            c.close()

    # ---- keys and pages ----

    def _key(self, pool, page_hash, pieces, piece_bytes, piece):
        text = f"{self._prefix}|{pool}|{page_hash}|{pieces}x{piece_bytes}|{piece}"
        return _hashlib.blake2b(text.encode(), digest_size=16).digest()

    def _pool(self, name):
        """The host pool registered under `name` (the KV: also the one of register_mem_pool_host);
        None for a pool never registered, which then holds nothing: every page of it a miss."""
        name = _name(name)
        for k, p in (getattr(self, "registered_pools", None) or {}).items():
            if p is not None and _name(k) == name:
                return p
        if name == "kv":
            return getattr(self, "mem_pool_host", None)
        return None

    @staticmethod
    def _meta(pool, host_indices, pages):
        """Per page, its pieces as (pointer, bytes); None when the pool keeps no bytes (V4's
        logical KV anchor)."""
        if pool is None or pages == 0:
            return None
        meta = pool.get_page_buffer_meta(host_indices)
        if meta is None:
            return None
        ptrs, sizes = meta
        if len(ptrs) % pages != 0 or len(ptrs) != len(sizes):
            raise ValueError(f"the host pool gave {len(ptrs)} buffers for {pages} pages")
        each = len(ptrs) // pages
        return [[(int(ptrs[p * each + j]), int(sizes[p * each + j])) for j in range(each)] for p in range(pages)]

    def _page_keys(self, pool_name, hashes, layout):
        """Keys of every piece of every page, page by page; `layout` is one page's pieces."""
        n, size = len(layout), layout[0][1] if layout else 0
        return [self._key(pool_name, h, n, size, j) for h in hashes for j in range(n)]

    # ---- the v1 (zero-copy) path ----

    def _read(self, pool_name, pool, keys, host_indices):
        """Reads pages into the pool; one bool per page (never raises)."""
        n = len(keys)
        if pool is None:  # never registered: nothing of it can be read
            self.counters["misses"] += n
            return [False] * n
        t0 = _time.perf_counter()
        try:
            meta = self._meta(pool, host_indices, n)
        except Exception:  # noqa: BLE001 - a pool that cannot say where its pages are: nothing read
            self.counters["errors"] += 1
            return [False] * n
        if meta is None:
            return [True] * n  # nothing of this pool is stored (a logical pool)
        c = self._get_client()
        if c is None:
            self.counters["misses"] += n
            return [False] * n
        pieces = len(meta[0])
        keys_all = [self._key(pool_name, h, pieces, meta[p][0][1], j) for p, h in enumerate(keys) for j in range(pieces)]
        dests = [piece for page in meta for piece in page]
        try:
            got = c.get_into(keys_all, dests)
        except Error:
            self._failed(c)
            return [False] * n
        except Exception:  # noqa: BLE001 - a value of another size than its page, say: a miss
            self.counters["errors"] += 1
            return [False] * n
        out = []
        nbytes = 0
        for p in range(n):
            sizes = got[p * pieces:(p + 1) * pieces]
            ok = all(s is not None and s == dests[p * pieces + j][1] for j, s in enumerate(sizes))
            out.append(ok)
            if ok:
                nbytes += sum(sizes)
        self._count_get(n, sum(out), nbytes, t0)
        return out

    def _write(self, pool_name, pool, keys, host_indices):
        """Stores pages from the pool; one bool per page (never raises)."""
        n = len(keys)
        if pool is None:  # never registered: nothing of it can be stored
            return [False] * n
        t0 = _time.perf_counter()
        try:
            meta = self._meta(pool, host_indices, n)
        except Exception:  # noqa: BLE001
            self.counters["errors"] += 1
            return [False] * n
        if meta is None:
            return [True] * n
        c = self._get_client()
        if c is None:
            return [False] * n
        pieces = len(meta[0])
        keys_all = [self._key(pool_name, h, pieces, meta[p][0][1], j) for p, h in enumerate(keys) for j in range(pieces)]
        # The pool's pages, handed over where they lie (ctypes arrays over the pinned memory).
        values = [(_ctypes.c_ubyte * size).from_address(ptr) for page in meta for ptr, size in page]
        try:
            errs = c.put(keys_all, values)
        except Error:
            self._failed(c)
            return [False] * n
        except Exception:  # noqa: BLE001 - never out of the backup thread
            self.counters["errors"] += 1
            return [False] * n
        out = [all(e is None for e in errs[p * pieces:(p + 1) * pieces]) for p in range(n)]
        nbytes = sum(size for p, page in enumerate(meta) if out[p] for _, size in page)
        with self._lock:
            for p in range(n):
                if out[p]:
                    self._written.update(keys_all[p * pieces:(p + 1) * pieces])
        self._count_set(sum(out), nbytes, t0)
        return out

    def _present(self, keys_all):
        """Per key, whether the daemon holds it (None when the daemon cannot be asked)."""
        c = self._get_client()
        if c is None:
            return None
        t0 = _time.perf_counter()
        try:
            _, tiers = c.lookup(keys_all)
        except Error:
            self._failed(c)
            return None
        finally:
            dt = _time.perf_counter() - t0
            self.counters["exists_seconds"] += dt
            self._latency("exists", dt)
        return [t != "absent" for t in tiers]

    def _pages_present(self, pool_name, pool, hashes, keys_out=None):
        """Per page of `hashes`, whether every piece of it is held (None: cannot tell; False for
        every page of a pool never registered; True for every page of a registered pool that
        keeps no bytes). With `keys_out` (a list), each page's piece keys are appended to it,
        one list per page."""
        if not hashes:
            return []
        if pool is None:
            if keys_out is not None:
                keys_out.extend([] for _ in hashes)
            return [False] * len(hashes)
        layout = self._layout(pool)
        if layout is None:
            if keys_out is not None:
                keys_out.extend([] for _ in hashes)
            return [True] * len(hashes)
        keys = self._page_keys(pool_name, hashes, layout)
        k = len(layout)
        if keys_out is not None:
            keys_out.extend(keys[p * k:(p + 1) * k] for p in range(len(hashes)))
        present = self._present(keys)
        if present is None:
            return None
        return [all(present[p * k:(p + 1) * k]) for p in range(len(hashes))]

    def _hint(self, keys):
        """Hints `keys` (pages about to be prefetched) to the daemon for hint_ttl seconds; never
        raises. When the daemon's bound on a session's hinted blocks refuses it, this client's
        oldest hint is dropped and the hint tried once more."""
        ttl = float(self.options["hint_ttl"])
        if ttl <= 0 or not keys:
            return
        c = self._get_client()
        if c is None:
            return
        now = _time.monotonic()
        with self._lock:
            while self._hints and self._hints[0][1] <= now:
                self._hints.popleft()
        for attempt in range(2):
            try:
                info = c.hint(keys, ttl)
            except Error as e:
                if type(e).__name__ != "ResourceExhausted" or attempt == 1:
                    self.counters["hints_refused"] += 1
                    return
                with self._lock:
                    oldest = self._hints.popleft() if self._hints else None
                if oldest is None:
                    self.counters["hints_refused"] += 1
                    return
                try:
                    c.drop_hint(oldest[0])
                except Error:
                    pass  # expired meanwhile
                continue
            with self._lock:
                self._hints.append((info.hint, now + ttl))
            self.counters["hints"] += 1
            self.counters["hinted_keys"] += len(keys)
            return

    def _kv_present(self, hashes, keys_out=None):
        """_pages_present for the KV, where the path SGLang uses with this config files it: the
        pool's pieces with interface_v1, one flat page otherwise."""
        pool = self._pool("kv")
        if self.interface_v1:
            return self._pages_present("kv", pool, hashes, keys_out)
        if not hashes:
            return []
        nbytes = self._flat_page_bytes(pool)
        if nbytes is None:  # unregistered, or a pool with no flat page: nothing to find
            if keys_out is not None:
                keys_out.extend([] for _ in hashes)
            return [False] * len(hashes)
        keys = [self._flat_key(h, nbytes) for h in hashes]
        if keys_out is not None:
            keys_out.extend([k] for k in keys)
        return self._present(keys)

    def _flat_page_bytes(self, pool):
        """Bytes of one flat data page of `pool` (what the generic path stores per page: SGLang
        hands batch_get the pool's get_dummy_flat_data_page() and batch_set its
        get_data_page(...), of that size); None when the pool is None or has no flat pages."""
        if pool is None:
            return None
        cached = self._flat_bytes.get(id(pool))
        if cached is not None and cached[0] is pool:
            return cached[1]
        nbytes = None
        dummy = getattr(pool, "get_dummy_flat_data_page", None)
        if dummy is not None:
            page = dummy()
            nbytes = int(page.element_size() * page.numel())
        else:
            layout = self._layout(pool)
            if layout:
                nbytes = sum(size for _, size in layout)
        if nbytes is not None:
            self._flat_bytes[id(pool)] = (pool, nbytes)
        return nbytes

    def _layout(self, pool):
        """One page's pieces (pointer, bytes) of `pool`, from its first page (the sizes are what
        matter: every page of a pool has the same)."""
        if pool is None:
            return None
        page_size = getattr(pool, "page_size", 1)
        try:
            import torch
            idx = torch.arange(page_size, dtype=torch.int64)
        except ImportError:  # pragma: no cover - SGLang always has torch
            idx = list(range(page_size))
        meta = self._meta(pool, idx, 1)
        return None if meta is None else meta[0]

    def batch_get_v1(self, keys: List[str], host_indices, extra_info=None) -> List[bool]:
        return self._read("kv", self.mem_pool_host, list(keys), host_indices)

    def batch_set_v1(self, keys: List[str], host_indices, extra_info=None) -> List[bool]:
        return self._write("kv", self.mem_pool_host, list(keys), host_indices)

    def batch_exists(self, keys: List[str], extra_info=None) -> int:
        try:
            page_keys = []
            present = self._kv_present(list(keys), page_keys)
            if present is None:
                return 0
            n = 0
            while n < len(present) and present[n]:
                n += 1
            # The controller prefetches what this found next: keep it from being evicted first.
            self._hint([k for page in page_keys[:n] for k in page])
            return n
        except Exception:  # noqa: BLE001 - never out of the prefetch thread
            self.counters["errors"] += 1
            return 0

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ---- the hybrid pools (v2) ----

    def batch_exists_v2(self, keys: List[str], pool_transfers=None, extra_info=None):
        keys = list(keys)
        try:
            kv_keys = []
            kv = self._kv_present(keys, kv_keys)
            if kv is None:
                return PoolTransferResult(0, {})
            extra_keys = {}
            hit = 0
            while hit < len(kv) and kv[hit]:
                hit += 1
            extra = {}
            for t in pool_transfers or []:
                name = _name(t.name)
                if name == "kv":
                    continue
                pool = self._pool(name)
                extra_keys[name] = []
                present = self._pages_present(name, pool, keys[:hit], extra_keys[name])
                if present is None:
                    return PoolTransferResult(0, {})
                if _policy(t) == "trailing_pages":
                    # The longest prefix whose last N pages this pool holds (N = the pages the
                    # transfer names, at least 1).
                    window = max(1, len(getattr(t, "keys", None) or []))
                    best = 0
                    for end in range(hit, 0, -1):
                        if all(present[max(0, end - window):end]):
                            best = end
                            break
                    extra[name] = min(window, best)
                    hit = best
                else:  # all_pages: every page of the prefix
                    run = 0
                    while run < len(present) and present[run]:
                        run += 1
                    extra[name] = run
                    hit = min(hit, run)
            # What the prefetch will read: every pool's pages of the prefix (a trailing pool's
            # last pages only), hinted so that they stay until it does.
            hinted = [k for page in kv_keys[:hit] for k in page]
            for t in pool_transfers or []:
                name = _name(t.name)
                if name not in extra_keys:
                    continue
                first = max(0, hit - extra[name]) if _policy(t) == "trailing_pages" else 0
                hinted.extend(k for page in extra_keys[name][first:hit] for k in page)
            self._hint(hinted)
            return PoolTransferResult(hit, extra)
        except Exception:  # noqa: BLE001 - never out of the prefetch thread
            self.counters["errors"] += 1
            return PoolTransferResult(0, {})

    def _each_transfer(self, transfers, move):
        out = {}
        for t in transfers or []:
            name = _name(t.name)
            keys = list(getattr(t, "keys", None) or [])
            try:
                pool = self._pool(name)
                if pool is None:  # never registered: holds nothing, stores nothing
                    out[name] = [False] * len(keys)
                    continue
                out[name] = move(name, pool, keys, t.host_indices)
            except Exception:  # noqa: BLE001 - never out of the controller's threads
                self.counters["errors"] += 1
                out[name] = [False] * len(keys)
        return out

    def batch_get_v2(self, transfers, extra_info=None):
        return self._each_transfer(transfers, self._read)

    def batch_set_v2(self, transfers, extra_info=None):
        return self._each_transfer(transfers, self._write)

    # ---- the generic path: flat page tensors (SGLang's, without "interface_v1") ----

    def _flat_key(self, key, nbytes):
        return self._key("kv", key, 1, nbytes, "flat")

    def get(self, key, target_location=None, target_sizes=None):
        got = self.batch_get([key], [target_location] if target_location is not None else None)
        return got[0] if isinstance(got, list) and got else None

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        """Reads pages into `target_locations` (CPU tensors, one per key; the controller hands
        the pool's get_dummy_flat_data_page()); per key the filled tensor, or None for a miss.
        Never raises."""
        keys = list(keys)
        n = len(keys)
        t0 = _time.perf_counter()
        try:
            if target_locations is None:
                pool = self._pool("kv")
                if pool is None or not hasattr(pool, "get_dummy_flat_data_page"):
                    self.counters["misses"] += n
                    return [None] * n
                target_locations = [pool.get_dummy_flat_data_page() for _ in keys]
            target_locations = list(target_locations)
            if len(target_locations) != n:
                self.counters["errors"] += 1
                return [None] * n
            c = self._get_client()
            if c is None:
                self.counters["misses"] += n
                return [None] * n
            nbytes = [int(t.element_size() * t.numel()) for t in target_locations]
            try:
                got = c.get_into([self._flat_key(k, b) for k, b in zip(keys, nbytes)], target_locations)
            except Error:
                self._failed(c)
                return [None] * n
        except Exception:  # noqa: BLE001 - never out of the prefetch thread
            self.counters["errors"] += 1
            return [None] * n
        out = [t if g == b else None for t, g, b in zip(target_locations, got, nbytes)]
        read = sum(b for o, b in zip(out, nbytes) if o is not None)
        self._count_get(n, sum(o is not None for o in out), read, t0)
        return out

    def set(self, key, value=None, target_location=None, target_sizes=None):
        return self.batch_set([key], [value])

    @staticmethod
    def _bytes_of(value):
        """A page handed to batch_set as bytes the client can send: a tensor of any dtype
        (SGLang's get_data_page; bf16 included) as its raw bytes, anything else as it is."""
        if hasattr(value, "element_size") and hasattr(value, "contiguous"):
            import torch
            flat = value.detach().contiguous().view(-1)
            return flat.view(torch.uint8).numpy() if flat.dtype != torch.uint8 else flat.numpy()
        return value

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
        """Stores one flat page per key (the controller hands pool.get_data_page(...)); True
        when every page was stored. Never raises."""
        keys = list(keys)
        t0 = _time.perf_counter()
        try:
            if values is None or len(values) != len(keys):
                return False
            c = self._get_client()
            if c is None:
                return False
            arrays = [self._bytes_of(v) for v in values]
            sizes = [memoryview(a).nbytes for a in arrays]
            ks = [self._flat_key(k, b) for k, b in zip(keys, sizes)]
            try:
                errs = c.put(ks, arrays)
            except Error:
                self._failed(c)
                return False
        except Exception:  # noqa: BLE001 - never out of the backup thread
            self.counters["errors"] += 1
            return False
        ok = [e is None for e in errs]
        with self._lock:
            self._written.update(k for k, good in zip(ks, ok) if good)
        self._count_set(sum(ok), sum(b for b, good in zip(sizes, ok) if good), t0)
        return all(ok)

    # ---- the rest of the interface ----

    def register_mem_pool_host(self, mem_pool_host):
        super().register_mem_pool_host(mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool, host_pool_name):
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def clear(self):
        """Deletes what this instance stored (the daemon's namespace may hold other workers'
        pages too, which stay). True when every delete was answered."""
        c = self._get_client()
        if c is None:
            return False
        with self._lock:
            keys, self._written = list(self._written), set()
        try:
            for i in range(0, len(keys), 4096):
                c.delete(keys[i:i + 4096])
        except Error:
            self._failed(c)
            return False
        return True

    def _count_get(self, asked, hits, nbytes, t0):
        """A prefetch batch begun at `t0`: counters, latency and SGLang's StorageMetrics."""
        self.counters["hits"] += hits
        self.counters["misses"] += asked - hits
        self.counters["bytes_read"] += nbytes
        dt = _time.perf_counter() - t0
        self.counters["get_seconds"] += dt
        self._latency("get", dt)
        self._metrics.prefetch_pgs.append(hits)
        if dt > 0:
            self._metrics.prefetch_bandwidth.append(nbytes / dt / 1e9)

    def _count_set(self, pages, nbytes, t0):
        """A backup batch begun at `t0` that stored `pages` pages of `nbytes`."""
        self.counters["bytes_written"] += nbytes
        dt = _time.perf_counter() - t0
        self.counters["set_seconds"] += dt
        self._latency("set", dt)
        self._metrics.backup_pgs.append(pages)
        if dt > 0:
            self._metrics.backup_bandwidth.append(nbytes / dt / 1e9)

    def _latency(self, op, seconds):
        with self._lock:
            window = self._latencies[op]
            window.append(seconds)
            if len(window) > 1024:
                del window[:len(window) - 1024]

    def get_stats(self):
        """SGLang's StorageMetrics (pages and GB/s per prefetch and backup batch since the last
        call), with this backend's running totals as the attribute ``sparsekv``: hits, misses,
        bytes read and written, errors, seconds spent in gets, sets and lookups, reconnects, and
        the p50 and p99 latency of the last 1,024 calls of each kind (``get_p50_us``, ...)."""
        m, self._metrics = self._metrics, StorageMetrics()
        m.sparsekv = dict(self.counters)
        with self._lock:
            for op, window in self._latencies.items():
                if window:
                    ordered = sorted(window)
                    m.sparsekv[f"{op}_p50_us"] = ordered[len(ordered) // 2] * 1e6
                    m.sparsekv[f"{op}_p99_us"] = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e6
        return m
