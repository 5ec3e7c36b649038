"""sparsekv as SGLang's HiCache L3 storage backend (``--hicache-storage-backend dynamic``).

SGLang's hierarchical cache keeps KV pages on the GPU, then in a host memory pool, then in an
"L3" store behind the ``HiCacheStorage`` interface. ``SparseKVStorage`` is such a store, backed
by a running ``sparsekvd``. Start SGLang with::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "sparsekv",
        "module_path": "sparsekv.sglang", "class_name": "SparseKVStorage", "interface_v1": 1,
        "address": "unix:/path/to/sparsekvd.sock", "namespace": "default", "token": ""}'

The contract was read from SGLang's source (sgl-project/sglang, files at commit
001067fffe33427bee0ed2f007fb7551a1d76b44: ``mem_cache/hicache_storage.py``,
``mem_cache/storage/backend_factory.py``, ``managers/cache_controller.py``; the host pools of
``mem_cache/pool_host/`` at the commits named in the README). Facts used here:

* The dynamic factory imports ``module_path``, takes ``class_name``, requires a subclass of
  SGLang's ``HiCacheStorage`` and constructs it as ``cls(storage_config, kwargs)``, ``kwargs``
  being a dict (empty); the host pool comes afterwards through ``register_mem_pool_host`` and,
  for hybrid models (DeepSeek V3.2's indexer, V4's compressed pools), each side pool through
  ``register_mem_host_pool_v2``.
* Keys are 64-hex page hashes chained over the prefix, without any rank: the backend adds its
  own. MLA models (DeepSeek) write from TP rank 0 only and every TP rank reads the same pages.
* ``host_indices`` holds ``page_size`` token slots per page; a page's bytes are where the pool's
  ``get_page_buffer_meta(host_indices)`` says: one (pointer, size) per page for the
  ``page_first`` layouts, one per layer per page for ``layer_first`` (MHA: K and V each).
* ``batch_exists`` answers the length of the leading run present; ``batch_get_v1`` and
  ``batch_set_v1`` one bool per page; ``batch_exists_v2`` a ``PoolTransferResult`` whose KV hit
  honours every pool's hit policy (``all_pages``: every page of the prefix; ``trailing_pages``:
  only the last N); ``batch_get_v2``/``batch_set_v2`` ``{pool name: [bool per page]}``.
* The controller's threads never survive an exception out of the backend: every failure here
  becomes a miss, ``0`` or ``False``, and the next call reconnects.

How pages are filed in sparsekv: one value per (pool, page, piece), its 16-byte key the
BLAKE2b-128 of ``sglang|<model>|<ranks>|<pool>|<page hash>|<pieces>x<bytes>|<piece>``, where
``<ranks>`` is ``mla`` for rank-replicated models (all TP ranks share one copy) or
``tp<rank>of<size>``, then ``pp<rank>of<size>`` and ``cp<rank>of<size>`` when those are above
1. The piece count and size are part of the key, so a worker with another layout or geometry
misses instead of reading bytes laid out otherwise. Values move between the host pool and the
daemon with no Python-level copy: ``Client.get_into`` straight into the pool's pages (over the
Unix socket out of the daemon's shared memory, one memcpy), and ``Client.put`` from them.
"""

import collections as _collections
import ctypes as _ctypes
import hashlib as _hashlib
import threading as _threading
import time as _time
from dataclasses import dataclass as _dataclass, field as _field
from enum import Enum as _Enum
from typing import Any, List, Optional

from . import Client, Error

try:  # SGLang's own types when it is installed: the factory accepts only its subclasses.
    from sglang.srt.mem_cache.hicache_storage import (  # type: ignore
        HiCacheStorage,
        HiCacheStorageConfig,
        HiCacheStorageExtraInfo,
        PoolHitPolicy,
        PoolName,
        PoolTransfer,
        PoolTransferResult,
    )

    SGLANG = True
except ImportError:  # A stand-in with the same names, fields and values (see the docstring).
    SGLANG = False
    from abc import ABC as _ABC

    class PoolName(str, _Enum):
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

    class PoolHitPolicy(str, _Enum):
        ALL_PAGES = "all_pages"
        TRAILING_PAGES = "trailing_pages"

    @_dataclass
    class HiCacheStorageConfig:
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
    class HiCacheStorageExtraInfo:
        prefix_keys: Optional[List[str]] = None
        extra_info: Optional[dict] = None

    @_dataclass
    class PoolTransfer:
        name: Any
        host_indices: Any = None
        device_indices: Any = None
        keys: Optional[List[str]] = None
        hit_policy: Any = PoolHitPolicy.ALL_PAGES
        nodes_to_load: Optional[List[Any]] = None
        indices_from_pool: Any = None

    @_dataclass
    class PoolTransferResult:
        kv_hit_pages: int = 0
        extra_pool_hit_pages: dict = _field(default_factory=dict)

    class HiCacheStorage(_ABC):
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

try:
    from sglang.srt.observability.metrics_collector import StorageMetrics  # type: ignore
except ImportError:

    class StorageMetrics:  # SGLang's four lists, as get_stats hands them to its collector
        def __init__(self):
            self.prefetch_pgs = []
            self.backup_pgs = []
            self.prefetch_bandwidth = []
            self.backup_bandwidth = []


__all__ = ["SparseKVStorage", "SGLANG", "PoolName", "PoolHitPolicy", "PoolTransfer", "PoolTransferResult",
           "HiCacheStorageConfig", "HiCacheStorageExtraInfo", "StorageMetrics"]

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
# Keys of the extra config that belong to SGLang, not to this backend.
_SGLANG_KEYS = {"backend_name", "module_path", "class_name", "interface_v1", "prefetch_threshold",
                "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "prefetch_timeout_max",
                "hicache_storage_pass_prefix_keys", "tp_lcm_size"}


def _options(extra):
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise ValueError(f"sparsekv HiCache backend: the extra config must be a JSON object, not {type(extra).__name__}")
    out = {}
    for name, (ok, what, default) in _OPTIONS.items():
        v = extra.get(name, default)
        if not ok(v):
            raise ValueError(f"sparsekv HiCache backend: extra config '{name}' must be {what}; got {v!r}")
        out[name] = v
    unknown = sorted(k for k in extra if k not in _OPTIONS and k not in _SGLANG_KEYS)
    if unknown:
        raise ValueError(f"sparsekv HiCache backend: unknown extra config key(s) {unknown}; "
                         f"known: {sorted(_OPTIONS)}")
    if out["transport"] == "shm" and not out["address"].startswith("unix:"):
        raise ValueError("sparsekv HiCache backend: extra config 'transport' 'shm' needs a 'unix:' address")
    return out


def _name(pool):
    return pool.value if isinstance(pool, _Enum) else str(pool)


class SparseKVStorage(HiCacheStorage):
    """SGLang HiCache L3 storage in sparsekvd. Construct as SGLang's dynamic factory does:
    ``SparseKVStorage(storage_config, kwargs)``; options come from
    ``storage_config.extra_config`` (address, namespace, token, transport, timeout,
    reconnect_interval, key_tag, hint_ttl); a bad one raises ValueError naming it."""

    def __init__(self, storage_config=None, kwargs=None):
        if storage_config is None:
            storage_config = HiCacheStorageConfig()
        self.storage_config = storage_config
        self.options = _options(getattr(storage_config, "extra_config", None))
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
        name = _name(name)
        if name == "kv":
            return self.registered_pools.get(PoolName.KV) or self.registered_pools.get("kv") or self.mem_pool_host
        for k, p in self.registered_pools.items():
            if _name(k) == name:
                return p
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
        hits = sum(out)
        self.counters["hits"] += hits
        self.counters["misses"] += n - hits
        self.counters["bytes_read"] += nbytes
        dt = _time.perf_counter() - t0
        self.counters["get_seconds"] += dt
        self._latency("get", dt)
        self._metrics.prefetch_pgs.append(hits)
        if dt > 0:
            self._metrics.prefetch_bandwidth.append(nbytes / dt / 1e9)
        return out

    def _write(self, pool_name, pool, keys, host_indices):
        """Stores pages from the pool; one bool per page (never raises)."""
        n = len(keys)
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
        self.counters["bytes_written"] += nbytes
        dt = _time.perf_counter() - t0
        self.counters["set_seconds"] += dt
        self._latency("set", dt)
        self._metrics.backup_pgs.append(sum(out))
        if dt > 0:
            self._metrics.backup_bandwidth.append(nbytes / dt / 1e9)
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
        """Per page of `hashes`, whether every piece of it is held (None: cannot tell; True for
        every page of a pool that keeps no bytes). With `keys_out` (a list), each page's piece
        keys are appended to it, one list per page."""
        if not hashes:
            return []
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
            present = self._pages_present("kv", self.mem_pool_host, list(keys), page_keys)
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
            kv = self._pages_present("kv", self.mem_pool_host, keys, kv_keys)
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
                if _name(t.hit_policy) == "trailing_pages":
                    # The longest prefix whose last N pages this pool holds (N = the pages the
                    # transfer names, at least 1).
                    window = max(1, len(t.keys) if t.keys else 1)
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
                first = max(0, hit - extra[name]) if _name(t.hit_policy) == "trailing_pages" else 0
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
            keys = list(t.keys or [])
            try:
                pool = self._pool(name)
                if pool is None:
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

    # ---- the generic path: flat page tensors (used without "interface_v1") ----

    def _flat_key(self, key, nbytes):
        return self._key("kv", key, 1, nbytes, "flat")

    def get(self, key, target_location=None, target_sizes=None):
        got = self.batch_get([key], [target_location] if target_location is not None else None)
        return got[0] if isinstance(got, list) and got else None

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        keys = list(keys)
        if target_locations is None:
            pool = self.mem_pool_host
            if pool is None or not hasattr(pool, "get_dummy_flat_data_page"):
                return [None] * len(keys)
            target_locations = [pool.get_dummy_flat_data_page() for _ in keys]
        c = self._get_client()
        if c is None:
            return [None] * len(keys)
        nbytes = [t.element_size() * t.numel() for t in target_locations]
        try:
            got = c.get_into([self._flat_key(k, b) for k, b in zip(keys, nbytes)], list(target_locations))
        except Error:
            self._failed(c)
            return [None] * len(keys)
        out = [t if g == b else None for t, g, b in zip(target_locations, got, nbytes)]
        hits = sum(o is not None for o in out)
        self.counters["hits"] += hits
        self.counters["misses"] += len(keys) - hits
        return out

    def set(self, key, value=None, target_location=None, target_sizes=None):
        return self.batch_set([key], [value])

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
        keys = list(keys)
        if values is None or len(values) != len(keys):
            return False
        c = self._get_client()
        if c is None:
            return False
        arrays = [v.contiguous().view(-1).numpy().view("u1") if hasattr(v, "numpy") else v for v in values]
        ks = [self._flat_key(k, memoryview(a).nbytes) for k, a in zip(keys, arrays)]
        try:
            errs = c.put(ks, arrays)
        except Error:
            self._failed(c)
            return False
        with self._lock:
            self._written.update(k for k, e in zip(ks, errs) if e is None)
        return all(e is None for e in errs)

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
