"""sparsekv from Python: a client of the sparsekvd daemon, and the cache manager with its page
pools lent to numpy (and through it to torch) in place.

    import sparsekv
    with sparsekv.Client("unix:./var/sparsekvd.sock") as c:
        c.put([key], [value])          # key: 16 bytes (a 128-bit block hash)
        [view] = c.get([key])          # a read-only memoryview, or None when absent

Errors raise the exception named after sparsekv's status code (``sparsekv.NotFound``,
``sparsekv.PermissionDenied``, ...), each a subclass of ``sparsekv.Error``, with the daemon's
message. Batch calls release the GIL: Python threads may share one client.
"""

import asyncio as _asyncio
import functools as _functools
import json as _json

from . import _sparsekv

__version__ = _sparsekv.__version__

__all__ = ["CacheManager", "Client", "Codec", "Error", "HintInfo", "KvEvent", "KvEventQueue", "ModelSpec", "OffloadedCache",
           "PoolRegion", "RequestLog", "__version__", "block_hashes", "model_preset", "model_presets", "model_spec_from_json",
           "plan_for_budget", "plan_for_sequences"]

import collections as _collections

# What Client.hint returns: the hint's id (for drop_hint), the keys some tier holds, how many of
# them are in host memory, and how many are being brought up into it.
HintInfo = _collections.namedtuple("HintInfo", ["hint", "found", "in_memory", "prefetching"])

ModelSpec = _sparsekv.ModelSpec
KvEvent = _sparsekv.KvEvent
PoolRegion = _sparsekv.PoolRegion


def _is_tensor(x):
    return type(x).__module__.startswith("torch")


def _as_numpy(x):
    """A numpy array over the same memory as `x` (a numpy array, a CPU torch tensor, a buffer);
    bf16 tensors come as their bits (uint16)."""
    import numpy as _np

    if _is_tensor(x):
        import torch as _torch

        if x.device.type != "cpu":
            raise InvalidArgument(f"a tensor on {x.device}: sparsekv's codecs and kernels run on the CPU")
        if x.dtype == _torch.bfloat16:
            return x.view(_torch.int16).numpy().view(_np.uint16)
        return x.numpy()
    if isinstance(x, _np.ndarray):
        return x
    if isinstance(x, (bytes, bytearray, memoryview)):
        return _np.frombuffer(x, dtype=_np.uint8)
    return _np.asarray(x)


class Codec:
    """A page codec for one layer's page of a pool: Codec(format, dims, entries), with the
    format as pool_info gives it ("bf16", "fp8_ds_mla", "c8_mla", "fp8_v4", "idx_fp8", ...).
    The SIMD path is chosen as the C++ library chooses it.

    A page is a contiguous uint8 numpy array or CPU torch tensor, such as
    ``pool_array(i)[page, l * layer_stride : l * layer_stride + page_bytes]`` (or the same slice
    of ``pool_tensor(i)``): written and read in place."""

    def __init__(self, format, dims, entries):
        self._c = _sparsekv._Codec(format, dims, entries)

    page_bytes = property(lambda self: self._c.page_bytes, doc="Bytes of one page of `entries` entries.")
    dims = property(lambda self: self._c.dims)
    entries = property(lambda self: self._c.entries)
    format = property(lambda self: self._c.format)

    def write(self, page, first_slot, rows):
        """Encodes rows [count, dims] into slots first_slot.. of the page, in place. Rows are
        float32, or bf16 (a torch.bfloat16 tensor, or uint16 holding the bits)."""
        import numpy as _np

        r = _as_numpy(rows)
        self._c.write(_as_numpy(page), first_slot, _np.ascontiguousarray(r))

    def read(self, page, first_slot, count, dtype="float32"):
        """Decodes slots first_slot.. into a new numpy array [count, dims]: float32, or bf16
        bits as uint16 for dtype "bfloat16"."""
        return self._c.read(_as_numpy(page), first_slot, count, dtype)

    def read_tensor(self, page, first_slot, count, dtype="float32"):
        """``read`` as a torch tensor: float32, or torch.bfloat16 for dtype "bfloat16"."""
        import numpy as _np
        import torch as _torch

        out = self.read(page, first_slot, count, dtype)
        if out.dtype == _np.uint16:
            return _torch.from_numpy(out.view(_np.int16)).view(_torch.bfloat16)
        return _torch.from_numpy(out)

    def __repr__(self):
        return f"sparsekv.Codec({self.format!r}, dims={self.dims}, entries={self.entries})"


def model_preset(name, precision="bf16"):
    """A built-in model spec ("deepseek-v3.2-exp", "deepseek-v4-flash", ...) with its kinds
    stored at `precision` ("bf16", "fp8", "c8")."""
    return _sparsekv.model_preset(name, precision)


def block_hashes(tokens, block_tokens, namespace_salt="", extra_keys="", mode="xxh3"):
    """The prefix-hash chain of a prompt's full blocks, each 16 bytes: the keys its blocks are
    stored under in sparsekvd (a trailing partial block has none). The same chain the cache
    manager computes for the same salt, extra keys and mode ("xxh3" or "sha256")."""
    return _sparsekv.block_hashes([int(t) for t in tokens], block_tokens, namespace_salt, extra_keys, mode)


def plan_for_sequences(spec, batch, seq_len, block_tokens=128):
    """The memory a batch of `batch` sequences of `seq_len` tokens keeps resident to decode, per
    kind (a dict: total_bytes and one row per kind; memory_planner.h)."""
    return _json.loads(_sparsekv._plan_for_sequences(spec, block_tokens, batch, seq_len))


def plan_for_budget(spec, budget_bytes, batch=1, block_tokens=128):
    """The longest seq_len (whole blocks) such that `batch` sequences fit `budget_bytes`, with
    its plan (a dict, as plan_for_sequences)."""
    return _json.loads(_sparsekv._plan_for_budget(spec, block_tokens, budget_bytes, batch))


def model_presets():
    """The names of the built-in model specs."""
    return _sparsekv.model_presets()


def model_spec_from_json(text):
    """A model spec from its JSON text (the shape of ModelSpec.to_json())."""
    return _sparsekv.model_spec_from_json(text)


class Error(Exception):
    """A sparsekv status that is not OK. Subclasses are named after the status codes."""

    code = "Unknown"


def _status_class(name, doc):
    cls = type(name, (Error,), {"__doc__": doc, "code": name, "__module__": __name__})
    globals()[name] = cls
    __all__.append(name)
    return cls


for _name, _doc in [
    ("InvalidArgument", "The caller's input is malformed or out of range."),
    ("NotFound", "The key or object does not exist."),
    ("AlreadyExists", "Creation of something that is there."),
    ("ResourceExhausted", "A pool, tier, budget or queue is full."),
    ("FailedPrecondition", "The object is in the wrong state for the call."),
    ("Corruption", "Stored bytes failed a check."),
    ("IOError", "The operating system said no."),
    ("PermissionDenied", "A client asked for what its namespace may not see."),
    ("Unavailable", "A peer or service is not reachable now."),
    ("Aborted", "The operation was cancelled."),
    ("NotSupported", "A valid request this build or configuration cannot serve."),
    ("OutOfRange", "An index past the end."),
    ("Internal", "A broken invariant: a bug in sparsekv."),
]:
    _status_class(_name, _doc)
del _name, _doc


class Client:
    """One connection to sparsekvd (api/PROTOCOL.md), over TCP or a Unix socket.

    ``address`` is ``"unix:/path/to/socket"`` or ``"host:port"``. Over a Unix socket with
    ``shared_memory`` (the default) values move through a shared staging area, and from a
    one-namespace daemon GETs are copied straight out of its memory.

    Keys are 16-byte bytes-like objects (block hashes). Values are any contiguous bytes-like
    objects (bytes, bytearray, memoryview, numpy arrays). Every method may be called from
    several threads at once; each releases the GIL while it waits for the daemon.

    Raises sparsekv.PermissionDenied for an unknown namespace or a wrong token, and
    sparsekv.Unavailable when the daemon cannot be reached.
    """

    def __init__(self, address, namespace="default", token="", *, client_name="sparsekv-python",
                 shared_memory=True, timeout=30.0):
        self._c = _sparsekv._Client(address, namespace, token, client_name, shared_memory, float(timeout))
        self.address = address
        self.namespace = namespace

    def put(self, keys, values):
        """Stores ``values[i]`` under ``keys[i]``.

        Returns one entry per key: None when stored, else the error (a sparsekv.Error
        instance, not raised) for that item. Raises for a failure of the whole call.
        """
        return self._c.put(keys, values)

    def get(self, keys):
        """Returns one entry per key: a read-only memoryview of the value (not copied again
        after it arrived; it stays valid on its own), or None when the key is absent (or was
        dropped by the daemon as damaged). Other per-item errors raise."""
        return self._c.get(keys)

    def get_into(self, keys, out):
        """Reads the values of ``keys`` straight into caller memory, with one copy and no
        allocation per value (over shared memory out of the daemon's arena; over a socket
        received in place).

        ``out`` is one destination per key (a list or tuple), or one destination cut into
        ``len(keys)`` equal slices. A destination is a writable C-contiguous buffer (bytearray,
        numpy array, memoryview), a contiguous CPU torch tensor, or a ``(pointer, length)`` pair
        of ints. Returns per key the value's size in bytes (written at the start of its
        destination), or None when the key is absent (or was dropped as damaged). A value larger
        than its destination raises sparsekv.OutOfRange (after the others were written).
        """
        return self._c.get_into(keys, out)

    def get_views(self, keys):
        """Zero-copy reads: per key a read-only memoryview of the value lent in place from the
        daemon's memory (Unix socket, shared memory, a one-namespace daemon; checked as the
        daemon read it), or a copy where it could not be lent; None for a miss. The daemon keeps
        the lent pages pinned, within its pin budget, until every memoryview of the call (and
        every array made from one) is released or garbage-collected: read them, then drop them.
        """
        return self._c.get_views(keys)

    def get_into_pieces(self, keys, ptrs, sizes, counts):
        """Reads values whose bytes belong in several places (one block of every layer of a
        model, each in its own tensor) with one copy each: key ``i``'s value is spread, in
        order, over its ``counts[i]`` pieces, the next ones of ``ptrs``/``sizes`` (integer
        arrays of addresses and lengths in memory the caller holds, as ``get_into``'s
        ``(pointer, length)`` pairs). ``keys`` is a uint8 ``[n, 16]`` array (or bytes of n keys,
        or a sequence of keys). Values are read in place where the daemon lends them. Returns
        per key the value's size (its pieces written only when it equals their total), or None
        when the key is absent (or was dropped as damaged)."""
        return self._c.get_into_pieces(keys, ptrs, sizes, counts)

    def put_pieces(self, keys, ptrs, sizes, counts):
        """Stores key ``i``'s value as the concatenation of its ``counts[i]`` pieces (as in
        ``get_into_pieces``), gathered in one buffer and put (through a write lease, straight
        into the daemon's memory, where the daemon grants them). Per key None or the item's
        error (not raised)."""
        return self._c.put_pieces(keys, ptrs, sizes, counts)

    def lookup_array(self, keys):
        """``lookup`` without a Python object per key: ``keys`` a uint8 ``[n, 16]`` array (or
        bytes of n keys); returns ``(prefix_blocks, tiers)`` with ``tiers`` one byte per key:
        0 absent, 1 host, 2 ssd, 3 rocksdb, 4 remote."""
        return self._c.lookup_array(keys)

    def lookup(self, keys):
        """How much of a prefix the daemon holds: ``(prefix_blocks, tiers)``, the length of the
        leading run of keys held somewhere and, per key, "host", "ssd", "rocksdb" or "absent"."""
        return self._c.lookup(keys)

    def delete(self, keys):
        """Deletes the keys; one entry per key, None or the item's error (not raised)."""
        return self._c.delete(keys)

    def hint(self, keys, ttl=30.0):
        """Says the keys will be read soon: the daemon's tiers evict them last (within each
        tier's hint bound) and bring those held only on SSD or RocksDB up into host memory,
        for `ttl` seconds, until drop_hint, or until this client closes. Returns a HintInfo
        (hint id, found, in_memory, prefetching). Raises Error (InvalidArgument for a ttl above
        the daemon's max_hint_ttl_ms, ResourceExhausted past max_hinted_blocks_per_session)."""
        return HintInfo(*self._c.hint(keys, float(ttl)))

    def drop_hint(self, hint):
        """Ends a hint early; raises Error (NotFound) when it is not live in this client."""
        self._c.drop_hint(int(hint))

    def log_append(self, request, first_token, tokens):
        """Appends `tokens` as tokens first_token.. of `request` to the namespace's request log in
        the daemon; returns once durable there (fdatasync, group-committed with every client's
        appends). FailedPrecondition when they do not continue the request."""
        self._c.log_append(int(request), int(first_token), [int(t) for t in tokens])

    def log_suspended(self, request, tokens, tail, tag=0):
        """Logs that `request` was suspended at `tokens` tokens, its tail record under the 16-byte
        key `tail` (OffloadedCache.suspend's)."""
        self._c.log_suspended(int(request), int(tokens), bytes(tail), int(tag))

    def log_finish(self, request):
        """Logs that `request` is done; the daemon reclaims its records."""
        self._c.log_finish(int(request))

    def log_recover(self):
        """Every unfinished request of the namespace: a list of (id, tokens, suspension), suspension
        None or (tokens, tail, tag). What an engine that restarted resumes from."""
        return self._c.log_recover()

    def stats(self):
        """The namespace's statistics, as a dict."""
        return _json.loads(self._c.stats())

    def ping(self):
        """A round trip to the daemon; raises if it fails."""
        self._c.ping()

    async def get_async(self, keys):
        """``get`` for asyncio: runs in the loop's default executor, so the loop goes on."""
        loop = _asyncio.get_running_loop()
        return await loop.run_in_executor(None, _functools.partial(self._c.get, keys))

    async def put_async(self, keys, values):
        """``put`` for asyncio (see get_async)."""
        loop = _asyncio.get_running_loop()
        return await loop.run_in_executor(None, _functools.partial(self._c.put, keys, values))

    def close(self):
        """Closes the connection (once no call in flight holds it); later calls raise
        sparsekv.FailedPrecondition."""
        self._c.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    @property
    def shared_memory(self):
        """Whether values move through shared memory (Unix socket only)."""
        return self._c.shared_memory

    @property
    def max_payload_bytes(self):
        """The largest frame the daemon accepts; larger batches are split."""
        return self._c.max_payload_bytes

    @property
    def block_tokens(self):
        """Tokens per block, as the daemon is configured."""
        return self._c.block_tokens

    @property
    def session_id(self):
        return self._c.session_id

    def __repr__(self):
        return f"sparsekv.Client({self.address!r}, namespace={self.namespace!r})"


class CacheManager:
    """The L1 KV cache of one model: page pools with compression-rate-aligned blocks for every
    cache kind, block tables per sequence, and the prefix cache (cache_manager.h).

    ``pool_array(i)`` lends pool i's memory in place as a writable numpy uint8 array of shape
    [capacity, page bytes]: page p is row p, every layer of one block (``pool_info(i)`` gives
    the layer stride and format). Nothing is copied; what the engine writes there is what the
    cache keeps, offloads and shares, and the reverse. ``torch.from_numpy(array)`` gives a
    tensor over the same memory. An array keeps the manager's memory alive after the
    manager object is gone.

    The call sequence of an engine: create_sequence, append_tokens (the prompt),
    acquire_cached_prefix (blocks already cached), allocate_slots, write the new tokens' KV
    into the pages of block_table, commit_computed, and free when the request ends.
    """

    def __init__(self, spec, *, capacity_blocks, block_tokens=128, window_capacity_blocks=0,
                 state_capacity_blocks=0, huge_pages=False, hash_mode="xxh3", enable_prefix_caching=True,
                 eviction="arc", hint_bound=0.5):
        self._m = _sparsekv._CacheManager(spec, block_tokens, capacity_blocks, window_capacity_blocks,
                                          state_capacity_blocks, huge_pages, hash_mode, enable_prefix_caching,
                                          eviction, hint_bound)

    @property
    def num_pools(self):
        """Page pools: one per distinct cache kind and layout of the model."""
        return self._m.num_pools

    @property
    def block_tokens(self):
        return self._m.block_tokens

    def pool_info(self, pool):
        """Pool `pool`'s kind, format, dims, ratio, layers, entries per block, strides, capacity."""
        return self._m.pool_info(pool)

    def pool_array(self, pool):
        """Pool `pool`'s memory in place, as described in the class docstring."""
        return self._m.pool_array(pool)

    def create_sequence(self, namespace_salt="", extra_keys="", cache_blocks=True):
        """A new sequence; returns its id."""
        return self._m.create_sequence(namespace_salt, extra_keys, cache_blocks)

    def append_tokens(self, seq, tokens):
        """Appends token ids (ints) to the sequence."""
        self._m.append_tokens(seq, [int(t) for t in tokens])

    def acquire_cached_prefix(self, seq):
        """Attaches the longest cached prefix of the sequence's tokens: {blocks, tokens, chain_blocks}."""
        return self._m.acquire_cached_prefix(seq)

    def lookup_prefix(self, tokens, namespace_salt="", extra_keys="", leave_last_token=True):
        """How much of a prompt is cached, without changing anything."""
        return self._m.lookup_prefix([int(t) for t in tokens], namespace_salt, extra_keys, leave_last_token)

    def hint_prefix(self, tokens, namespace_salt="", extra_keys="", ttl=30.0):
        """A scheduler's hint: this prompt will be looked up soon (a queued request, a session
        that will continue). Its blocks, cached now or registered while the hint lives, are
        evicted only when nothing unprotected is left, within `hint_bound` of the cache, for
        `ttl` seconds or until drop_hint. Returns {id, found_blocks, protected_blocks}."""
        return self._m.hint_prefix([int(t) for t in tokens], namespace_salt, extra_keys, float(ttl))

    def drop_hint(self, hint):
        """Ends a hint early (the id hint_prefix returned); sparsekv.NotFound once it is gone."""
        self._m.drop_hint(int(hint))

    def allocate_slots(self, seq, num_tokens):
        """Pages for the sequence's first `num_tokens` tokens: {first_new_block, new_blocks,
        copies}; each copy (pool, src, dst, reason) is a page copy the engine makes first.
        Raises sparsekv.ResourceExhausted when the pools cannot hold them."""
        return self._m.allocate_slots(seq, num_tokens)

    def commit_computed(self, seq, num_tokens):
        """Marks the first `num_tokens` tokens computed; full blocks enter the prefix cache."""
        self._m.commit_computed(seq, num_tokens)

    def free(self, seq):
        self._m.free(seq)

    def block_table(self, seq, pool):
        """The sequence's pages in pool `pool`, in block order."""
        return self._m.block_table(seq, pool)

    def sequence_info(self, seq):
        return self._m.sequence_info(seq)

    def reset(self):
        """Forgets every sequence and cached block."""
        self._m.reset()

    def stats(self):
        return self._m.stats()

    def lightning_indexer(self, pool, layer, q, weights, key_table, positions, top_k, *, target_table=(),
                          target_block_entries=0, key_ratio=1, threads=1):
        """The Lightning Indexer over model layer `layer` of key pool `pool`, reading its pages in
        place (CPU, exact top-k). q: float32 [tokens, heads, key dims]; weights: [tokens,
        heads]; key_table: the sequence's key pages; positions: each token's position. Returns
        int32 [tokens, top_k]: entries of the target cache (target_table's pages,
        target_block_entries each; by default the key pages) as page * entries + slot, -1 for
        none, in ascending order."""
        return self._m.lightning_indexer(pool, layer, q, weights, list(key_table), list(target_table),
                                         target_block_entries, [int(p) for p in positions], top_k, key_ratio, threads)

    def sparse_mla(self, pool, layer, q, indices, softmax_scale, *, threads=1):
        """Sparse MLA over model layer `layer` of pool `pool`, reading its pages in place (CPU).
        q: [tokens, heads, dims], float32 or uint16 holding bf16; indices: int32 [tokens, top_k]
        (page * entries + slot, -1 for none). Returns (out float32 [tokens, heads, 512], lse
        float32 [tokens, heads])."""
        return self._m.sparse_mla(pool, layer, q, indices, softmax_scale, threads)

    def engine_view(self, pool):
        """Pool `pool`'s pages as the per-format arrays an engine hands its kernels, all numpy
        views of the pool's memory (no copy), indexed [page, layer slot, entry, ...]:

        - bf16: ``values`` uint16 (bf16 bits) [..., dims]
        - fp8_ds_mla: ``nope`` uint8 (fp8 e4m3 bits) [..., 512], ``scales`` float32 [..., 4]
          (one per 128-value tile), ``rope`` uint16 (bf16 bits) [..., 64]: FlashMLA's 656-byte
          token
        - c8_mla: ``nope`` int8 [..., 512], ``rope`` uint16 [..., 64], ``scales`` float32 [..., 4]:
          CANN's order
        - fp8_v4: ``nope`` uint8 (e4m3) [..., 448], ``rope`` uint16 [..., 64], ``scales`` uint8
          (ue8m0 exponents) [..., 7]
        - idx_fp8 / idx_c8: ``values`` uint8 (e4m3) / int8 [..., dims], ``scales`` float32 [...]
        - fp32 (compressor state): ``values`` float32 [page, layer slot, floats per layer]

        numpy has no fp8 or bf16 type, so those come as their bits; ``engine_tensors`` gives
        the same views as torch tensors, bf16 fields as torch.bfloat16.
        """
        import numpy as _np  # only the cache side needs numpy; the client does not

        arr = self.pool_array(pool)
        ls = self.pool_info(pool)["layer_stride"]
        types = {"uint8": _np.uint8, "int8": _np.int8, "bfloat16": _np.uint16, "float32": _np.float32}
        out = {}
        for name, (offset, dtype, shape, strides) in _engine_fields(self.pool_info(pool)).items():
            # numpy checks the view stays inside the pool's bytes.
            out[name] = _np.ndarray(buffer=arr, dtype=types[dtype], offset=offset, shape=(arr.shape[0],) + shape,
                                    strides=(arr.strides[0], ls) + strides[1:])
        return out

    def engine_tensors(self, pool):
        """``engine_view`` as torch tensors over the same memory (DLPack, no copy), bf16 fields
        as torch.bfloat16; fp8 fields stay uint8 (torch 1.13 has no float8 type). Each tensor
        keeps the pool alive."""
        import torch as _torch

        info = self.pool_info(pool)
        pages = info["capacity"]
        return {name: _torch.from_dlpack(self._m.region(pool, offset, dtype, [pages, *shape],
                                                        [info["block_stride"], *strides]))
                for name, (offset, dtype, shape, strides) in _engine_fields(info).items()}

    def pool_tensor(self, pool):
        """Pool `pool`'s memory in place as a torch uint8 tensor [capacity, page bytes] (DLPack,
        no copy): the memory of pool_array. It keeps the pool alive."""
        import torch as _torch

        return _torch.from_dlpack(self.pool_dlpack(pool))

    def pool_dlpack(self, pool):
        """Pool `pool`'s memory as a DLPack producer (``__dlpack__``, ``__dlpack_device__``) of
        uint8 [capacity, page bytes], for any framework's ``from_dlpack``."""
        info = self.pool_info(pool)
        return self._m.region(pool, 0, "uint8", [info["capacity"], info["block_stride"]], [info["block_stride"], 1])

    def evict(self, free_pages, max_blocks=0xFFFFFFFF):
        """Evicts cached blocks no sequence holds, least recently used first, until every
        full-history pool has `free_pages` free pages or `max_blocks` went; returns how many.
        Their bytes are dropped (with a write-back OffloadedCache, evict through it: this raises
        sparsekv.FailedPrecondition). Events are those of an eviction."""
        return self._m.evict(free_pages, max_blocks)

    def subscribe(self, max_events=65536):
        """A KvEventQueue receiving this manager's KV events from now on."""
        return KvEventQueue(self._m.subscribe(max_events))


def _engine_fields(info):
    """Per field of a pool's format: (byte offset in a page, element type, shape and byte strides
    after the page axis), the layer slot first."""
    fmt, dims, n, ls = info["format"], info["dims"], info["entries_per_block"], info["layer_stride"]
    layers = len(info["layers"])

    def f(offset, dtype, shape, strides):
        return (offset, dtype, (layers,) + shape, (ls,) + strides)

    if fmt == "bf16":
        return {"values": f(0, "bfloat16", (n, dims), (2 * dims, 2))}
    if fmt == "fp8_ds_mla":
        return {"nope": f(0, "uint8", (n, 512), (656, 1)), "scales": f(512, "float32", (n, 4), (656, 4)),
                "rope": f(528, "bfloat16", (n, 64), (656, 2))}
    if fmt == "c8_mla":
        return {"nope": f(0, "int8", (n, 512), (656, 1)), "rope": f(512, "bfloat16", (n, 64), (656, 2)),
                "scales": f(640, "float32", (n, 4), (656, 4))}
    if fmt == "fp8_v4":
        return {"nope": f(0, "uint8", (n, 448), (576, 1)), "rope": f(448, "bfloat16", (n, 64), (576, 2)),
                "scales": f(n * 576, "uint8", (n, 7), (8, 1))}
    if fmt in ("idx_fp8", "idx_c8"):
        return {"values": f(0, "uint8" if fmt == "idx_fp8" else "int8", (n, dims), (dims, 1)),
                "scales": f(n * dims, "float32", (n,), (4,))}
    if fmt == "fp32":
        return {"values": f(0, "float32", (info["page_bytes"] // 4,), (4,))}
    raise NotSupported(f"no engine view for format {fmt}")


class KvEventQueue:
    """KV events of a cache manager (``CacheManager.subscribe``), queued as they happen on any
    thread and taken from Python with ``drain``: "blocks_stored" (consecutive blocks of one
    sequence, with the parent hash and the kinds written), "blocks_removed" (with the kinds the
    blocks lost) and "all_cleared". ``sequence_number`` goes 1, 2, 3, ... with no gaps; when
    more than ``max_events`` wait, the oldest are dropped and counted in ``dropped`` (a router
    then resynchronises)."""

    def __init__(self, q):
        self._q = q

    def drain(self, max=0, timeout=0.0):
        """The events waiting, oldest first (at most `max` when it is not 0); with a timeout in
        seconds, waits that long for the first one (the GIL released)."""
        return self._q.drain(max, float(timeout))

    @property
    def dropped(self):
        return self._q.dropped

    @property
    def pending(self):
        return self._q.pending

    def close(self):
        """Ends the subscription; events already queued can still be drained."""
        self._q.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class OffloadedCache:
    """A CacheManager (L1) with offload tiers under it (offloaded_cache.h): blocks go down to
    host memory, an io_uring SSD tier and RocksDB, and a prefix found there is restored into
    fresh L1 pages, every kind checked.

    ``offload`` is the daemon's "offload" section as a dict (docs: offload_options.h), e.g.
    ``{"host": {"capacity_bytes": "1GiB"}, "ssd": {"enabled": True, "capacity_bytes": "4GiB"}}``;
    relative paths are under `data_dir`. ``write_policy``: "write-through" copies every block
    at commit, "write-back" copies blocks when L1 evicts them. ``demote_on_boundary_eviction``
    (write-back): whether a block whose window or state pages alone leave L1 is demoted whole
    then (see OffloadedCacheOptions in offloaded_cache.h).

    Sequences are created, fed, committed and freed through this object; pages are allocated
    and block tables read on ``manager``. It keeps the manager alive."""

    def __init__(self, manager, offload=None, *, data_dir=".", write_policy="write-through", namespace_id=0,
                 max_pending_demote_bytes=256 << 20, evict_ahead_blocks=8, prefetch_blocks=-1, restore_threads=2,
                 demote_on_boundary_eviction=True):
        self.manager = manager
        self._c = _sparsekv._OffloadedCache(manager._m, _json.dumps(offload or {}), str(data_dir), write_policy,
                                            namespace_id, max_pending_demote_bytes, evict_ahead_blocks,
                                            prefetch_blocks, restore_threads, demote_on_boundary_eviction)

    def create_sequence(self, namespace_salt="", extra_keys="", cache_blocks=True):
        return self._c.create_sequence(namespace_salt, extra_keys, cache_blocks)

    def append_tokens(self, seq, tokens):
        self._c.append_tokens(seq, [int(t) for t in tokens])

    def acquire_prefix(self, seq):
        """Attaches the L1 prefix, then restores the following blocks from the tiers:
        {l1_blocks, lower_blocks, blocks, tokens}."""
        return self._c.acquire_prefix(seq)

    def commit_computed(self, seq, num_tokens):
        self._c.commit_computed(seq, num_tokens)

    def free(self, seq):
        self._c.free(seq)

    def lookup_prefix(self, tokens, namespace_salt="", extra_keys="", leave_last_token=True):
        """How much of a prompt L1 and the tiers hold, changing nothing."""
        return self._c.lookup_prefix([int(t) for t in tokens], namespace_salt, extra_keys, leave_last_token)

    def block_digests(self, seq):
        """The hashes (16 bytes each) of the sequence's full blocks: what its bundles are filed
        under."""
        return self._c.block_digests(seq)

    def evict(self, free_pages, max_blocks=0xFFFFFFFF):
        """Evicts cached blocks no sequence holds until every full-history pool has
        `free_pages` free pages (at most `max_blocks`), each reaching the tiers; returns how
        many left L1."""
        return self._c.evict(free_pages, max_blocks)

    def suspend(self, seq):
        """Saves the sequence at its computed tokens and frees it (offloaded_cache.h): its full
        blocks as ordinary bundles (those the tiers lack written now) and one tail record (the
        partial block's pages of every kind, V4's window rows and compressor state, the tokens
        since the last full block). Returns once the tiers acknowledged it: {tail (16-byte key),
        tokens, blocks, written_blocks, unsaved_blocks, tail_bytes, written_bytes}."""
        return self._c.suspend(seq)

    def resume(self, tokens, state_tokens, namespace_salt="", extra_keys=""):
        """A new sequence with `tokens` appended and the state suspended at `state_tokens` of
        them restored as far as it is found exact: {seq, tokens, state_tokens, restored_tokens,
        recompute_tokens, l1_blocks, lower_blocks, tail_restored, lost}. Tokens
        [restored_tokens, len(tokens)) are the engine's to compute."""
        return self._c.resume([int(t) for t in tokens], int(state_tokens), namespace_salt, extra_keys)

    def suspension_key(self, tokens, state_tokens, namespace_salt="", extra_keys=""):
        """The tail record's key (16 bytes) of the state at `state_tokens` of `tokens`."""
        return self._c.suspension_key([int(t) for t in tokens], int(state_tokens), namespace_salt, extra_keys)

    def drop_suspension(self, tail):
        """Erases a tail record (16-byte key) from every tier; its blocks stay."""
        self._c.drop_suspension(bytes(tail))

    def wait_idle(self):
        """Waits for the background demotes and prefetches."""
        self._c.wait_idle()

    def stats(self):
        """Demote and restore counts, and each tier's items, bytes, hits and misses."""
        return self._c.stats()


class RequestLog:
    """A token-granular write-ahead log of generation requests (request_log.h): append each
    request's generated tokens as they come; an append returns once durable (group-committed with
    every other append waiting, one fdatasync for all under the default durability). After a
    crash, ``recover()`` lists every unfinished request with every acknowledged token and the last
    state it was suspended at. A torn tail (a last record cut short, nothing whole after it) is
    cut at open; damage (a record that fails its check with whole records after it, or any in an
    older segment) raises Corruption and a newer release's header or record NotSupported, naming
    the file and offset, and nothing is changed.

    ``RequestLog(path, durability="fdatasync", segment_bytes=64 << 20,
    recovery="tolerate_torn_tail")``; durability is "fdatasync", "dsync" or "none". recovery
    "point_in_time" cuts the log at damage instead of refusing (every record from there on is
    lost; ``stats()`` reports damage_bytes_cut, damage_records_cut and damage_tokens_cut): open
    it so once, after copying the directory aside, to get past a refusal."""

    def __init__(self, path, durability="fdatasync", segment_bytes=64 << 20, recovery="tolerate_torn_tail"):
        self._l = _sparsekv._RequestLog(str(path), durability, int(segment_bytes), recovery)

    def append(self, request, first_token, tokens):
        """Appends `tokens` (ints) as tokens first_token.. of `request` (a new one starts at 0);
        raises FailedPrecondition when that does not continue the request."""
        self._l.append(int(request), int(first_token), [int(t) for t in tokens])

    def suspended(self, request, tokens, tail, tag=0):
        """Logs that `request` was suspended with its state at `tokens` tokens, kept under the
        16-byte key `tail`."""
        self._l.suspended(int(request), int(tokens), bytes(tail), int(tag))

    def finish(self, request):
        """Logs that `request` is done: its records become garbage and their segments are
        deleted once no unfinished request needs them."""
        self._l.finish(int(request))

    def recover(self):
        """Every unfinished request as the log was opened: a list of (id, tokens, suspension),
        suspension None or (tokens, tail, tag)."""
        return self._l.recover()

    def stats(self):
        return self._l.stats()

    def close(self):
        self._l.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
