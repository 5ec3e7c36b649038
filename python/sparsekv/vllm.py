"""sparsekv as a vLLM KV connector: DeepSeek V3.2 and V4 KV blocks kept in a shared ``sparsekvd``.

An unmodified vLLM loads it through ``kv_connector_module_path``::

    vllm serve deepseek-ai/DeepSeek-V3.2-Exp --kv-transfer-config '{"kv_connector": "SparseKVConnector",
        "kv_connector_module_path": "sparsekv.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"address": "unix:/run/sparsekvd.sock"}}'

The contract was read from vLLM's source (vllm-project/vllm), file by file at these commits (the
store keeps each file at the commit named):

* ``distributed/kv_transfer/kv_connector/v1/base.py`` at 003df2961dd8830c317a61f9745ccd557da9fa06
  (``VLLM_COMMIT``): ``KVConnectorBase_V1(vllm_config, role, kv_cache_config)``, ``KVConnectorRole``
  (SCHEDULER, WORKER), ``KVConnectorMetadata``, ``SupportsHMA.request_finished_all_groups(request,
  block_ids: tuple[list[int], ...]) -> (bool, dict | None)``. Scheduler side:
  ``get_num_new_matched_tokens(request, num_computed_tokens) -> (int | None, bool)`` ("may be
  called several times, side-effect free"; None = ask again later), ``update_state_after_alloc(
  request, blocks, num_external_tokens)``, ``build_connector_meta(scheduler_output)``,
  ``request_finished``. Worker side: ``register_kv_caches(dict[layer name, tensor])``, then per
  step ``bind_connector_metadata``, ``start_load_kv(forward_context)``, ``wait_for_layer_load`` /
  ``save_kv_layer`` inside the layers, ``wait_for_save``, ``get_finished(finished_req_ids)``,
  ``get_block_ids_with_load_errors() -> set[int]`` (sync loads: reported in the pass that found
  them; vLLM recomputes from the first failed block), ``clear_connector_metadata``.
* ``distributed/kv_transfer/kv_connector/factory.py`` at a4cd9d0d28bdb41db8dfe0acdafac2bf2f608630:
  an unregistered ``kv_connector`` name is looked up as a class of ``kv_connector_module_path``;
  with the hybrid KV cache manager on (the default, and needed for V4) the class must subclass
  ``SupportsHMA`` or vLLM refuses to start; a class whose ``__init__`` takes ``kv_cache_config`` is
  constructed as ``cls(vllm_config, role, kv_cache_config)``.
* The scheduler (``v1/core/sched/scheduler.py``, read as excerpts) calls
  ``get_num_new_matched_tokens`` for a waiting request, allocates, then
  ``update_state_after_alloc(request, kv_cache_manager.get_blocks(request_id), n)``: every group's
  block ids from block 0, null blocks (id 0) where a sliding window skipped them.
* ``v1/core/kv_cache_utils.py`` ``resolve_kv_cache_block_sizes(kv_cache_config, vllm_config) ->
  (scheduler_block_size, hash_block_size)``: one group: the block size; several: the LCM and the
  GCD of the groups' block sizes. ``Request.block_hashes`` are chained hashes at
  ``hash_block_size`` granularity, so the hash of a group's block is the hash of its last
  ``hash_block_size`` piece.
* ``v1/attention/backends/mla/sparse_swa.py`` at 03dc564956172b5b2835be7a84ddde5de1d5dba6 and the
  V4 compressor: V4's sliding window is a ``SlidingWindowMLASpec`` of 64-token blocks of 584 B per
  token, window 128; the compressed C4/C128 KV and the C4 indexer keys are ``MLAAttentionSpec``
  with ``compress_ratio`` 4/128 over 256-token blocks; the compressor states are
  ``SlidingWindowMLASpec`` of 4-token (C4, window 8) and 8-token (C128, window 128) blocks of fp32.
* ``offloading/scheduler.py`` at 0072b0b7443bdddf17824c78d4feae8e1fc12fb4 (the OffloadingConnector's
  scheduler, read to choose the hook; see docs/guides/vllm.md for why this connector does not
  ride on it).

How blocks are filed: one value per (block, group), as vLLM's own offload keys are (its block
hash and the group index): the block's page of every layer of the group on this pipeline stage,
in the group's layer order (K then V for caches laid out ``[2, num_blocks, ...]``), each exactly
as vLLM keeps it. Its 16-byte key is the first 16 bytes of vLLM's block hash XOR a mask, the
BLAKE2b-128 of ``vllm|<key_tag>|<model>|<ranks>|g<group>|<layer>=<spec>;...``: every layer of the
group with every field of its KV cache spec (kind, block size, head size, dtype, cache dtype,
compress ratio, window), ``<ranks>`` ``mla-tp<size>`` for caches every TP rank holds alike (MLA
and V4's MLA-shaped groups: one copy, stored by TP rank 0, read by every rank) or
``tp<rank>of<size>``, then ``pp``/``dcp`` when above 1. So instances of another model, TP size,
layout or cache dtype never read each other's bytes, and V3.2's indexer pages always go with
their MLA pages (they are one value). Values move between the KV cache tensors and the daemon
with one copy each way for CPU tensors: a load reads each value in place from the daemon's
memory (shared memory over a ``unix:`` address) and copies its pieces into the layers' blocks
(``Client.get_into_pieces``); a store gathers the pieces (``Client.put_pieces``, through a write
lease where the daemon grants them). CUDA tensors go through one host copy per value (the daemon
cannot read device memory).

A hit is the longest prefix, in scheduler blocks (the LCM of the groups' block sizes), for which
every group has what resuming needs: full-history groups every block of the prefix,
sliding-window and state groups the blocks of the last window before it (``ceil((window - 1) /
block_size)`` blocks, as vLLM's sliding-window manager counts). The scheduler's lookup is one
daemon call per request over one key per (group, block), cached per request.

Nothing here raises in vLLM's threads once constructed: a daemon that is down gives misses
(``(0, False)``), failed loads (their block ids through ``get_block_ids_with_load_errors``, which
vLLM recomputes) and skipped stores; the next call after ``reconnect_interval`` reconnects.
"""

import ctypes as _ctypes
import dataclasses as _dataclasses
import hashlib as _hashlib
import inspect as _inspect
import logging as _logging
import math as _math
import threading as _threading

import numpy as _np

from . import Error
from ._plugin import CONNECTION_OPTIONS, ReconnectingClient, check_options

_log = _logging.getLogger(__name__)

# The commit of vLLM's connector base this plug-in implements (other files: the docstring).
VLLM_COMMIT = "003df2961dd8830c317a61f9745ccd557da9fa06"

_WHO = "sparsekv vLLM connector"

# ---- vLLM's names, checked against what was read at VLLM_COMMIT ----

# method -> positional parameters (after self) it must take, in order.
_BASE_METHODS = {
    "__init__": ("vllm_config", "role", "kv_cache_config"),
    "get_num_new_matched_tokens": ("request", "num_computed_tokens"),
    "update_state_after_alloc": ("request", "blocks", "num_external_tokens"),
    "build_connector_meta": ("scheduler_output",),
    "request_finished": ("request", "block_ids"),
    "register_kv_caches": ("kv_caches",),
    "bind_connector_metadata": ("connector_metadata",),
    "clear_connector_metadata": (),
    "has_connector_metadata": (),
    "start_load_kv": ("forward_context",),
    "wait_for_layer_load": ("layer_name",),
    "save_kv_layer": ("layer_name", "kv_layer", "attn_metadata"),
    "wait_for_save": (),
    "get_finished": ("finished_req_ids",),
    "get_block_ids_with_load_errors": (),
    "shutdown": (),
}


def _positional(fn):
    try:
        sig = _inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    kinds = (_inspect.Parameter.POSITIONAL_ONLY, _inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in sig.parameters.values() if p.kind in kinds]
    return tuple(names[1:]) if names and names[0] == "self" else tuple(names)


def _check_vllm():
    """vLLM's classes this connector subclasses and the names it reads, or ImportError naming
    VLLM_COMMIT and every difference found."""
    where = f"sparsekv.vllm implements vLLM's KV connector interface as of vLLM commit {VLLM_COMMIT}"
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1 import base
        from vllm.v1 import kv_cache_interface
    except ImportError as e:
        raise ImportError(f"{where}, and needs vLLM installed: {e}") from e
    problems = []
    for name in ("KVConnectorBase_V1", "KVConnectorRole", "KVConnectorMetadata", "SupportsHMA"):
        if not hasattr(base, name):
            problems.append(f"{base.__name__} has no {name}")
    if not problems:
        for method, params in _BASE_METHODS.items():
            fn = getattr(base.KVConnectorBase_V1, method, None)
            got = _positional(fn) if fn is not None else None
            if got is None:
                problems.append(f"KVConnectorBase_V1 has no {method}")
            elif got[:len(params)] != params:
                problems.append(f"KVConnectorBase_V1.{method} takes ({', '.join(got)}), not ({', '.join(params)})")
        fn = getattr(base.SupportsHMA, "request_finished_all_groups", None)
        if fn is None or _positional(fn)[:2] != ("request", "block_ids"):
            problems.append("SupportsHMA.request_finished_all_groups(request, block_ids) is missing or differs")
        roles = getattr(base.KVConnectorRole, "__members__", {})
        if "SCHEDULER" not in roles or "WORKER" not in roles:
            problems.append("KVConnectorRole lacks SCHEDULER or WORKER")
    for name in ("SlidingWindowSpec", "KVCacheConfig", "KVCacheGroupSpec"):
        if not hasattr(kv_cache_interface, name):
            problems.append(f"{kv_cache_interface.__name__} has no {name}")
    if problems:
        raise ImportError(f"{where}; this vLLM differs: " + "; ".join(problems))
    return base, kv_cache_interface


_base, _kvi = _check_vllm()
KVConnectorBase_V1 = _base.KVConnectorBase_V1
KVConnectorMetadata = _base.KVConnectorMetadata
KVConnectorRole = _base.KVConnectorRole
SupportsHMA = _base.SupportsHMA

try:  # how vLLM sizes blocks for the scheduler and the request's hashes (None: computed here alike)
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes as _resolve_block_sizes
except ImportError:
    _resolve_block_sizes = None

__all__ = ["SparseKVConnector", "SparseKVConnectorMetadata", "VLLM_COMMIT"]

_OPTIONS = dict(CONNECTION_OPTIONS)
_OPTIONS.update({
    # The model's name in the keys (default: vLLM's model_config.model). Two deployments of the
    # same weights under different paths set the same name here to share blocks.
    "model": (lambda v: v is None or (isinstance(v, str) and 0 < len(v) <= 512),
              "null or a model name (1 to 512 bytes)", None),
    # Whether blocks computed here are stored (a read-only instance says false).
    "store": (lambda v: isinstance(v, bool), "true or false", True),
})


# ---- metadata handed from the scheduler to the workers (pickled by vLLM) ----

@_dataclasses.dataclass
class _Transfer:
    req_id: str
    group: int
    block_ids: list  # vLLM block ids of `group`, one per block
    hashes: bytes  # 16 bytes per block: the first 16 of its vLLM block hash


class SparseKVConnectorMetadata(KVConnectorMetadata):
    """What the workers move in one step: blocks to load before the forward pass and blocks to
    store after it."""

    def __init__(self, loads=None, saves=None):
        self.loads = list(loads or [])
        self.saves = list(saves or [])


# ---- the cache's geometry, as both roles see it ----

def _spec_text(spec):
    if _dataclasses.is_dataclass(spec):
        fields = sorted((f.name, str(getattr(spec, f.name, None))) for f in _dataclasses.fields(spec))
    else:
        fields = sorted((k, str(v)) for k, v in vars(spec).items())
    return type(spec).__name__ + "(" + ",".join(f"{k}={v}" for k, v in fields) + ")"


class _Group:
    def __init__(self, index, spec, layers, scheduler_block):
        self.index = index
        self.block_size = int(spec.block_size)
        self.layers = layers  # [(layer name, its spec)]
        window = getattr(spec, "sliding_window", None) if isinstance(spec, _kvi.SlidingWindowSpec) else None
        if window is None and layers and all(isinstance(s, _kvi.SlidingWindowSpec) for _, s in layers):
            window = layers[0][1].sliding_window
        self.window = int(window) if window else None
        # Blocks before a boundary that resuming there needs (None: every block of the prefix).
        self.window_blocks = -(-(self.window - 1) // self.block_size) if self.window else None
        if scheduler_block % self.block_size:
            raise ValueError(f"{_WHO}: group {index}'s block size {self.block_size} does not divide the scheduler "
                             f"block size {scheduler_block}")
        self.per_chunk = scheduler_block // self.block_size  # blocks per scheduler block

    def window_kept(self, j):
        """Whether block j of this group is ever needed for a hit (sliding groups keep only the
        blocks of the window before each scheduler-block boundary)."""
        if self.window_blocks is None or self.window_blocks >= self.per_chunk:
            return _np.ones(len(j), dtype=bool)
        return (j % self.per_chunk) >= self.per_chunk - self.window_blocks


def _layer_specs(group_spec, layer_names):
    specs = getattr(group_spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
    if isinstance(specs, dict):
        return [(n, specs.get(n, group_spec)) for n in layer_names]
    return [(n, group_spec) for n in layer_names]


def _tp_rank(vllm_config):
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - no distributed state (the scheduler): the configured rank
        pc = vllm_config.parallel_config
        return int(getattr(pc, "rank", 0)) % max(1, int(getattr(pc, "tensor_parallel_size", 1)))


class _Layout:
    """Groups, block sizes and key masks, from vLLM's config; the same in both roles."""

    def __init__(self, vllm_config, kv_cache_config, options, role_is_worker):
        groups = list(kv_cache_config.kv_cache_groups)
        if not groups:
            raise ValueError(f"{_WHO}: the KV cache config has no groups")
        for i, g in enumerate(groups):
            kind = type(g.kv_cache_spec).__name__
            if "Mamba" in kind:
                raise ValueError(f"{_WHO}: group {i} holds {kind} layers, which this connector does not store")
        sizes = [int(g.kv_cache_spec.block_size) for g in groups]
        if _resolve_block_sizes is not None:
            scheduler_block, hash_block = _resolve_block_sizes(kv_cache_config, vllm_config)
        elif len(groups) == 1:
            scheduler_block = hash_block = sizes[0]
        else:
            scheduler_block, hash_block = _math.lcm(*sizes), _math.gcd(*sizes)
        self.scheduler_block = int(scheduler_block)
        self.hash_block = int(hash_block)
        self.groups = [_Group(i, g.kv_cache_spec, _layer_specs(g.kv_cache_spec, list(g.layer_names)),
                              self.scheduler_block) for i, g in enumerate(groups)]
        for g in self.groups:
            if g.block_size % self.hash_block:
                raise ValueError(f"{_WHO}: group {g.index}'s block size {g.block_size} is not a multiple of the "
                                 f"hash block size {self.hash_block}")
        self.num_blocks = int(getattr(kv_cache_config, "num_blocks", 0))
        pc = vllm_config.parallel_config
        tp = int(getattr(pc, "tensor_parallel_size", 1) or 1)
        pp = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
        dcp = int(getattr(pc, "decode_context_parallel_size", 1) or 1)
        self.tp_size = tp
        self.tp_rank = _tp_rank(vllm_config) if role_is_worker else 0
        all_mla = all("MLA" in type(s).__name__ for g in self.groups for _, s in g.layers)
        # MLA caches are the same on every TP rank (the latent is not split over heads): one copy.
        self.replicated = all_mla and dcp == 1
        ranks = [f"mla-tp{tp}" if self.replicated else f"tp{self.tp_rank}of{tp}"]
        if pp > 1:
            ranks.append(f"pp{int(getattr(pc, 'rank', 0)) // tp % pp}of{pp}")
        if dcp > 1:
            ranks.append(f"dcp{self.tp_rank % dcp}of{dcp}")
        model = options.get("model") or getattr(getattr(vllm_config, "model_config", None), "model", None) or ""
        self.scope = "|".join(["vllm", options.get("key_tag", ""), str(model), ".".join(ranks)])
        self._masks = {}
        self.stores = (not self.replicated) or self.tp_rank == 0

    def mask(self, group):
        """The 16-byte mask of `group`'s keys: it names the scope and every layer of the group
        with its spec, so another model, layout, parallel layout or cache dtype never shares one."""
        m = self._masks.get(group.index)
        if m is None:
            layers = ";".join(f"{name}={_spec_text(spec)}" for name, spec in group.layers)
            text = f"{self.scope}|g{group.index}|{layers}"
            m = _np.frombuffer(_hashlib.blake2b(text.encode(), digest_size=16).digest(), dtype=_np.uint8)
            self._masks[group.index] = m
        return m


def _hash16(h):
    h = bytes(h) if not isinstance(h, bytes) else h
    return h[:16] if len(h) >= 16 else _hashlib.blake2b(h, digest_size=16).digest()


def _hash_rows(hashes):
    """vLLM block hashes (bytes) as uint8 [n, 16]: their first 16 bytes (a BLAKE2b-128 of shorter
    ones). vLLM's hashes of one run all have one length, so they are cut out of one join."""
    n = len(hashes)
    if n == 0:
        return _np.zeros((0, 16), dtype=_np.uint8)
    width = len(hashes[0])
    joined = b"".join(hashes)
    if width >= 16 and len(joined) == n * width:
        return _np.frombuffer(joined, dtype=_np.uint8).reshape(n, width)[:, :16]
    return _np.frombuffer(b"".join(_hash16(h) for h in hashes), dtype=_np.uint8).reshape(n, 16)


def _keys(hashes16, mask):
    """Keys (uint8 [n, 16], C-contiguous) of blocks whose 16-byte hashes are rows of `hashes16`."""
    return _np.ascontiguousarray(_np.bitwise_xor(hashes16, mask))


class _RequestState:
    __slots__ = ("request", "block_ids", "saved_upto", "hashes", "hashes_n")

    def __init__(self, request, n_groups):
        self.request = request
        self.block_ids = [[] for _ in range(n_groups)]
        self.saved_upto = None  # per group: blocks before this index are stored or were never ours
        self.hashes = None
        self.hashes_n = 0


class _LayerMemory:
    """One layer's KV cache tensor as per-block byte ranges: one or two pieces (K and V)."""

    def __init__(self, name, tensor, num_blocks):
        self.name = name
        self.tensor = tensor
        shape = tuple(tensor.shape)
        item = tensor.element_size()
        if len(shape) >= 2 and shape[0] == num_blocks:
            bases = [tensor.data_ptr()]
            stride = tensor.stride(0) * item
            inner = shape[1:]
            block0 = tensor[0]
        elif len(shape) >= 3 and shape[0] == 2 and shape[1] == num_blocks:
            bases = [tensor.data_ptr() + k * tensor.stride(0) * item for k in range(2)]
            stride = tensor.stride(1) * item
            inner = shape[2:]
            block0 = tensor[0][0]
        else:
            raise ValueError(f"{_WHO}: layer '{name}' has a KV cache of shape {list(shape)}; expected "
                             f"[num_blocks={num_blocks}, ...] or [2, num_blocks, ...]")
        if not block0.is_contiguous():
            raise ValueError(f"{_WHO}: layer '{name}': one block's bytes are not contiguous (shape {list(shape)}, "
                             f"strides {list(tensor.stride())})")
        self.page_bytes = int(_np.prod(inner)) * item
        self.stride = stride
        self.bases = bases
        self.pieces = len(bases)
        self.on_cpu = tensor.device.type == "cpu"
        self.views = []
        if self.on_cpu:
            span = (num_blocks - 1) * stride + self.page_bytes
            for b in bases:
                raw = (_ctypes.c_ubyte * span).from_address(b)
                self.views.append(memoryview(raw).cast("B"))

    def block(self, piece, block_id):
        off = block_id * self.stride
        return self.views[piece][off:off + self.page_bytes]


class SparseKVConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector over sparsekvd (see the module docstring). vLLM constructs it as
    ``SparseKVConnector(vllm_config, role, kv_cache_config)``; options come from
    ``kv_transfer_config.kv_connector_extra_config``: address, namespace, token, transport,
    timeout, reconnect_interval, key_tag, model, store. A bad value raises ValueError naming its
    key."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        ktc = getattr(vllm_config, "kv_transfer_config", None)
        extra = getattr(ktc, "kv_connector_extra_config", None) if ktc is not None else None
        self.options = check_options(extra, _OPTIONS, _WHO, "kv_connector_extra_config")
        super().__init__(vllm_config, role, kv_cache_config)
        if kv_cache_config is None:
            raise ValueError(f"{_WHO}: needs the kv_cache_config vLLM passes as the third argument")
        self.is_worker = role == KVConnectorRole.WORKER
        self.layout = _Layout(vllm_config, kv_cache_config, self.options, self.is_worker)
        self.conn = ReconnectingClient(self.options, "vllm-" + ("worker" if self.is_worker else "scheduler"))
        self.counters = {"lookups": 0, "lookup_errors": 0, "hit_tokens": 0, "blocks_loaded": 0, "load_failures": 0,
                         "blocks_stored": 0, "store_failures": 0, "bytes_loaded": 0, "bytes_stored": 0}
        self._lock = _threading.Lock()
        # scheduler
        self._requests = {}  # req id -> _RequestState
        self._lookups = {}  # req id -> (hashes seen, tokens, hit tokens)
        self._pending_loads = []
        # worker
        self._layers = {}  # layer name -> _LayerMemory
        self._load_errors = set()
        self.conn.client()  # connect now if the daemon is up; otherwise at the first call

    # ---------------- scheduler side ----------------

    def _hashes16(self, st, request):
        """The request's block hashes, 16 bytes each (uint8 [n, 16]), kept per request and
        extended as vLLM appends to them."""
        hashes = getattr(request, "block_hashes", None) or []
        n = len(hashes)
        publishable = getattr(request, "num_publishable_block_hashes", None)
        if isinstance(publishable, int):
            n = min(n, publishable)
        if st is not None and st.hashes is not None and st.hashes_n == n:
            return st.hashes
        if st is not None and st.hashes is not None and st.hashes_n < n:
            arr = _np.concatenate([st.hashes, _hash_rows(hashes[st.hashes_n:n])])
        else:
            arr = _hash_rows(hashes[:n])
        if st is not None:
            st.hashes, st.hashes_n = arr, n
        return arr

    def _group_hashes(self, hashes16, group, js):
        """Rows of the 16-byte hashes of group blocks `js`: the hash of each block's last piece."""
        f = group.block_size // self.layout.hash_block
        return hashes16[(js + 1) * f - 1]

    def _lookup(self, request):
        """Tokens of the longest prefix of `request` every group can resume from (a multiple of
        the scheduler block), by one daemon lookup; 0 when the daemon is down."""
        L = self.layout
        hashes16 = self._hashes16(None, request)
        limit = min(len(hashes16) * L.hash_block, int(request.num_tokens) - 1)
        chunks = max(0, limit // L.scheduler_block)
        if chunks == 0:
            return 0
        keys, spans = [], []  # spans: (group, its kept block indices, its first key)
        at = 0
        for g in L.groups:
            js = _np.arange(chunks * g.per_chunk)
            kept = js[g.window_kept(js)]
            keys.append(_keys(self._group_hashes(hashes16, g, kept), L.mask(g)))
            spans.append((g, kept, at))
            at += len(kept)
        c = self.conn.client()
        if c is None:
            return 0
        try:
            _, tiers = c.lookup_array(_np.concatenate(keys))
        except Exception as e:  # noqa: BLE001 - a down daemon is a miss, never an exception in vLLM
            self.counters["lookup_errors"] += 1
            self.conn.failed(c, e)
            return 0
        self.counters["lookups"] += 1
        present = _np.frombuffer(tiers, dtype=_np.uint8) != 0
        ok = _np.ones(chunks + 1, dtype=bool)  # ok[k]: a hit of k scheduler blocks is usable
        for g, kept, s0 in spans:
            p = _np.zeros(chunks * g.per_chunk, dtype=bool)
            p[kept] = present[s0:s0 + len(kept)]
            missing = _np.concatenate([[0], _np.cumsum(~p)])
            ends = _np.arange(chunks + 1) * g.per_chunk
            starts_k = _np.zeros_like(ends) if g.window_blocks is None else _np.maximum(ends - g.window_blocks, 0)
            ok &= (missing[ends] - missing[starts_k]) == 0
        good = _np.nonzero(ok[1:])[0]
        return int(good[-1] + 1) * L.scheduler_block if len(good) else 0

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        try:
            n = len(getattr(request, "block_hashes", None) or [])
            cached = self._lookups.get(request.request_id)
            if cached is not None and cached[0] == n and cached[1] == request.num_tokens:
                hit = cached[2]
            else:
                hit = self._lookup(request)
                self._lookups[request.request_id] = (n, request.num_tokens, hit)
            if hit <= num_computed_tokens:
                return 0, False
            return hit - num_computed_tokens, False
        except Exception as e:  # noqa: BLE001 - a miss rather than an exception in the scheduler
            _log.warning("%s: lookup for request %s failed (%s: %s); a miss", _WHO,
                         getattr(request, "request_id", "?"), type(e).__name__, e)
            return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        L = self.layout
        st = self._requests.get(request.request_id)
        if st is None:
            st = self._requests[request.request_id] = _RequestState(request, len(L.groups))
        st.block_ids = [list(ids) for ids in blocks.get_block_ids()]
        if num_external_tokens <= 0:
            return
        cached = self._lookups.get(request.request_id)
        hit = cached[2] if cached is not None else 0
        local = hit - int(num_external_tokens)
        if hit <= 0 or local < 0:
            return
        hashes16 = self._hashes16(st, request)
        for g in L.groups:
            first, end = local // g.block_size, hit // g.block_size
            if g.window_blocks is not None:
                first = max(first, end - g.window_blocks)
            js = _np.arange(first, end)
            ids = st.block_ids[g.index]
            take = _np.array([j < len(ids) and ids[j] != 0 for j in js], dtype=bool)
            js = js[take] if len(js) else js
            if len(js) == 0:
                continue
            self._pending_loads.append(_Transfer(request.request_id, g.index, [int(ids[j]) for j in js],
                                                 self._group_hashes(hashes16, g, js).tobytes()))
        # What was loaded (and found locally) is in the store already: stores start after it.
        st.saved_upto = [hit // g.block_size for g in L.groups]

    def _plan_saves(self, st, computed, scheduled, saves):
        L = self.layout
        if not self.options["store"]:
            return
        if st.saved_upto is None:
            st.saved_upto = [computed // g.block_size for g in L.groups]
        hashes16 = self._hashes16(st, st.request)
        upto = min(computed + scheduled, len(hashes16) * L.hash_block)
        for g in L.groups:
            j0, j1 = st.saved_upto[g.index], upto // g.block_size
            if j1 <= j0:
                continue
            st.saved_upto[g.index] = j1
            js = _np.arange(j0, j1)
            js = js[g.window_kept(js)]
            ids = st.block_ids[g.index]
            js = _np.array([j for j in js if j < len(ids) and ids[j] != 0], dtype=_np.int64)
            if len(js):
                saves.append(_Transfer(st.request.request_id, g.index, [int(ids[j]) for j in js],
                                       self._group_hashes(hashes16, g, js).tobytes()))

    def build_connector_meta(self, scheduler_output):
        meta = SparseKVConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", {}) or {}
        for new in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
            st = self._requests.get(new.req_id)
            if st is None:
                continue
            st.block_ids = [list(ids) for ids in new.block_ids]
            self._plan_saves(st, int(new.num_computed_tokens), int(scheduled.get(new.req_id, 0)), meta.saves)
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if cached is not None:
            resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
            from_preemption = getattr(cached, "resumed_from_preemption", None)
            for i, req_id in enumerate(cached.req_ids):
                st = self._requests.get(req_id)
                if st is None:
                    continue
                new_ids = cached.new_block_ids[i]
                if new_ids is not None:
                    if req_id in resumed or (from_preemption is not None and from_preemption[i]):
                        st.block_ids = [list(ids) for ids in new_ids]
                    else:
                        for g, ids in enumerate(new_ids):
                            st.block_ids[g].extend(ids)
                self._plan_saves(st, int(cached.num_computed_tokens[i]), int(scheduled.get(req_id, 0)), meta.saves)
        for req_id in getattr(scheduler_output, "finished_req_ids", ()) or ():
            self._forget(req_id)
        return meta

    def update_connector_output(self, connector_output):
        bad = getattr(connector_output, "invalid_block_ids", None)
        if not bad:
            return
        # vLLM recomputes blocks that failed to load; they are stored again once recomputed.
        for st in self._requests.values():
            if any(b in bad for ids in st.block_ids for b in ids):
                st.saved_upto = None

    def _forget(self, req_id):
        self._requests.pop(req_id, None)
        self._lookups.pop(req_id, None)

    def request_finished(self, request, block_ids):
        self._forget(request.request_id)
        return False, None  # stores are done within the step; vLLM frees the blocks now

    def request_finished_all_groups(self, request, block_ids):
        self._forget(request.request_id)
        return False, None

    # ---------------- worker side ----------------

    def register_kv_caches(self, kv_caches):
        L = self.layout
        for g in L.groups:
            for name, _ in g.layers:
                t = kv_caches.get(name)
                if t is not None:  # a layer of another pipeline stage is absent here
                    self._layers[name] = _LayerMemory(name, t, L.num_blocks)

    def _group_memory(self, group):
        """The registered layers of `group`, in the group's order: the pieces of its values."""
        return [self._layers[name] for name, _ in self.layout.groups[group].layers if name in self._layers]

    def _pieces(self, transfers):
        """Per value (one per block of each transfer): its key, and its pieces' addresses and
        sizes, every registered layer of the group in order (K then V for [2, num_blocks, ...]
        caches). Returns (keys uint8 [n, 16], ptrs, sizes, counts, where [(transfer, position)],
        on_cpu per value)."""
        L = self.layout
        keys, ptrs, sizes, counts, where, cpu = [], [], [], [], [], []
        for ti, t in enumerate(transfers):
            g = L.groups[t.group]
            mems = self._group_memory(t.group)
            if not mems:  # none of the group's layers is on this pipeline stage
                continue
            h = _np.frombuffer(t.hashes, dtype=_np.uint8).reshape(-1, 16)
            ids = _np.asarray(t.block_ids, dtype=_np.uint64)
            keys.append(_keys(h, L.mask(g)))
            base = _np.array([b for m in mems for b in m.bases], dtype=_np.uint64)
            stride = _np.array([m.stride for m in mems for _ in m.bases], dtype=_np.uint64)
            size = _np.array([m.page_bytes for m in mems for _ in m.bases], dtype=_np.uint64)
            ptrs.append((base[None, :] + ids[:, None] * stride[None, :]).reshape(-1))
            sizes.append(_np.tile(size, len(ids)))
            counts.append(_np.full(len(ids), len(base), dtype=_np.uint64))
            where.extend((ti, pos) for pos in range(len(ids)))
            on_cpu = all(m.on_cpu for m in mems)
            cpu.extend([on_cpu] * len(ids))
        if not keys:
            z = _np.zeros(0, dtype=_np.uint64)
            return _np.zeros((0, 16), dtype=_np.uint8), z, z, z, where, cpu
        return (_np.concatenate(keys), _np.concatenate(ptrs), _np.concatenate(sizes), _np.concatenate(counts),
                where, cpu)

    def start_load_kv(self, forward_context, **kwargs):
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        loads = getattr(meta, "loads", None)
        if not loads:
            return
        try:
            failed = self._load(loads)
        except Exception as e:  # noqa: BLE001 - failed loads are recomputed by vLLM, never raised
            _log.warning("%s: loading failed (%s: %s); vLLM recomputes the blocks", _WHO, type(e).__name__, e)
            failed = {(ti, pos) for ti, t in enumerate(loads) for pos in range(len(t.block_ids))}
        for ti, pos in failed:
            self._load_errors.add(loads[ti].block_ids[pos])
        self.counters["load_failures"] += len(failed)

    def _load(self, loads):
        keys, ptrs, sizes, counts, where, cpu = self._pieces(loads)
        c = self.conn.client()
        if c is None:
            return set(where)
        failed = set()
        starts = _np.concatenate([[0], _np.cumsum(counts)]).astype(_np.int64)
        totals = _np.add.reduceat(sizes, starts[:-1]) if len(sizes) else _np.zeros(0, dtype=_np.uint64)
        try:
            if all(cpu):  # the common case: every value straight into its pieces
                got = c.get_into_pieces(keys, ptrs, sizes, counts)
                for i, n in enumerate(got):
                    if n is None or n != int(totals[i]):
                        failed.add(where[i])
                    else:
                        self.counters["bytes_loaded"] += n
            else:
                for i in range(len(where)):
                    if not self._load_one(c, loads, where[i], keys[i], sizes[starts[i]:starts[i + 1]], cpu[i],
                                          ptrs[starts[i]:starts[i + 1]]):
                        failed.add(where[i])
        except Exception as e:  # noqa: BLE001
            self.conn.failed(c, e)
            return set(where)
        self.counters["blocks_loaded"] += len(set(where) - failed)
        return failed

    def _load_one(self, c, loads, w, key, sizes, on_cpu, ptrs):
        """One value into memory that is not all host memory: the daemon cannot write device
        memory, so the value comes to the host and each piece is copied to its layer."""
        if on_cpu:
            got = c.get_into_pieces(key.reshape(1, 16), ptrs, sizes, _np.array([len(sizes)], dtype=_np.uint64))
            ok = got[0] is not None and got[0] == int(sizes.sum())
            if ok:
                self.counters["bytes_loaded"] += got[0]
            return ok
        got = c.get([key.tobytes()])[0]
        if got is None or len(got) != int(sizes.sum()):
            return False
        ti, pos = w
        bid = loads[ti].block_ids[pos]
        off = 0
        for mem in self._group_memory(loads[ti].group):
            for piece in range(mem.pieces):
                self._device_block(mem, piece, bid).copy_(
                    _torch_from(got[off:off + mem.page_bytes], mem.page_bytes).to(mem.tensor.device))
                off += mem.page_bytes
        self.counters["bytes_loaded"] += len(got)
        return True

    @staticmethod
    def _device_block(mem, piece, block_id):
        t = mem.tensor
        b = t[block_id] if mem.pieces == 1 else t[piece][block_id]
        import torch
        return b.reshape(-1).view(torch.uint8) if b.element_size() == 1 else b.contiguous().view(-1).view(torch.uint8)

    def wait_for_layer_load(self, layer_name):
        return None  # loads finish within start_load_kv

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        return None  # blocks are stored once the whole step computed them (wait_for_save)

    def wait_for_save(self):
        if not self.has_connector_metadata():
            return
        saves = getattr(self._get_connector_metadata(), "saves", None)
        if not saves or not self.layout.stores or not self.options["store"]:
            return
        try:
            self._store(saves)
        except Exception as e:  # noqa: BLE001 - a failed store is a later miss, never an exception
            self.counters["store_failures"] += 1
            _log.warning("%s: storing failed (%s: %s)", _WHO, type(e).__name__, e)

    def _store(self, saves):
        keys, ptrs, sizes, counts, where, cpu = self._pieces(saves)
        n = len(where)
        c = self.conn.client()
        if c is None:
            self.counters["store_failures"] += n
            return
        starts = _np.concatenate([[0], _np.cumsum(counts)]).astype(_np.int64)
        totals = _np.add.reduceat(sizes, starts[:-1]) if len(sizes) else _np.zeros(0, dtype=_np.uint64)
        try:
            if all(cpu):  # gathered from the layers' blocks straight into the store
                errors = c.put_pieces(keys, ptrs, sizes, counts)
            else:  # one device-to-host copy per value: the daemon reads host memory only
                values = [self._host_value(saves, where[i]) for i in range(n)]
                errors = c.put([k.tobytes() for k in keys], values)
        except Exception as e:  # noqa: BLE001
            self.counters["store_failures"] += n
            self.conn.failed(c, e)
            return
        bad = sum(1 for e in errors if e is not None)
        self.counters["store_failures"] += bad
        self.counters["blocks_stored"] += n - bad
        self.counters["bytes_stored"] += int(sum(int(totals[i]) for i, e in enumerate(errors) if e is None))

    def _host_value(self, saves, w):
        import torch
        ti, pos = w
        bid = saves[ti].block_ids[pos]
        parts = []
        for mem in self._group_memory(saves[ti].group):
            for piece in range(mem.pieces):
                b = self._device_block(mem, piece, bid) if not mem.on_cpu else \
                    torch.frombuffer(mem.block(piece, bid), dtype=torch.uint8)
                parts.append(b.reshape(-1).cpu())
        return torch.cat(parts).numpy()

    def get_finished(self, finished_req_ids):
        return None, None  # loads and stores complete within the step

    def get_block_ids_with_load_errors(self):
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self):
        self.conn.close()

    # ---------------- for tests and tools ----------------

    def block_keys(self, group, block_hashes):
        """The sparsekv keys (16 bytes each) under which this instance files blocks of `group`
        (index) whose vLLM block hashes are `block_hashes` (each the hash of the block's last
        hash-block piece): one value per (block, group), every layer of the group in it."""
        g = self.layout.groups[group]
        h = _np.frombuffer(b"".join(_hash16(x) for x in block_hashes), dtype=_np.uint8).reshape(-1, 16)
        k = _keys(h, self.layout.mask(g)).tobytes()
        return [k[i:i + 16] for i in range(0, len(k), 16)]


def _torch_from(buf, n):
    import torch
    return torch.frombuffer(bytearray(buf[:n]), dtype=torch.uint8)


__all__ += ["Error"]
