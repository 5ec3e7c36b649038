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

__all__ = ["CacheManager", "Client", "Codec", "Error", "ModelSpec", "__version__", "block_hashes", "model_preset",
           "model_presets", "model_spec_from_json", "plan_for_budget", "plan_for_sequences"]

ModelSpec = _sparsekv.ModelSpec
Codec = _sparsekv.Codec
Codec.__doc__ = """A page codec: Codec(format, dims, entries) for one layer's page of a pool
(format as pool_info gives it: "bf16", "fp8_ds_mla", "c8_mla", "fp8_v4", "idx_fp8", ...).
write(page, first_slot, rows) encodes float32 (or bf16 as uint16) rows into the page in place;
read(page, first_slot, count) decodes them. A page is a contiguous uint8 buffer, such as
pool_array(i)[page, l * layer_stride : l * layer_stride + page_bytes]. Torch tensors pass as
tensor.numpy() (no copy on the CPU)."""


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

    def lookup(self, keys):
        """How much of a prefix the daemon holds: ``(prefix_blocks, tiers)``, the length of the
        leading run of keys held somewhere and, per key, "host", "ssd", "rocksdb" or "absent"."""
        return self._c.lookup(keys)

    def delete(self, keys):
        """Deletes the keys; one entry per key, None or the item's error (not raised)."""
        return self._c.delete(keys)

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
                 state_capacity_blocks=0, huge_pages=False, hash_mode="xxh3", enable_prefix_caching=True):
        self._m = _sparsekv._CacheManager(spec, block_tokens, capacity_blocks, window_capacity_blocks,
                                          state_capacity_blocks, huge_pages, hash_mode, enable_prefix_caching)

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
        """Pool `pool`'s pages as the per-format arrays an engine hands its kernels, all views of
        the pool's memory (no copy), indexed [page, layer slot, entry, ...]:

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

        numpy has no fp8 or bf16 type, so those come as their bits. For torch:
        ``torch.from_numpy(v.view(numpy.int16)).view(torch.bfloat16)``, and the same with int8
        and ``torch.float8_e4m3fn`` where torch has it.
        """
        import numpy as _np  # only the cache side needs numpy; the client does not

        info = self.pool_info(pool)
        arr = self.pool_array(pool)
        fmt, dims, n = info["format"], info["dims"], info["entries_per_block"]
        pages, layers, ls = arr.shape[0], len(info["layers"]), info["layer_stride"]

        def field(offset, dtype, shape, strides):
            # A view of the pool's bytes (numpy checks it stays inside them): a page, then a
            # layer slot, then the format's own axes.
            return _np.ndarray(buffer=arr, dtype=dtype, offset=offset, shape=(pages, layers) + shape,
                               strides=(arr.strides[0], ls) + strides)

        if fmt == "bf16":
            return {"values": field(0, _np.uint16, (n, dims), (2 * dims, 2))}
        if fmt in ("fp8_ds_mla", "c8_mla"):
            e = 656
            if fmt == "fp8_ds_mla":
                return {"nope": field(0, _np.uint8, (n, 512), (e, 1)),
                        "scales": field(512, _np.float32, (n, 4), (e, 4)),
                        "rope": field(528, _np.uint16, (n, 64), (e, 2))}
            return {"nope": field(0, _np.int8, (n, 512), (e, 1)),
                    "rope": field(512, _np.uint16, (n, 64), (e, 2)),
                    "scales": field(640, _np.float32, (n, 4), (e, 4))}
        if fmt == "fp8_v4":
            return {"nope": field(0, _np.uint8, (n, 448), (576, 1)),
                    "rope": field(448, _np.uint16, (n, 64), (576, 2)),
                    "scales": field(n * 576, _np.uint8, (n, 7), (8, 1))}
        if fmt in ("idx_fp8", "idx_c8"):
            vt = _np.uint8 if fmt == "idx_fp8" else _np.int8
            return {"values": field(0, vt, (n, dims), (dims, 1)),
                    "scales": field(n * dims, _np.float32, (n,), (4,))}
        if fmt == "fp32":
            floats = info["page_bytes"] // 4
            return {"values": field(0, _np.float32, (floats,), (4,))}
        raise NotSupported(f"no engine view for format {fmt}")
