"""sparsekv from Python: a client of the sparsekvd daemon.

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

__all__ = ["Client", "Error", "__version__"]


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
