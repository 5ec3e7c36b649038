"""What the engine plug-ins (``sparsekv.vllm``; ``sparsekv.sglang`` keeps its own copy for now)
share: checking the options an engine hands over as a JSON object, and a daemon connection that
turns every failure into "no connection" and reconnects on a later call.

Neither piece raises in an engine's threads once constructed: a call that fails drops the
connection (``ReconnectingClient.failed``) and the next ``client()`` after ``reconnect_interval``
seconds connects again.
"""

import difflib as _difflib
import logging as _logging
import threading as _threading
import time as _time

from . import Client, Error

_log = _logging.getLogger(__name__)


def _number(lo, hi, lo_open=False):
    def ok(v):
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            return False
        return (lo < v if lo_open else lo <= v) and v <= hi
    return ok


# name: (check, what it must be, default). The options every plug-in takes.
CONNECTION_OPTIONS = {
    "address": (lambda v: isinstance(v, str) and (v.startswith("unix:") or ":" in v),
                "a sparsekvd address, 'unix:PATH' or 'HOST:PORT'", "unix:var/sparsekvd.sock"),
    "namespace": (lambda v: isinstance(v, str) and 0 < len(v) <= 256, "a namespace name (1 to 256 bytes)", "default"),
    "token": (lambda v: isinstance(v, str) and len(v) <= 256, "a string of at most 256 bytes", ""),
    "transport": (lambda v: v in ("auto", "shm", "socket"), "'auto', 'shm' or 'socket'", "auto"),
    "timeout": (_number(0, 3600, lo_open=True), "seconds, a number in (0, 3600]", 10.0),
    "reconnect_interval": (_number(0, 600), "seconds, a number in [0, 600]", 1.0),
    "key_tag": (lambda v: isinstance(v, str) and len(v) <= 128, "a string of at most 128 bytes", ""),
}


def check_options(extra, options, who, where, engine_keys=(), log=None):
    """The options of `options` (name -> (check, what, default)) read from the JSON object
    `extra`. A bad value of a known key raises ValueError naming the key and what it must be; a
    key neither known here nor in `engine_keys` is warned about (with the closest known key) and
    ignored, so that a newer engine's keys do not stop it. `log`: the caller's logger (default
    this module's)."""
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise ValueError(f"{who}: {where} must be a JSON object, not {type(extra).__name__}")
    out = {}
    for name, (ok, what, default) in options.items():
        v = extra.get(name, default)
        if not ok(v):
            raise ValueError(f"{who}: {where} '{name}' must be {what}; got {v!r}")
        out[name] = v
    if out.get("transport") == "shm" and not str(out.get("address", "")).startswith("unix:"):
        raise ValueError(f"{who}: {where} 'transport' 'shm' needs a 'unix:' address; got {out.get('address')!r}")
    known = sorted(set(options) | set(engine_keys))
    for key in sorted(str(k) for k in extra if k not in options and k not in engine_keys):
        close = _difflib.get_close_matches(key, known, n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(known)}"
        (log or _log).warning("%s: %s key '%s' is not one this plug-in knows; ignored (%s)", who, where, key, hint)
    return out


class ReconnectingClient:
    """One sparsekv.Client, made on demand. ``client()`` answers the live client or None (the
    daemon is down, or was within the last ``reconnect_interval`` seconds); ``failed(c)`` drops
    `c` after a call on it failed. Thread-safe."""

    def __init__(self, options, client_name):
        self.options = options
        self.client_name = client_name
        self.reconnects = 0
        self.errors = 0
        self._lock = _threading.Lock()
        self._client = None
        self._next_connect = 0.0

    def _shared_memory(self):
        o = self.options
        return o["transport"] == "shm" or (o["transport"] == "auto" and o["address"].startswith("unix:"))

    def client(self):
        c = self._client
        if c is not None:
            return c
        with self._lock:
            if self._client is not None:
                return self._client
            if _time.monotonic() < self._next_connect:
                return None
            o = self.options
            try:
                c = Client(o["address"], o["namespace"], o["token"], client_name=self.client_name,
                           shared_memory=self._shared_memory(), timeout=float(o["timeout"]))
            except Error as e:
                self._next_connect = _time.monotonic() + float(o["reconnect_interval"])
                _log.debug("%s: connecting to %s failed: %s", self.client_name, o["address"], e)
                return None
            self.reconnects += 1
            self._client = c
            return c

    def failed(self, c, error=None):
        """A call on `c` failed (`error`): `c` is dropped; the next call connects again."""
        self.errors += 1
        with self._lock:
            if self._client is c:
                self._client = None
                self._next_connect = _time.monotonic() + float(self.options["reconnect_interval"])
        if error is not None:
            _log.warning("%s: a call to sparsekvd failed (%s: %s); it counts as a miss, and the next call "
                         "reconnects", self.client_name, type(error).__name__, error)
        try:
            c.close()
        except Exception:  # noqa: BLE001 - closing a broken client must not raise
            pass

    def close(self):
        with self._lock:
            c, self._client = self._client, None
        if c is not None:
            try:
                c.close()
            except Exception:  # noqa: BLE001
                pass
