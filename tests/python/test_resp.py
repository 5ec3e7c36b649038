"""sparsekvd's Redis protocol (RESP) listener, driven by real, unmodified Redis clients: redis-py
(sync, pipelines, asyncio with a 150-connection pool as LMCache uses it), redis-cli (arguments,
--pipe, --scan, --bigkeys, -a/--user), redis-benchmark, a C program on libhiredis, and raw sockets
for RESP3 and for hostile input.

The server under test is sparsekvd (SPARSEKVD_PATH). With SPARSEKV_RESP_TARGET=redis it is a
plain redis-server instead, so that these tests themselves can be checked against real Redis: the
tests of behaviour only sparsekvd has (namespaces kept apart, expiry in the records across restarts, the key and value
limits, INFO's sparsekv section, bridge keys) are skipped then, and only then.

SPARSEKV_RESP_HIREDIS: the compiled resp_hiredis_client (else it is compiled here with cc)."""

import asyncio
import fnmatch
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import pytest

redis = pytest.importorskip("redis", reason="python3-redis is not installed")
import redis.asyncio  # noqa: E402  (redis-py 4.2 and later)

import daemon_process  # noqa: E402  (conftest puts bench/python on the path)
from daemon_process import Daemon, _free_port  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
REDIS_MODE = os.environ.get("SPARSEKV_RESP_TARGET", "sparsekvd") == "redis"
sparsekv_only = pytest.mark.skipif(REDIS_MODE, reason="sparsekvd-only behaviour (SPARSEKV_RESP_TARGET=redis)")

# The host tier's record limit the main server runs with: a value well above it must be refused.
RECORD_LIMIT = 16 << 20
RUN = uuid.uuid4().hex[:8]  # keys of this run, so that nothing depends on a server's past


def need_tool(name):
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (Debian: redis-tools)")
    return path


# --- Servers ------------------------------------------------------------------------------------


def RedisServer(config_lines=()):  # noqa: N802  (stands where a class stood)
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("SPARSEKV_RESP_TARGET=redis needs redis-server")
    return daemon_process.RedisServer(binary, config_lines)


@pytest.fixture(scope="module")
def server():
    """Namespace "default" open (no AUTH needed), alpha and beta behind tokens."""
    if REDIS_MODE:
        s = RedisServer()
    else:
        s = Daemon(resp=True, namespaces=(("default", ""), ("alpha", "alpha-token"), ("beta", "beta-token")),
                   host_bytes="512MiB", max_record_bytes=RECORD_LIMIT)
    yield s
    alive = s.alive()
    log = s.stderr_text()
    code = s.stop()
    assert alive, f"the server died during the tests: {log}"
    assert code == 0, f"the server did not stop cleanly ({code}): {log}"


@pytest.fixture(scope="module")
def auth_server():
    """Every namespace behind a token, "default" included: a fresh connection must AUTH."""
    if REDIS_MODE:
        s = RedisServer(["requirepass default-token", "user alpha on >alpha-token ~* &* +@all",
                         "user beta on >beta-token ~* &* +@all"])
    else:
        s = Daemon(resp=True, namespaces=(("default", "default-token"), ("alpha", "alpha-token"),
                                          ("beta", "beta-token")))
    yield s
    assert s.alive()
    assert s.stop() == 0


@pytest.fixture
def r(server):
    c = redis.Redis(host="127.0.0.1", port=server.resp_port, socket_timeout=30)
    yield c
    c.close()


def other_db(server):
    """A client on a keyspace apart from the default one: namespace alpha (sparsekvd), db 1 (Redis)."""
    if REDIS_MODE:
        return redis.Redis(host="127.0.0.1", port=server.resp_port, db=1, socket_timeout=30)
    return redis.Redis(host="127.0.0.1", port=server.resp_port, username="alpha", password="alpha-token",
                       socket_timeout=30)


@pytest.fixture(scope="module")
def canary(server):
    """Keys stored before the hostile tests, in the default namespace, which must all survive."""
    rnd = random.Random(7)
    values = {}
    sizes = [0, 1, 2, 100, 4095, 4096, 4097, 65536, 200000] + [rnd.randrange(1, 20000) for _ in range(31)]
    for i, n in enumerate(sizes):
        values[f"canary:{RUN}:{i}".encode()] = rnd.randbytes(n)
    values[f"canary:{RUN}:crlf\r\n\0".encode()] = b"\r\n\0\r\n$-1\r\n*3\r\n"
    c = redis.Redis(host="127.0.0.1", port=server.resp_port, socket_timeout=30)
    c.mset(values)
    c.close()
    return values


def check_canary(server, canary):
    c = redis.Redis(host="127.0.0.1", port=server.resp_port, socket_timeout=30)
    keys = list(canary)
    got = c.mget(keys)
    c.close()
    missing = [k for k, g in zip(keys, got) if g is None]
    wrong = [k for k, g in zip(keys, got) if g is not None and g != canary[k]]
    assert not missing and not wrong, \
        f"keys stored at the start in namespace default: {len(missing)} missing, {len(wrong)} with other bytes"


# --- A raw RESP connection ----------------------------------------------------------------------


class Err(str):
    """An error reply's text, without the '-'."""


class _Null3:
    def __repr__(self):
        return "RESP3-null"


NULL3 = _Null3()  # RESP3's "_" null, told apart from RESP2's "$-1" (None)


class Raw:
    def __init__(self, port=None, unix=None, timeout=10.0):
        if unix is not None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(timeout)
            self.sock.connect(unix)
        else:
            self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.buf = bytearray()
        self.last_type = None

    def send(self, data):
        self.sock.sendall(data)
        return self

    def cmd(self, *args):
        out = [b"*%d\r\n" % len(args)]
        for a in args:
            a = a if isinstance(a, bytes) else str(a).encode()
            out.append(b"$%d\r\n%s\r\n" % (len(a), a))
        self.send(b"".join(out))
        return self.reply()

    def _fill(self):
        chunk = self.sock.recv(1 << 20)
        if not chunk:
            raise EOFError("the server closed the connection")
        self.buf += chunk

    def line(self):
        """The next reply line, without its CRLF, as it came."""
        while True:
            i = self.buf.find(b"\r\n")
            if i >= 0:
                out = bytes(self.buf[:i])
                del self.buf[:i + 2]
                return out
            self._fill()

    def _exact(self, n):
        while len(self.buf) < n + 2:
            self._fill()
        assert self.buf[n:n + 2] == b"\r\n", "a bulk reply not followed by CRLF"
        out = bytes(self.buf[:n])
        del self.buf[:n + 2]
        return out

    def reply(self):
        v = self._reply()
        return v

    def _reply(self, top=True):
        line = self.line()
        t, rest = line[:1], line[1:]
        if top:
            self.last_type = t
        if t == b"+":
            return rest.decode()
        if t == b"-":
            return Err(rest.decode())
        if t in (b":", b"("):
            return int(rest)
        if t in (b"$", b"="):
            n = int(rest)
            if n < 0:
                return None
            data = self._exact(n)
            return data[4:] if t == b"=" else data  # a verbatim string's "txt:" dropped
        if t in (b"*", b"~", b">"):
            n = int(rest)
            return None if n < 0 else [self._reply(False) for _ in range(n)]
        if t == b"%":
            out = {}
            for _ in range(int(rest)):
                k = self._reply(False)
                out[tuple(k) if isinstance(k, list) else k] = self._reply(False)
            return out
        if t == b"_":
            return NULL3
        if t == b",":
            return float(rest)
        if t == b"#":
            return rest == b"t"
        if t == b"|":  # an attribute: read and drop, then the reply it came with
            for _ in range(2 * int(rest)):
                self._reply(False)
            return self._reply(top)
        raise AssertionError(f"not a RESP reply: {line[:80]!r}")

    def until_close(self, timeout=10.0):
        """Everything until the server closes; fails if it keeps the connection open."""
        self.sock.settimeout(timeout)
        out = bytes(self.buf)
        self.buf.clear()
        deadline = time.monotonic() + timeout
        while True:
            try:
                chunk = self.sock.recv(1 << 16)
            except ConnectionResetError:
                return out
            except socket.timeout:
                raise AssertionError(f"the server kept the connection open; it sent {out[:200]!r}")
            if not chunk:
                return out
            out += chunk
            if time.monotonic() > deadline:
                raise AssertionError("the server kept sending")

    def close(self):
        self.sock.close()


def resp_command(*args):
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def run(argv, timeout=120, **kw):
    return subprocess.run(argv, capture_output=True, timeout=timeout, **kw)


# --- redis-py, synchronous ----------------------------------------------------------------------


def test_canary_stored_first(server, canary):
    check_canary(server, canary)


def test_ping_echo(r, server):
    assert r.ping() is True
    assert r.echo(b"a\r\nb\0c") == b"a\r\nb\0c"
    raw = Raw(server.resp_port)
    assert raw.send(b"PING\r\n").line() == b"+PONG"
    assert raw.cmd("PING", "hello there") == b"hello there" and raw.last_type == b"$"
    assert raw.cmd("PING", "a", "b") == Err("ERR wrong number of arguments for 'ping' command")
    assert raw.cmd("ECHO") == Err("ERR wrong number of arguments for 'echo' command")
    raw.close()


def test_set_get_and_options(r):
    k = f"opt:{RUN}".encode()
    assert r.get(k) is None
    assert r.set(k, b"v1") is True
    assert r.get(k) == b"v1"
    assert r.set(k, b"v2", nx=True) is None  # NX on a present key: nil, nothing written
    assert r.get(k) == b"v1"
    assert r.set(k, b"v3", xx=True) is True
    assert r.get(k) == b"v3"
    missing = f"opt:{RUN}:missing".encode()
    assert r.set(missing, b"x", xx=True) is None  # XX on a missing key
    assert r.get(missing) is None
    assert r.set(missing, b"x", nx=True) is True
    assert r.get(missing) == b"x"
    # GET: the old value (nil when there was none), and the new one written.
    assert r.set(k, b"v4", get=True) == b"v3"
    assert r.get(k) == b"v4"
    fresh = f"opt:{RUN}:fresh".encode()
    assert r.set(fresh, b"f", get=True) is None
    assert r.get(fresh) == b"f"
    # NX GET (allowed since Redis 7.0): the old value, and nothing written.
    assert r.execute_command("SET", k, b"v5", "NX", "GET", get=True) == b"v4"
    assert r.get(k) == b"v4"
    assert r.execute_command("SET", f"opt:{RUN}:nxget".encode(), b"n", "NX", "GET", get=True) is None
    assert r.get(f"opt:{RUN}:nxget".encode()) == b"n"
    # XX GET on a missing key: nil, nothing written.
    assert r.execute_command("SET", f"opt:{RUN}:xxget".encode(), b"n", "XX", "GET", get=True) is None
    assert r.get(f"opt:{RUN}:xxget".encode()) is None
    # Options are case-insensitive.
    assert r.execute_command("SET", k, b"v6", "xx", "get", get=True) == b"v4"
    assert r.get(k) == b"v6"
    for bad in (["NX", "XX"], ["FOO"], ["GET", "GET", "FOO"]):
        with pytest.raises(redis.ResponseError, match="^syntax error$"):
            r.execute_command("SET", k, b"nope", *bad)
    assert r.get(k) == b"v6"


def now_ms():
    return int(time.time() * 1000)


def test_set_with_expiry(r, server):
    raw = Raw(server.resp_port)
    k = f"exp:{RUN}"
    assert raw.cmd("SET", k, b"v", "EX", "100") == "OK"
    assert 99 <= raw.cmd("TTL", k) <= 100
    assert 99_000 <= raw.cmd("PTTL", k) <= 100_000
    assert raw.cmd("SET", k, b"v", "PX", "50000") == "OK"
    assert 49 <= raw.cmd("TTL", k) <= 50
    at = int(time.time()) + 1000
    assert raw.cmd("SET", k, b"v", "EXAT", at) == "OK"
    assert raw.cmd("EXPIRETIME", k) == at
    assert raw.cmd("PEXPIRETIME", k) == at * 1000
    assert raw.cmd("SET", k, b"v", "PXAT", at * 1000 + 7) == "OK"
    assert raw.cmd("PEXPIRETIME", k) == at * 1000 + 7
    # KEEPTTL keeps it; a SET without it (and GETSET, MSET) drops it.
    assert raw.cmd("SET", k, b"w", "KEEPTTL") == "OK"
    assert raw.cmd("PEXPIRETIME", k) == at * 1000 + 7 and raw.cmd("GET", k) == b"w"
    assert raw.cmd("SET", k, b"x") == "OK"
    assert raw.cmd("TTL", k) == -1 and raw.cmd("EXPIRETIME", k) == -1
    assert raw.cmd("SET", k, b"y", "EX", "100", "GET") == b"x"
    assert raw.cmd("SET", k, b"z", "NX", "EX", "5") is None and raw.cmd("GET", k) == b"y"
    assert raw.cmd("SET", k, b"z", "XX", "PX", "5000", "GET") == b"y"
    assert 4000 <= raw.cmd("PTTL", k) <= 5000
    # The last of a repeated option wins, as in Redis.
    assert raw.cmd("SET", k, b"z", "EX", "5", "EX", "50") == "OK" and 49 <= raw.cmd("TTL", k) <= 50
    # Errors, word for word, and nothing changed by them.
    for bad, err in ((["EX", "0"], "ERR invalid expire time in 'set' command"),
                     (["PX", "-1"], "ERR invalid expire time in 'set' command"),
                     (["EX", "9223372036854775"], "ERR invalid expire time in 'set' command"),
                     (["EX", "ten"], "ERR value is not an integer or out of range"),
                     (["EX", "5", "PX", "5"], "ERR syntax error"),
                     (["KEEPTTL", "EX", "5"], "ERR syntax error"),
                     (["EX", "5", "KEEPTTL"], "ERR syntax error"),
                     (["EX"], "ERR syntax error"),
                     (["PERSIST"], "ERR syntax error")):
        assert raw.cmd("SET", k, b"bad", *bad) == Err(err), bad
    assert raw.cmd("GET", k) == b"z" and 40 <= raw.cmd("TTL", k) <= 50
    # SETEX, PSETEX
    assert raw.cmd("SETEX", k, "30", b"s") == "OK" and 29 <= raw.cmd("TTL", k) <= 30
    assert raw.cmd("PSETEX", k, "30000", b"p") == "OK" and raw.cmd("GET", k) == b"p"
    assert raw.cmd("SETEX", k, "0", b"s") == Err("ERR invalid expire time in 'setex' command")
    assert raw.cmd("PSETEX", k, "-5", b"s") == Err("ERR invalid expire time in 'psetex' command")
    assert raw.cmd("SETEX", k, "x", b"s") == Err("ERR value is not an integer or out of range")
    assert raw.cmd("SETEX", k, "5") == Err("ERR wrong number of arguments for 'setex' command")
    raw.close()


def test_expire_family(r, server):
    raw = Raw(server.resp_port)
    k, missing = f"expf:{RUN}", f"expf:{RUN}:missing"
    assert raw.cmd("SET", k, b"v") == "OK"
    assert raw.cmd("EXPIRE", missing, "10") == 0
    assert raw.cmd("TTL", missing) == -2 and raw.cmd("PTTL", missing) == -2
    assert raw.cmd("EXPIRETIME", missing) == -2 and raw.cmd("PERSIST", missing) == 0
    assert raw.cmd("PERSIST", k) == 0  # no deadline to remove
    # NX / XX / GT / LT
    assert raw.cmd("EXPIRE", k, "100", "XX") == 0 and raw.cmd("TTL", k) == -1
    assert raw.cmd("EXPIRE", k, "100", "GT") == 0  # no deadline counts as infinite
    assert raw.cmd("EXPIRE", k, "100", "NX") == 1 and 99 <= raw.cmd("TTL", k) <= 100
    assert raw.cmd("EXPIRE", k, "200", "NX") == 0
    assert raw.cmd("EXPIRE", k, "50", "GT") == 0 and raw.cmd("EXPIRE", k, "200", "GT") == 1
    assert raw.cmd("EXPIRE", k, "300", "LT") == 0 and raw.cmd("EXPIRE", k, "150", "LT") == 1
    assert 149 <= raw.cmd("TTL", k) <= 150
    assert raw.cmd("PEXPIRE", k, "120000", "xx") == 1 and 119_000 <= raw.cmd("PTTL", k) <= 120_000
    at = int(time.time()) + 500
    assert raw.cmd("EXPIREAT", k, at) == 1 and raw.cmd("EXPIRETIME", k) == at
    assert raw.cmd("PEXPIREAT", k, at * 1000 + 3) == 1 and raw.cmd("PEXPIRETIME", k) == at * 1000 + 3
    assert raw.cmd("GET", k) == b"v"  # the value is the same through all of it
    assert raw.cmd("PERSIST", k) == 1 and raw.cmd("TTL", k) == -1 and raw.cmd("GET", k) == b"v"
    for args, err in ((["EXPIRE", k, "10", "NX", "XX"], "ERR NX and XX, GT or LT options at the same time are not compatible"),
                      (["EXPIRE", k, "10", "NX", "GT"], "ERR NX and XX, GT or LT options at the same time are not compatible"),
                      (["EXPIRE", k, "10", "GT", "LT"], "ERR GT and LT options at the same time are not compatible"),
                      (["EXPIRE", k, "10", "SOON"], "ERR Unsupported option SOON"),
                      (["EXPIRE", k, "ten"], "ERR value is not an integer or out of range"),
                      (["EXPIRE", k, "9223372036854775807"], "ERR invalid expire time in 'expire' command"),
                      (["PEXPIRE", k, "9223372036854775807"], "ERR invalid expire time in 'pexpire' command"),
                      (["EXPIREAT", k, "-9223372036854775807"], "ERR invalid expire time in 'expireat' command"),
                      (["EXPIRE", k], "ERR wrong number of arguments for 'expire' command"),
                      (["TTL"], "ERR wrong number of arguments for 'ttl' command"),
                      (["PERSIST", k, k], "ERR wrong number of arguments for 'persist' command")):
        assert raw.cmd(*args) == Err(err), args
    assert raw.cmd("TTL", k) == -1 and raw.cmd("GET", k) == b"v"
    # A deadline in the past deletes the key at once, and says 1.
    assert raw.cmd("EXPIRE", k, "-1") == 1
    assert raw.cmd("GET", k) is None and raw.cmd("EXISTS", k) == 0
    assert raw.cmd("SET", k, b"v") == "OK" and raw.cmd("PEXPIREAT", k, "1") == 1 and raw.cmd("GET", k) is None
    assert r.set(k, b"v") and r.expire(k, 100) and 99 <= r.ttl(k) <= 100  # redis-py's way
    assert r.persist(k) and r.ttl(k) == -1
    raw.close()


def test_string_commands(r, server):
    raw = Raw(server.resp_port)
    b = f"str:{RUN}:"
    # GETEX
    assert raw.cmd("GETEX", b + "none") is None
    assert raw.cmd("GETEX", b + "none", "EX", "-1") is None  # no key: nil before the time is read
    assert raw.cmd("SET", b + "gx", b"val") == "OK"
    assert raw.cmd("GETEX", b + "gx") == b"val" and raw.cmd("TTL", b + "gx") == -1
    assert raw.cmd("GETEX", b + "gx", "EX", "100") == b"val" and 99 <= raw.cmd("TTL", b + "gx") <= 100
    assert raw.cmd("GETEX", b + "gx", "PX", "50000") == b"val" and 49 <= raw.cmd("TTL", b + "gx") <= 50
    at = int(time.time()) + 700
    assert raw.cmd("GETEX", b + "gx", "EXAT", at) == b"val" and raw.cmd("EXPIRETIME", b + "gx") == at
    assert raw.cmd("GETEX", b + "gx", "PERSIST") == b"val" and raw.cmd("TTL", b + "gx") == -1
    assert raw.cmd("GETEX", b + "gx", "EX", "0") == Err("ERR invalid expire time in 'getex' command")
    assert raw.cmd("GETEX", b + "gx", "EX", "1", "PX", "1") == Err("ERR syntax error")
    assert raw.cmd("GETEX", b + "gx", "NX") == Err("ERR syntax error")
    assert raw.cmd("GETEX", b + "gx", "KEEPTTL") == Err("ERR syntax error")
    assert raw.cmd("GETEX", b + "gx", "PXAT", "1") == b"val"  # past: answered, then deleted
    assert raw.cmd("EXISTS", b + "gx") == 0
    # GETDEL
    assert raw.cmd("SET", b + "gd", b"gone soon") == "OK"
    assert raw.cmd("GETDEL", b + "gd") == b"gone soon" and raw.cmd("GET", b + "gd") is None
    assert raw.cmd("GETDEL", b + "gd") is None
    # GETSET: the old value, and the deadline dropped
    assert raw.cmd("GETSET", b + "gs", b"one") is None
    assert raw.cmd("EXPIRE", b + "gs", "100") == 1
    assert raw.cmd("GETSET", b + "gs", b"two") == b"one" and raw.cmd("TTL", b + "gs") == -1
    assert raw.cmd("GET", b + "gs") == b"two"
    # SETNX, MSETNX
    assert raw.cmd("SETNX", b + "nx", b"first") == 1 and raw.cmd("SETNX", b + "nx", b"second") == 0
    assert raw.cmd("GET", b + "nx") == b"first"
    assert raw.cmd("MSETNX", b + "m1", b"1", b + "m2", b"2") == 1
    assert raw.cmd("MSETNX", b + "m3", b"3", b + "m1", b"x") == 0  # one present: none written
    assert raw.cmd("MGET", b + "m1", b + "m2", b + "m3") == [b"1", b"2", None]
    assert raw.cmd("MSETNX", b + "m3", b"3", b + "m4") == Err("ERR wrong number of arguments for 'msetnx' command")
    # APPEND keeps the deadline
    assert raw.cmd("APPEND", b + "ap", b"Hello") == 5
    assert raw.cmd("EXPIRE", b + "ap", "100") == 1
    assert raw.cmd("APPEND", b + "ap", b" World") == 11 and raw.cmd("GET", b + "ap") == b"Hello World"
    assert 99 <= raw.cmd("TTL", b + "ap") <= 100
    assert raw.cmd("APPEND", b + "ap", b"") == 11
    # SETRANGE: zero bytes fill a gap; the deadline is kept
    assert raw.cmd("SETRANGE", b + "ap", "6", b"Redis") == 11 and raw.cmd("GET", b + "ap") == b"Hello Redis"
    assert 99 <= raw.cmd("TTL", b + "ap") <= 100
    assert raw.cmd("SETRANGE", b + "sr", "5", b"x") == 6 and raw.cmd("GET", b + "sr") == b"\0" * 5 + b"x"
    assert raw.cmd("SETRANGE", b + "empty", "5", b"") == 0 and raw.cmd("EXISTS", b + "empty") == 0
    assert raw.cmd("SETRANGE", b + "sr", "100", b"") == 6
    assert raw.cmd("SETRANGE", b + "sr", "-1", b"x") == Err("ERR offset is out of range")
    assert raw.cmd("SETRANGE", b + "sr", "one", b"x") == Err("ERR value is not an integer or out of range")
    assert raw.cmd("SETRANGE", b + "sr", "4294967296000", b"x") == \
        Err("ERR string exceeds maximum allowed size (proto-max-bulk-len)")
    assert raw.cmd("GET", b + "sr") == b"\0" * 5 + b"x"
    # A value large enough to be sent in place goes through the same commands.
    big = os.urandom(300_000)
    assert raw.cmd("SET", b + "big", big, "EX", "100") == "OK"
    assert raw.cmd("APPEND", b + "big", b"tail") == len(big) + 4
    assert raw.cmd("GETEX", b + "big", "PERSIST") == big + b"tail"
    assert raw.cmd("GETRANGE", b + "big", "-4", "-1") == b"tail" and raw.cmd("STRLEN", b + "big") == len(big) + 4
    raw.close()


def test_counters_touch_time_randomkey(r, server):
    raw = Raw(server.resp_port)
    b = f"ctr:{RUN}:"
    assert raw.cmd("INCR", b + "n") == 1 and raw.cmd("INCRBY", b + "n", "41") == 42
    assert raw.cmd("DECR", b + "n") == 41 and raw.cmd("DECRBY", b + "n", "-9") == 50
    assert raw.cmd("GET", b + "n") == b"50"
    assert raw.cmd("EXPIRE", b + "n", "100") == 1 and raw.cmd("INCR", b + "n") == 51
    assert 99 <= raw.cmd("TTL", b + "n") <= 100  # the deadline is kept
    for bad in (b"abc", b"01", b"-0", b" 1", b"1 ", b"+1", b"1.5", b"99999999999999999999"):
        assert raw.cmd("SET", b + "bad", bad) == "OK"
        assert raw.cmd("INCR", b + "bad") == Err("ERR value is not an integer or out of range"), bad
    assert raw.cmd("INCRBY", b + "n", "x") == Err("ERR value is not an integer or out of range")
    assert raw.cmd("SET", b + "max", "9223372036854775807") == "OK"
    assert raw.cmd("INCR", b + "max") == Err("ERR increment or decrement would overflow")
    assert raw.cmd("DECRBY", b + "max", "-9223372036854775808") == Err("ERR decrement would overflow")
    assert raw.cmd("SET", b + "min", "-9223372036854775808") == "OK"
    assert raw.cmd("DECR", b + "min") == Err("ERR increment or decrement would overflow")
    assert raw.cmd("GET", b + "max") == b"9223372036854775807"
    # INCRBYFLOAT, formatted as Redis formats long doubles
    assert raw.cmd("SET", b + "f", "10.50") == "OK"
    assert raw.cmd("INCRBYFLOAT", b + "f", "0.1") == b"10.6"
    assert raw.cmd("INCRBYFLOAT", b + "f", "-5") == b"5.6"
    assert raw.cmd("SET", b + "f", "5.0e3") == "OK" and raw.cmd("INCRBYFLOAT", b + "f", "2.0e2") == b"5200"
    assert raw.cmd("INCRBYFLOAT", b + "g", "-0.0") == b"0"
    assert raw.cmd("INCRBYFLOAT", b + "g", "1.5") == b"1.5"
    assert raw.cmd("INCRBYFLOAT", b + "g", "abc") == Err("ERR value is not a valid float")
    assert raw.cmd("INCRBYFLOAT", b + "g", " 1") == Err("ERR value is not a valid float")
    assert raw.cmd("INCRBYFLOAT", b + "g", "inf") == Err("ERR increment would produce NaN or Infinity")
    assert raw.cmd("SET", b + "bad", b"x") == "OK"
    assert raw.cmd("INCRBYFLOAT", b + "bad", "1") == Err("ERR value is not a valid float")
    # TOUCH, TIME, RANDOMKEY
    assert raw.cmd("TOUCH", b + "n", b + "f", b + "none", b + "n") == 3
    t = raw.cmd("TIME")
    assert len(t) == 2 and abs(int(t[0]) - time.time()) < 5 and 0 <= int(t[1]) < 1_000_000
    k = raw.cmd("RANDOMKEY")
    assert isinstance(k, bytes) and raw.cmd("EXISTS", k) == 1
    assert raw.cmd("TIME", "x") == Err("ERR wrong number of arguments for 'time' command")
    raw.close()


def test_copy_rename_type(r, server):
    raw = Raw(server.resp_port)
    b = f"cr:{RUN}:"
    assert raw.cmd("SET", b + "src", b"payload", "EX", "100") == "OK"
    assert raw.cmd("COPY", b + "src", b + "dst") == 1
    assert raw.cmd("GET", b + "dst") == b"payload" and 99 <= raw.cmd("TTL", b + "dst") <= 100
    assert raw.cmd("COPY", b + "src", b + "dst") == 0  # present: not replaced
    assert raw.cmd("SET", b + "src", b"newer") == "OK"
    assert raw.cmd("COPY", b + "src", b + "dst", "REPLACE") == 1
    assert raw.cmd("GET", b + "dst") == b"newer" and raw.cmd("TTL", b + "dst") == -1
    assert raw.cmd("COPY", b + "none", b + "dst2") == 0
    assert raw.cmd("COPY", b + "src", b + "src") == Err("ERR source and destination objects are the same")
    assert raw.cmd("COPY", b + "src", b + "x", "DB", "zero") == Err("ERR value is not an integer or out of range")
    assert raw.cmd("COPY", b + "src", b + "x", "FOO") == Err("ERR syntax error")
    assert raw.cmd("COPY", b + "src", b + "x", "DB", "0") == 1
    assert raw.cmd("COPY", b + "src", b + "x", "DB", "0") == 0
    # RENAME: the value and its deadline move; the old name is gone
    assert raw.cmd("EXPIRE", b + "src", "200") == 1
    assert raw.cmd("RENAME", b + "src", b + "moved") == "OK"
    assert raw.cmd("GET", b + "src") is None and raw.cmd("GET", b + "moved") == b"newer"
    assert 199 <= raw.cmd("TTL", b + "moved") <= 200
    assert raw.cmd("RENAME", b + "src", b + "y") == Err("ERR no such key")
    assert raw.cmd("RENAMENX", b + "src", b + "y") == Err("ERR no such key")
    assert raw.cmd("RENAME", b + "moved", b + "moved") == "OK" and raw.cmd("GET", b + "moved") == b"newer"
    assert raw.cmd("RENAMENX", b + "moved", b + "moved") == 0
    assert raw.cmd("RENAME", b + "moved", b + "dst") == "OK"  # over a present key
    assert raw.cmd("GET", b + "dst") == b"newer" and raw.cmd("EXISTS", b + "moved") == 0
    assert raw.cmd("RENAMENX", b + "dst", b + "x") == 0 and raw.cmd("GET", b + "dst") == b"newer"
    assert raw.cmd("RENAMENX", b + "dst", b + "fresh") == 1 and raw.cmd("GET", b + "fresh") == b"newer"
    assert raw.cmd("TYPE", b + "fresh") == "string" and raw.cmd("TYPE", b + "dst") == "none"
    raw.close()


def test_a_key_is_never_returned_after_its_deadline(server):
    """Keys with deadlines 150-400 ms away, read in every way a client can, from before until after
    their deadlines: nothing read after a key's deadline (as the client knows it, an upper bound of
    the server's) returns it. Large values (sent in place) and pipelined GETs included.

    redis-server reads a clock it caches once per turn of its event loop (up to a cron period,
    100 ms, old after a sleep), so it is given that much slack; sparsekvd reads the clock for
    every record and is given none."""
    slack = 0.11 if REDIS_MODE else 0.0
    raw = Raw(server.resp_port)
    c = redis.Redis(host="127.0.0.1", port=server.resp_port, socket_timeout=30)
    base = f"dl:{RUN}:"
    keys = [f"{base}{i}" for i in range(40)]
    values = {k: (os.urandom(70_000) if i % 4 == 0 else b"v%d" % i) for i, k in enumerate(keys)}
    keep = base + "kept"
    c.set(keep, b"no deadline")
    deadlines = {}
    for i, k in enumerate(keys):
        ms = 150 + 7 * i
        c.set(k, values[k], px=ms)
        deadlines[k] = time.monotonic() + ms / 1000  # the server's deadline is at or before this
    seen_after = []
    end = max(deadlines.values()) + 0.3
    while time.monotonic() < end:
        t = time.monotonic()
        pipe = c.pipeline(transaction=False)
        for k in keys:
            pipe.get(k)
        got = pipe.execute()
        got_m = c.mget(keys)
        ex = [c.exists(k) for k in keys[::5]]
        for k, g, gm in zip(keys, got, got_m):
            if t > deadlines[k] + slack and (g is not None or gm is not None):
                seen_after.append(k)
            if g is not None:
                assert g == values[k]
        for k, e in zip(keys[::5], ex):
            if t > deadlines[k] + slack and e:
                seen_after.append(k)
    assert not seen_after, f"{len(set(seen_after))} keys returned after their deadline"
    for k in keys:
        assert raw.cmd("GET", k) is None and raw.cmd("STRLEN", k) == 0 and raw.cmd("TTL", k) == -2
        assert raw.cmd("GETRANGE", k, "0", "-1") == b"" and raw.cmd("TYPE", k) == "none"
    listed = set(c.keys(base + "*"))
    assert listed == {keep.encode()}
    assert {k for k in c.scan_iter(match=base + "*", count=100)} == {keep.encode()}
    # Active expiry: the records go without being read again (DBSIZE counts them until then).
    for k in keys:
        c.set(k, b"x", px=100)
    before = c.dbsize()
    deadline = time.monotonic() + 5
    while c.dbsize() > before - len(keys) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert c.dbsize() <= before - len(keys), "expired keys were not deleted without being read"
    assert c.get(keep) == b"no deadline"
    if not REDIS_MODE:
        assert int(c.info("stats")["expired_keys"]) >= len(keys)
    c.close()
    raw.close()


@sparsekv_only
def test_expiry_holds_across_restart_and_kill_9():
    """Deadlines are in the records: after SIGKILL, and after a clean restart, a key keeps its
    deadline, one past its deadline is never returned, and the ones that expire while the
    daemon was down are deleted by active expiry (learnt from the records) without being read."""
    d = Daemon(resp=True, host_bytes="64MiB", ssd_bytes="256MiB", write_policy="write-through")
    try:
        c = redis.Redis(host="127.0.0.1", port=d.resp_port)
        c.set("long", b"L" * 5000, ex=1000)
        at = int(time.time()) + 2000
        c.set("absolute", b"A", exat=at)
        c.set("short", b"S" * 100, px=1500)
        c.set("plain", b"P")
        for i in range(50):
            c.set(f"soon:{i}", b"s", px=1200)
        t_set = time.monotonic()
        c.close()
        d.kill_and_restart()
        c = redis.Redis(host="127.0.0.1", port=d.resp_port)
        assert 990 <= c.ttl("long") <= 1000 and c.get("long") == b"L" * 5000
        assert c.expiretime("absolute") == at and c.get("plain") == b"P" and c.ttl("plain") == -1
        time.sleep(max(0.0, t_set + 1.6 - time.monotonic()))
        assert c.get("short") is None and c.ttl("short") == -2
        # the 50 never read after the restart: deleted by active expiry
        deadline = time.monotonic() + 5
        while c.dbsize() > 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.dbsize() == 3, sorted(c.keys("*"))
        c.expire("plain", 1000)
        c.close()
        d.proc.send_signal(signal.SIGTERM)  # a clean stop, then a start on the same directory
        assert d.proc.wait(timeout=20) == 0
        d._launch()
        c = redis.Redis(host="127.0.0.1", port=d.resp_port)
        assert 990 <= c.ttl("plain") <= 1000 and c.get("plain") == b"P"
        assert 980 <= c.ttl("long") <= 1000
        c.close()
    finally:
        assert d.stop() == 0


@sparsekv_only
def test_bridge_keys_take_no_expiry(r):
    k = "0123456789abcdef" * 2
    assert r.set(k, b"native bytes") is True
    with pytest.raises(redis.ResponseError, match="bridge key"):
        r.expire(k, 100)
    with pytest.raises(redis.ResponseError, match="bridge key"):
        r.set(k, b"x", ex=100)
    assert r.get(k) == b"native bytes" and r.ttl(k) == -1
    assert r.delete(k) == 1


def test_mset_mget(r, server):
    base = f"m:{RUN}:"
    assert r.mset({base + "a": b"1", base + "b": b"", base + "c": b"\0\r\n"}) is True
    assert r.mget([base + "a", base + "missing", base + "b", base + "c", base + "missing2", base + "a"]) == \
        [b"1", None, b"", b"\0\r\n", None, b"1"]
    assert r.mget([base + "nope"]) == [None]
    # MSET overwrites, the last of a repeated key wins.
    assert r.execute_command("MSET", base + "a", b"x", base + "a", b"y") is True
    assert r.get(base + "a") == b"y"
    raw = Raw(server.resp_port)
    assert raw.cmd("MSET", "a") == Err("ERR wrong number of arguments for 'mset' command")
    assert raw.cmd("MSET", "a", "b", "c") == Err("ERR wrong number of arguments for 'mset' command")
    assert raw.cmd("MGET") == Err("ERR wrong number of arguments for 'mget' command")
    raw.close()


def test_exists_del_unlink(r):
    a, b, c = (f"e:{RUN}:{x}" for x in "abc")
    r.mset({a: b"1", b: b"2", c: b"3"})
    assert r.exists(a) == 1
    assert r.exists(a, a, a) == 3  # each repetition counted
    assert r.exists(a, f"e:{RUN}:missing", b, a) == 3
    assert r.exists(f"e:{RUN}:missing") == 0
    assert r.delete(a, a, f"e:{RUN}:missing") == 1  # a key removed once
    assert r.exists(a) == 0
    assert r.get(a) is None
    assert r.unlink(b, c, b) == 2
    assert r.mget([a, b, c]) == [None, None, None]
    assert r.delete(f"e:{RUN}:missing") == 0
    assert r.unlink(f"e:{RUN}:missing") == 0


def test_strlen_getrange(r, server):
    k = f"g:{RUN}"
    r.set(k, b"Hello World")
    assert r.strlen(k) == 11
    assert r.strlen(f"g:{RUN}:missing") == 0
    cases = {(0, 3): b"Hell", (-3, -1): b"rld", (0, -1): b"Hello World", (10, 100): b"d", (100, 200): b"",
             (5, 3): b"", (-100, 2): b"Hel", (-1, -1): b"d", (11, 11): b"", (-11, 0): b"H", (3, -100): b"",
             (0, 0): b"H", (6, 10): b"World", (-5, 100): b"World",
             # Redis 7.0 clamps a negative end past the start to 0, so this is "H", not "".
             (0, -100): b"H"}
    for (s, e), want in cases.items():
        assert r.getrange(k, s, e) == want, (s, e)
    assert r.getrange(f"g:{RUN}:missing", 0, -1) == b""
    r.set(k + ":empty", b"")
    assert r.strlen(k + ":empty") == 0
    assert r.getrange(k + ":empty", 0, -1) == b""
    assert r.getrange(k + ":empty", -1, 0) == b""
    big = random.Random(3).randbytes(300000)
    r.set(k + ":big", big)
    assert r.strlen(k + ":big") == len(big)
    assert r.getrange(k + ":big", 123456, 223455) == big[123456:223456]
    assert r.getrange(k + ":big", -10, -1) == big[-10:]
    raw = Raw(server.resp_port)
    assert raw.cmd("GETRANGE", k, "0", "x") == Err("ERR value is not an integer or out of range")
    assert raw.cmd("GETRANGE", k, "0") == Err("ERR wrong number of arguments for 'getrange' command")
    assert raw.cmd("STRLEN") == Err("ERR wrong number of arguments for 'strlen' command")
    raw.close()


def test_binary_keys_and_values(r):
    keys = [b"\0", b"\r\n", b"k\r\nv\0\xff", bytes(range(256)), b" spaced key ", b"*1\r\n$4\r\nPING\r\n", b"$-1"]
    values = {f"bin:{RUN}:".encode() + k: bytes(range(256))[::-1] + k + b"\r\n\0" for k in keys}
    for k, v in values.items():
        assert r.set(k, v) is True
    for k, v in values.items():
        assert r.get(k) == v
        assert r.strlen(k) == len(v)
    assert r.mget(list(values)) == list(values.values())
    assert r.exists(*values) == len(values)
    assert r.delete(*values) == len(values)


@pytest.mark.parametrize("size", [0, 1, 4096, 1 << 20, 6 << 20], ids=["0B", "1B", "4KiB", "1MiB", "6MiB"])
def test_value_sizes(r, size):
    k = f"size:{RUN}:{size}"
    v = os.urandom(size)
    assert r.set(k, v) is True
    got = r.get(k)
    assert got is not None and len(got) == size and got == v
    assert r.strlen(k) == size
    assert r.exists(k) == 1  # an empty value is a value
    if size:
        assert r.getrange(k, size - 1, size - 1) == v[-1:]
    assert r.delete(k) == 1
    assert r.get(k) is None


def test_scan(r, server):
    prefix = f"scan:{RUN}:"
    names = [f"{prefix}{i}" for i in range(300)] + [f"{prefix}x{i}" for i in range(20)]
    pipe = r.pipeline(transaction=False)
    for n in names:
        pipe.set(n, n.encode())
    pipe.execute()
    everything = set(n.encode() for n in names)
    for match, count in [(prefix + "*", None), (prefix + "*", 7), (prefix + "1*", 5), (prefix + "x?", 1000),
                         (prefix + "2[0-4]", 3), (prefix + "nothing*", 10)]:
        got = list(r.scan_iter(match=match, count=count))
        want = {n for n in everything if fnmatch.fnmatchcase(n.decode(), match)}
        assert len(got) == len(set(got)), f"SCAN {match} {count} returned a key twice"
        assert set(got) == want, (match, count)
    # The whole keyspace, cursor by cursor: every key of this test, and DBSIZE keys in all.
    raw = Raw(server.resp_port)
    cursor, seen, rounds = b"0", [], 0
    while True:
        reply = raw.cmd("SCAN", cursor, "COUNT", 50)
        assert raw.last_type == b"*" and len(reply) == 2, reply
        assert isinstance(reply[0], bytes) and reply[0].isdigit(), reply[0]  # the cursor: a bulk string
        cursor, batch = reply
        seen.extend(batch)
        rounds += 1
        if cursor == b"0":
            break
        assert rounds < 100000
    assert everything <= set(seen)
    assert len(set(seen)) == r.dbsize()
    assert raw.cmd("SCAN", "abc") == Err("ERR invalid cursor")
    assert raw.cmd("SCAN", "0", "COUNT", "x") == Err("ERR value is not an integer or out of range")
    assert raw.cmd("SCAN", "0", "COUNT", "0") == Err("ERR syntax error")
    assert raw.cmd("SCAN", "0", "BOGUS", "1") == Err("ERR syntax error")
    raw.close()
    assert r.delete(*names) == len(names)


def test_dbsize_flushdb(r, server):
    before = r.dbsize()
    names = [f"db:{RUN}:{i}" for i in range(5)]
    r.mset({n: b"v" for n in names})
    assert r.dbsize() == before + 5
    r.set(names[0], b"overwritten")
    assert r.dbsize() == before + 5
    assert r.delete(names[0], names[1]) == 2
    assert r.dbsize() == before + 3
    # FLUSHDB empties its own keyspace only.
    other = other_db(server)
    other.mset({f"flush:{RUN}:{i}": b"x" for i in range(10)})
    assert other.dbsize() >= 10
    assert other.flushdb() is True
    assert other.dbsize() == 0
    assert other.get(f"flush:{RUN}:1") is None
    assert other.execute_command("FLUSHDB", "ASYNC") is True
    other.close()
    assert r.dbsize() == before + 3
    assert r.mget(names[2:]) == [b"v"] * 3
    r.delete(*names)
    raw = Raw(server.resp_port)
    assert raw.cmd("DBSIZE", "x") == Err("ERR wrong number of arguments for 'dbsize' command")
    raw.close()


def test_keys_and_flushall():
    """KEYS with Redis's globs, and FLUSHALL [ASYNC|SYNC], on a server of their own (FLUSHALL
    would empty the shared one). On sparsekvd both act within the caller's namespace: FLUSHALL
    from one namespace leaves another's keys; on Redis it empties every db."""
    s = RedisServer() if REDIS_MODE else Daemon(resp=True, namespaces=(("default", ""), ("alpha", "alpha-token")))
    try:
        r = redis.Redis(host="127.0.0.1", port=s.resp_port, socket_timeout=30)
        if REDIS_MODE:
            other = redis.Redis(host="127.0.0.1", port=s.resp_port, db=1, socket_timeout=30)
        else:
            other = redis.Redis(host="127.0.0.1", port=s.resp_port, username="alpha", password="alpha-token",
                                socket_timeout=30)
        names = [b"user:1", b"user:2", b"user:10", b"item:1", b"u\x00bin", b"h?llo", b"hello", b"hallo"]
        r.mset({n: b"v" for n in names})
        other.set(b"user:other", b"x")
        assert sorted(r.keys("*")) == sorted(names)
        assert sorted(r.keys("user:*")) == [b"user:1", b"user:10", b"user:2"]
        assert sorted(r.keys("user:?")) == [b"user:1", b"user:2"]
        assert sorted(r.keys("h[ae]llo")) == [b"hallo", b"hello"]
        assert r.keys("h\\?llo") == [b"h?llo"]
        assert r.keys("nothing*") == []
        assert sorted(other.keys("*")) == [b"user:other"], "KEYS showed another keyspace's keys"
        raw = Raw(s.resp_port)
        assert raw.cmd("KEYS") == Err("ERR wrong number of arguments for 'keys' command")
        assert raw.cmd("KEYS", "a", "b") == Err("ERR wrong number of arguments for 'keys' command")
        assert raw.cmd("FLUSHALL", "NOW") == Err("ERR syntax error")
        raw.close()
        assert r.flushall() is True
        assert r.keys("*") == [] and r.dbsize() == 0 and r.get(b"user:1") is None
        if REDIS_MODE:
            assert other.dbsize() == 0
        else:
            assert other.get(b"user:other") == b"x", "FLUSHALL emptied another namespace"
        r.set(b"again", b"1")
        assert r.execute_command("FLUSHALL", "ASYNC") is True
        assert r.execute_command("FLUSHALL", "SYNC") is True
        assert r.dbsize() == 0
        r.close()
        other.close()
    finally:
        assert s.stop() == 0


def test_type_ttl(r, server):
    k = f"t:{RUN}"
    r.set(k, b"v")
    assert r.type(k) == b"string"
    assert r.type(k + ":missing") == b"none"
    assert r.ttl(k) == -1
    assert r.ttl(k + ":missing") == -2
    raw = Raw(server.resp_port)
    assert raw.cmd("TYPE") == Err("ERR wrong number of arguments for 'type' command")
    raw.close()


def test_info(r, server):
    r.set(f"info:{RUN}", b"v")
    raw = Raw(server.resp_port)
    text = raw.cmd("INFO").decode()
    assert raw.last_type == b"$"
    headers = {line[2:].strip().lower() for line in text.splitlines() if line.startswith("# ")}
    assert {"server", "clients", "memory", "stats", "keyspace"} <= headers, headers
    assert "\r\n" in text  # lines end CRLF, as in Redis
    clients = r.info("clients")
    assert clients["connected_clients"] >= 1
    keyspace = r.info("keyspace")
    assert keyspace["db0"]["keys"] == r.dbsize()
    # One section asked for: that section alone.
    only = raw.cmd("INFO", "keyspace").decode()
    assert [line for line in only.splitlines() if line.startswith("#")] == ["# Keyspace"]
    assert re.search(r"^db0:keys=%d,expires=\d+,avg_ttl=\d+\r$" % r.dbsize(), only, re.M), only
    memory = raw.cmd("INFO", "MEMORY").decode()
    assert [line.lower() for line in memory.splitlines() if line.startswith("#")] == ["# memory"]
    raw.close()


@sparsekv_only
def test_info_sparsekv_section(server):
    raw = Raw(server.resp_port)
    text = raw.cmd("INFO", "sparsekv").decode()
    lines = text.splitlines()
    assert lines[0].strip().lower() == "# sparsekv", lines[:3]
    assert any("host" in line for line in lines[1:] if ":" in line), text
    everything = raw.cmd("INFO").decode()  # INFO with no section includes it
    assert "# sparsekv" in everything.lower()
    raw.close()


def test_config_get(r):
    assert r.config_get("save") == {"save": ""}
    assert r.config_get("appendonly") == {"appendonly": "no"}
    assert r.config_get("no-such-parameter-anywhere") == {}


def test_command(r, server):
    table = r.command()
    assert table["get"]["arity"] == 2
    assert table["set"]["arity"] == -3
    assert table["mget"]["arity"] == -2
    assert table["get"]["first_key_pos"] == 1
    for name in ["ping", "echo", "hello", "auth", "client", "select", "quit", "get", "set", "mget", "mset",
                 "exists", "del", "unlink", "strlen", "getrange", "dbsize", "scan", "type", "ttl", "info",
                 "config", "command", "flushdb"]:
        assert name in table, name
    assert r.execute_command("COMMAND COUNT") == len(table)
    docs = r.execute_command("COMMAND DOCS", "get")
    assert docs[0] == b"get"
    assert b"summary" in docs[1][0::2]


def test_client_commands(r, server):
    assert r.client_setname("resp-test") is True
    assert r.client_getname() == "resp-test"
    a = r.client_id()
    b = redis.Redis(host="127.0.0.1", port=server.resp_port)
    assert isinstance(a, int) and isinstance(b.client_id(), int) and a != b.client_id()
    assert b.client_getname() is None
    b.close()
    raw = Raw(server.resp_port)
    assert raw.cmd("CLIENT", "SETNAME", "a b") == \
        Err("ERR Client names cannot contain spaces, newlines or special characters.")
    assert raw.cmd("CLIENT") == Err("ERR wrong number of arguments for 'client' command")
    raw.close()


CLIENT_FIELDS = ["id", "addr", "laddr", "fd", "name", "age", "idle", "flags", "db", "sub", "psub", "ssub", "multi",
                 "qbuf", "qbuf-free", "argv-mem", "multi-mem", "rbs", "rbp", "obl", "oll", "omem", "tot-mem", "events",
                 "cmd", "user", "redir", "resp"]


def parse_client_list(text):
    text = text.decode() if isinstance(text, bytes) else text
    out = []
    for line in text.splitlines():
        pairs = [kv.split("=", 1) for kv in line.split(" ")]
        assert [k for k, _ in pairs] == CLIENT_FIELDS, line
        out.append(dict(pairs))
    return out


def test_client_list_and_kill(server):
    a, b = Raw(server.resp_port), Raw(server.resp_port)
    assert a.cmd("CLIENT", "SETNAME", "lister") == "OK"
    assert b.cmd("CLIENT", "SETNAME", "victim") == "OK" and b.cmd("PING") == "PONG"
    ida, idb = a.cmd("CLIENT", "ID"), b.cmd("CLIENT", "ID")
    clients = {int(c["id"]): c for c in parse_client_list(a.cmd("CLIENT", "LIST"))}
    assert ida in clients and idb in clients
    me, other = clients[ida], clients[idb]
    assert me["name"] == "lister" and me["cmd"] == "client|list" and me["db"] == "0" and me["resp"] == "2"
    assert other["name"] == "victim" and other["cmd"] in ("ping", "client|id") and other["flags"] == "N"
    assert me["addr"] == "127.0.0.1:%d" % a.sock.getsockname()[1]
    assert me["laddr"] == "127.0.0.1:%d" % server.resp_port
    info = parse_client_list(a.cmd("CLIENT", "INFO"))
    assert len(info) == 1 and int(info[0]["id"]) == ida and info[0]["cmd"] == "client|info"
    listed = parse_client_list(a.cmd("CLIENT", "LIST", "ID", idb, 999999999))
    assert [int(c["id"]) for c in listed] == [idb]
    assert a.cmd("CLIENT", "LIST", "ID", "x") == Err("ERR Invalid client ID")
    assert int(parse_client_list(a.cmd("CLIENT", "LIST", "TYPE", "normal"))[0]["id"]) > 0
    assert a.cmd("CLIENT", "LIST", "TYPE", "pubsub") in (b"", "")
    assert a.cmd("CLIENT", "LIST", "TYPE", "nobody") == Err("ERR Unknown client type 'nobody'")
    assert a.cmd("CLIENT", "LIST", "FOO") == Err("ERR syntax error")
    # KILL: by id (new form: a count), by address (old form: OK or an error)
    assert a.cmd("CLIENT", "KILL", "ID", idb) == 1
    with pytest.raises((EOFError, ConnectionResetError)):
        b.cmd("PING")
    assert a.cmd("CLIENT", "KILL", "ID", idb) == 0
    assert a.cmd("CLIENT", "KILL", "ID", "0") == Err("ERR client-id should be greater than 0")
    assert a.cmd("CLIENT", "KILL", "TYPE", "nobody") == Err("ERR Unknown client type 'nobody'")
    assert a.cmd("CLIENT", "KILL", "ID", ida) == 0  # SKIPME yes by default
    assert a.cmd("CLIENT", "KILL", "SKIPME", "maybe") == Err("ERR syntax error")
    assert a.cmd("CLIENT", "KILL", "1.2.3.4:5") == Err("ERR No such client")
    assert a.cmd("CLIENT", "KILL") == Err("ERR wrong number of arguments for 'client|kill' command")
    c = Raw(server.resp_port)
    assert c.cmd("PING") == "PONG"
    assert a.cmd("CLIENT", "KILL", "127.0.0.1:%d" % c.sock.getsockname()[1]) == "OK"
    with pytest.raises((EOFError, ConnectionResetError)):
        c.cmd("PING")
    assert a.cmd("CLIENT", "KILL", "ADDR", "127.0.0.1:%d" % a.sock.getsockname()[1], "SKIPME", "no") == 1
    with pytest.raises((EOFError, ConnectionResetError)):
        a.cmd("PING")  # the caller closed itself, after its reply
    for x in (a, b, c):
        x.close()


def test_client_reply_and_function_flush(server):
    raw = Raw(server.resp_port)
    # CLIENT LIST counts the request being served in the caller's query buffer, as Redis does.
    me = parse_client_list(raw.cmd("CLIENT", "LIST"))
    mine = [c for c in me if c["cmd"] == "client|list"]
    assert len(mine) == 1 and mine[0]["qbuf"] == "26" and mine[0]["argv-mem"] == "10"
    # OFF: nothing answered until ON; SKIP: the next request's reply alone is dropped.
    raw.send(resp_command("CLIENT", "REPLY", "OFF") + resp_command("SET", f"rep:{RUN}", "1") +
             resp_command("PING") + resp_command("CLIENT", "REPLY", "ON"))
    assert raw.reply() == "OK"
    assert raw.cmd("GET", f"rep:{RUN}") == b"1"  # served while not answered
    raw.send(resp_command("CLIENT", "REPLY", "SKIP") + resp_command("ECHO", "dropped") + resp_command("ECHO", "kept"))
    assert raw.reply() == b"kept"
    raw.send(resp_command("CLIENT", "REPLY", "SKIP") + resp_command("CLIENT", "REPLY", "ON"))
    assert raw.reply() == "OK"  # ON after SKIP is answered
    assert raw.cmd("CLIENT", "REPLY", "MAYBE") == Err("ERR syntax error")
    # FUNCTION FLUSH (Redis's test suite sends it before every file): nothing to flush here.
    assert raw.cmd("FUNCTION", "FLUSH") == "OK" and raw.cmd("FUNCTION", "FLUSH", "SYNC") == "OK"
    assert raw.cmd("FUNCTION", "FLUSH", "NOW") == Err("ERR FUNCTION FLUSH only supports SYNC|ASYNC option")
    assert raw.cmd("FUNCTION", "LIST") == []
    raw.close()


def test_monitor(server):
    mon = Raw(server.resp_port)
    assert mon.cmd("MONITOR") == "OK"
    c = Raw(server.resp_port)
    port = c.sock.getsockname()[1]
    assert c.cmd("SET", f"mon:{RUN}", b'a "q"\\\n\x01') == "OK"
    assert c.cmd("GET", f"mon:{RUN}") == b'a "q"\\\n\x01'
    lines = [mon.line().decode(), mon.line().decode()]
    for line, words in zip(lines, ('"SET" "mon:%s" "a \\"q\\"\\\\\\n\\x01"' % RUN, '"GET" "mon:%s"' % RUN)):
        m = re.fullmatch(r'\+(\d+)\.(\d{6}) \[0 127\.0\.0\.1:(\d+)\] (.*)', line)
        assert m, line
        assert abs(int(m.group(1)) - time.time()) < 5 and int(m.group(3)) == port
        assert m.group(4).lower() == words.lower(), (m.group(4), words)
    c.close()
    mon.close()


def test_monitor_sees_a_large_set_begun_before_it(server):
    """A MONITOR that starts while a large SET's value is arriving still sees that SET."""
    k = f"monbig:{RUN}"
    v = b"m" * ((2 << 20) + 1)
    data = resp_command("SET", k, v)
    c = Raw(server.resp_port, timeout=30)
    c.send(data[:1 << 20])
    time.sleep(0.2)
    mon = Raw(server.resp_port, timeout=30)
    assert mon.cmd("MONITOR") == "OK"
    c.send(data[1 << 20:])
    assert c.reply() == "OK"
    line = mon.line()
    assert re.fullmatch(rb'\+\d+\.\d{6} \[0 [^\]]+\] "SET" "%s" "m{%d}"' % (k.encode(), len(v)), line), line[:200]
    assert c.cmd("DEL", k) == 1
    c.close()
    mon.close()


@sparsekv_only
def test_monitor_sees_only_its_namespace(server):
    mon = redis.Redis(host="127.0.0.1", port=server.resp_port, username="alpha", password="alpha-token")
    conn = mon.connection_pool.get_connection("MONITOR")
    conn.send_command("MONITOR")
    assert conn.read_response() in (b"OK", "OK", True)
    other = Raw(server.resp_port)  # namespace default
    assert other.cmd("SET", f"secret:{RUN}", b"not for alpha") == "OK"
    alpha = redis.Redis(host="127.0.0.1", port=server.resp_port, username="alpha", password="alpha-token")
    alpha.set(f"visible:{RUN}", b"1")
    line = conn.read_response()
    line = line.decode() if isinstance(line, bytes) else line
    assert f"visible:{RUN}" in line and "secret" not in line, line
    conn.disconnect()
    other.close()
    alpha.close()


@sparsekv_only
def test_client_list_and_kill_stay_in_the_namespace(server):
    mine = Raw(server.resp_port)
    theirs = redis.Redis(host="127.0.0.1", port=server.resp_port, username="alpha", password="alpha-token")
    their_id = theirs.client_id()
    theirs.client_setname("alpha-client")
    listed = parse_client_list(mine.cmd("CLIENT", "LIST"))
    assert their_id not in [int(c["id"]) for c in listed] and all(c["user"] == "default" for c in listed)
    assert mine.cmd("CLIENT", "LIST", "ID", their_id) in (b"", "")
    assert mine.cmd("CLIENT", "KILL", "ID", their_id) == 0
    assert mine.cmd("CLIENT", "KILL", "USER", "alpha") == 0
    assert mine.cmd("CLIENT", "KILL", "USER", "nobody") == Err("ERR No such user 'nobody'")
    assert theirs.ping() is True
    alpha_view = parse_client_list(theirs.execute_command("CLIENT", "LIST"))
    assert [c["user"] for c in alpha_view] == ["alpha"] and alpha_view[0]["name"] == "alpha-client"
    theirs.close()
    mine.close()


def test_config_set(server):
    raw = Raw(server.resp_port)
    old = raw.cmd("CONFIG", "GET", "proto-max-bulk-len")
    old_bulk = (dict(zip(old[::2], old[1::2])) if isinstance(old, list) else old)[b"proto-max-bulk-len"]
    assert raw.cmd("CONFIG", "SET", "timeout", "0") == "OK"
    got = raw.cmd("CONFIG", "GET", "timeout")
    assert got in ([b"timeout", b"0"], {b"timeout": b"0"})
    assert raw.cmd("CONFIG", "SET", "timeout", "300", "proto-max-bulk-len", str(2 << 20)) == "OK"
    got = raw.cmd("CONFIG", "GET", "proto-max-bulk-len")
    assert got in ([b"proto-max-bulk-len", str(2 << 20).encode()], {b"proto-max-bulk-len": str(2 << 20).encode()})
    # The new limit holds at once: a larger value is refused, as Redis refuses it.
    big = Raw(server.resp_port)
    big.send(b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$%d\r\n" % (3 << 20))
    assert big.reply() == Err("ERR Protocol error: invalid bulk length")
    big.close()
    assert raw.cmd("CONFIG", "SET", "nosuchthing", "1") == \
        Err("ERR Unknown option or number of arguments for CONFIG SET - 'nosuchthing'")
    assert raw.cmd("CONFIG", "SET", "timeout", "1", "timeout", "2") == \
        Err("ERR CONFIG SET failed (possibly related to argument 'timeout') - duplicate parameter")
    assert raw.cmd("CONFIG", "SET", "timeout", "5", "nosuchthing") == Err("ERR syntax error")
    assert raw.cmd("CONFIG", "SET", "timeout") == Err("ERR wrong number of arguments for 'config|set' command")
    # all or nothing: a bad pair leaves the good one unset
    assert isinstance(raw.cmd("CONFIG", "SET", "timeout", "7", "nosuchthing", "1"), Err)
    assert raw.cmd("CONFIG", "GET", "timeout") in ([b"timeout", b"300"], {b"timeout": b"300"})
    assert raw.cmd("CONFIG", "SET", "save", "") == "OK" and raw.cmd("CONFIG", "SET", "appendonly", "no") == "OK"
    assert raw.cmd("CONFIG", "SET", "timeout", "0", "proto-max-bulk-len", old_bulk) == "OK"
    raw.close()


@sparsekv_only
def test_config_set_refuses_what_sparsekvd_sets_in_its_file(server):
    raw = Raw(server.resp_port)
    for name, value in (("maxmemory", "1gb"), ("maxclients", "5"), ("appendonly", "yes"), ("save", "60 1")):
        reply = raw.cmd("CONFIG", "SET", name, value)
        assert isinstance(reply, Err) and reply.startswith(
            f"ERR CONFIG SET failed (possibly related to argument '{name}') - "), reply
    reply = raw.cmd("CONFIG", "SET", "proto-max-bulk-len", str(1 << 40))
    assert isinstance(reply, Err) and "at most" in reply
    raw.close()


@pytest.mark.skipif(REDIS_MODE, reason="redis-server 7.0 predates CLIENT SETINFO (7.2)")
def test_client_setinfo(r):
    assert r.execute_command("CLIENT SETINFO", "lib-name", "redis-py") in (True, b"OK")
    assert r.execute_command("CLIENT SETINFO", "lib-ver", "4.3.4") in (True, b"OK")


def test_select_hello_quit(r, server):
    assert r.execute_command("SELECT", 0) is True
    raw = Raw(server.resp_port)
    assert raw.cmd("SELECT", "16") == Err("ERR DB index is out of range")
    assert raw.cmd("SELECT", "-1") == Err("ERR DB index is out of range")
    assert raw.cmd("SELECT", "x") == Err("ERR value is not an integer or out of range")
    hello = raw.cmd("HELLO")
    assert isinstance(hello, list) and raw.last_type == b"*"
    fields = dict(zip(hello[0::2], hello[1::2]))
    assert fields[b"proto"] == 2
    hello2 = raw.cmd("HELLO", "2")
    assert dict(zip(hello2[0::2], hello2[1::2]))[b"proto"] == 2
    assert raw.cmd("QUIT") == "OK"
    assert raw.until_close() == b""
    raw.close()


@sparsekv_only
def test_select_other_db_is_refused(server):
    raw = Raw(server.resp_port)
    assert raw.cmd("SELECT", "1") == Err("ERR DB index is out of range")
    assert raw.cmd("SELECT", "0") == "OK"
    raw.close()


def test_errors_exact_text(server):
    raw = Raw(server.resp_port)
    assert raw.cmd("xyz", "a", "b") == Err("ERR unknown command 'xyz', with args beginning with: 'a' 'b' ")
    assert raw.cmd("NOSUCH") == Err("ERR unknown command 'NOSUCH', with args beginning with: ")
    assert raw.cmd("GET") == Err("ERR wrong number of arguments for 'get' command")
    assert raw.cmd("GET", "a", "b") == Err("ERR wrong number of arguments for 'get' command")
    assert raw.cmd("SET", "a") == Err("ERR wrong number of arguments for 'set' command")
    assert raw.cmd("SET", "a", "b", "foo") == Err("ERR syntax error")
    assert raw.cmd("EXISTS") == Err("ERR wrong number of arguments for 'exists' command")
    assert raw.cmd("CONFIG", "GET") == Err("ERR wrong number of arguments for 'config|get' command")
    assert raw.cmd("PING") == "PONG"  # the connection goes on after every error
    raw.close()


def test_inline_commands(server):
    raw = Raw(server.resp_port)
    k = f"inline:{RUN}"
    raw.send(f'SET {k} "hello world"\r\nGET {k}\r\n'.encode())
    assert raw.reply() == "OK"
    assert raw.reply() == b"hello world"
    raw.send(f"SET {k}:2 'single quoted'\r\nGET {k}:2\r\n".encode())
    assert raw.reply() == "OK"
    assert raw.reply() == b"single quoted"
    raw.send(f"  EXISTS   {k}   {k}:2   {k}:none  \r\n".encode())
    assert raw.reply() == 2
    raw.send(b"\r\n\r\nPING\r\n")  # empty lines are skipped, no reply
    assert raw.line() == b"+PONG"
    raw.send(b"PING\n")  # a bare LF ends an inline command too
    assert raw.line() == b"+PONG"
    raw.close()


def test_resp3(server):
    raw = Raw(server.resp_port)
    k = f"r3:{RUN}"
    hello = raw.cmd("HELLO", "3", "SETNAME", "three")
    assert raw.last_type == b"%" and isinstance(hello, dict)
    assert hello[b"proto"] == 3
    assert raw.cmd("CLIENT", "GETNAME") == b"three"
    assert raw.cmd("SET", k, b"v\r\n") == "OK"
    assert raw.cmd("GET", k) == b"v\r\n" and raw.last_type == b"$"
    assert raw.cmd("GET", k + ":missing") is NULL3 and raw.last_type == b"_"
    assert raw.cmd("MGET", k, k + ":missing") == [b"v\r\n", NULL3]
    assert raw.cmd("EXISTS", k, k) == 2 and raw.last_type == b":"
    assert raw.cmd("SET", k, b"w", "GET") == b"v\r\n"
    assert raw.cmd("SET", k, b"x", "NX") is NULL3
    cfg = raw.cmd("CONFIG", "GET", "appendonly")
    if raw.last_type == b"%":
        assert cfg == {b"appendonly": b"no"}
    else:
        assert cfg == [b"appendonly", b"no"]
    info = raw.cmd("INFO", "keyspace")
    assert raw.last_type in (b"$", b"=") and b"# Keyspace" in info
    err = raw.cmd("NOSUCH")
    assert isinstance(err, Err) and err.startswith("ERR unknown command")
    # Back to RESP2: nil is $-1 again.
    hello = raw.cmd("HELLO", "2")
    assert raw.last_type == b"*" and dict(zip(hello[0::2], hello[1::2]))[b"proto"] == 2
    raw.send(resp_command("GET", k + ":missing"))
    assert raw.line() == b"$-1"
    raw.send(resp_command("MGET", k + ":missing"))
    assert raw.line() == b"*1" and raw.line() == b"$-1"
    raw.close()


def _redis_py_speaks_resp3():
    try:
        redis.Redis(protocol=3)
        return True
    except TypeError:
        return False


@pytest.mark.skipif(not _redis_py_speaks_resp3(), reason=f"redis-py {redis.__version__} has no protocol=3 (5.0+); "
                    "RESP3 is checked over a raw socket in test_resp3")
def test_resp3_redis_py(server):
    c = redis.Redis(host="127.0.0.1", port=server.resp_port, protocol=3)
    k = f"r3py:{RUN}"
    assert c.set(k, b"three") is True
    assert c.get(k) == b"three"
    assert c.get(k + ":missing") is None
    assert c.mget([k, k + ":missing"]) == [b"three", None]
    assert c.exists(k, k) == 2
    assert c.delete(k) == 1
    c.close()


def test_pipeline_1000(r):
    pipe = r.pipeline(transaction=False)
    for i in range(1000):
        pipe.set(f"pl:{RUN}:{i}", b"%d" % (i * i))
    assert pipe.execute() == [True] * 1000
    pipe = r.pipeline(transaction=False)
    for i in range(1000):
        pipe.get(f"pl:{RUN}:{i}")
    pipe.get(f"pl:{RUN}:missing")
    pipe.exists(f"pl:{RUN}:0", f"pl:{RUN}:999")
    assert pipe.execute() == [b"%d" % (i * i) for i in range(1000)] + [None, 2]
    pipe = r.pipeline(transaction=False)
    for i in range(1000):
        pipe.delete(f"pl:{RUN}:{i}")
    assert pipe.execute() == [1] * 1000


def test_unix_socket(server):
    raw = Raw(unix=server.resp_unix_path)
    assert raw.cmd("SET", f"unix:{RUN}", b"over unix") == "OK"
    raw.close()
    c = redis.Redis(unix_socket_path=server.resp_unix_path)
    assert c.get(f"unix:{RUN}") == b"over unix"
    c.close()


# --- redis.asyncio, as LMCache's Redis connector uses it ----------------------------------------


def test_asyncio_150_connections(server):
    tasks, kv_size = 150, 256 << 10

    async def main():
        pool = redis.asyncio.ConnectionPool(host="127.0.0.1", port=server.resp_port, max_connections=150)
        client = redis.asyncio.Redis(connection_pool=pool)

        async def one(i):
            key = f"lmc:{RUN}:{i}@chunk"
            kv = random.Random(i).randbytes(kv_size)
            meta = json.dumps({"shape": [2, 16, 64, 128], "dtype": "bf16", "i": i}).encode()
            assert await client.set(key + "kv_bytes", kv) is True
            assert await client.set(key + "metadata", meta) is True
            assert await client.exists(key + "kv_bytes") == 1
            assert await client.exists(key + "metadata") == 1
            got_meta = await client.get(key + "metadata")
            got_kv = await client.get(key + "kv_bytes")
            assert got_meta == meta
            assert got_kv == kv, f"task {i}: kv_bytes differ"
            assert await client.delete(key + "kv_bytes", key + "metadata") == 2
            assert await client.exists(key + "kv_bytes", key + "metadata") == 0
            return len(got_kv)

        results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(tasks))), timeout=120)
        created = pool._created_connections  # grown only when every made connection was in use
        await client.close()
        await pool.disconnect()
        return results, created

    results, created = asyncio.run(main())
    assert results == [kv_size] * tasks
    assert created >= 100, f"only {created} connections were open at once"


# --- namespaces and AUTH ------------------------------------------------------------------------


def test_auth_required(auth_server):
    raw = Raw(auth_server.resp_port)
    assert raw.send(b"GET a\r\n").line() == b"-NOAUTH Authentication required."
    assert raw.cmd("PING") == Err("NOAUTH Authentication required.")
    assert raw.cmd("SET", "a", "b") == Err("NOAUTH Authentication required.")
    assert raw.cmd("SELECT", "0") == Err("NOAUTH Authentication required.")
    hello = raw.cmd("HELLO", "3")
    assert isinstance(hello, Err) and hello.startswith("NOAUTH "), hello
    wrongpass = Err("WRONGPASS invalid username-password pair or user is disabled.")
    assert raw.cmd("AUTH", "wrong") == wrongpass
    assert raw.cmd("AUTH", "alpha", "beta-token") == wrongpass
    assert raw.cmd("AUTH", "nosuchnamespace", "alpha-token") == wrongpass
    assert raw.cmd("HELLO", "3", "AUTH", "alpha", "bad") == wrongpass
    assert raw.cmd("GET", "a") == Err("NOAUTH Authentication required.")
    assert raw.cmd("AUTH") == Err("ERR wrong number of arguments for 'auth' command")
    assert raw.cmd("AUTH", "a", "b", "c") == Err("ERR syntax error")
    # AUTH with the token alone: namespace "default".
    assert raw.cmd("AUTH", "default-token") == "OK"
    assert raw.cmd("SET", f"auth:{RUN}", b"in default") == "OK"
    assert raw.cmd("PING") == "PONG"
    assert raw.cmd("QUIT") == "OK"
    raw.close()
    # HELLO 3 AUTH: authenticated and RESP3 in one.
    raw = Raw(auth_server.resp_port)
    hello = raw.cmd("HELLO", "3", "AUTH", "default", "default-token")
    assert raw.last_type == b"%" and hello[b"proto"] == 3
    assert raw.cmd("GET", f"auth:{RUN}") == b"in default"
    raw.close()
    # QUIT needs no AUTH.
    raw = Raw(auth_server.resp_port)
    assert raw.cmd("QUIT") == "OK"
    assert raw.until_close() == b""
    raw.close()


def test_auth_with_redis_py(auth_server):
    c = redis.Redis(host="127.0.0.1", port=auth_server.resp_port, username="alpha", password="alpha-token")
    assert c.set(f"rp:{RUN}", b"alpha's") is True
    assert c.get(f"rp:{RUN}") == b"alpha's"
    c.close()
    c = redis.Redis(host="127.0.0.1", port=auth_server.resp_port, password="default-token")
    assert c.ping() is True
    c.close()
    c = redis.Redis(host="127.0.0.1", port=auth_server.resp_port, username="alpha", password="wrong")
    with pytest.raises((redis.ResponseError, redis.AuthenticationError)) as e:  # 4.3: ResponseError
        c.ping()
    assert str(e.value) == "WRONGPASS invalid username-password pair or user is disabled."
    c.close()
    c = redis.Redis(host="127.0.0.1", port=auth_server.resp_port)
    with pytest.raises(redis.AuthenticationError, match="Authentication required"):
        c.get("a")
    c.close()


@sparsekv_only
def test_namespaces_are_isolated(server, auth_server):
    alpha = redis.Redis(host="127.0.0.1", port=server.resp_port, username="alpha", password="alpha-token")
    beta = redis.Redis(host="127.0.0.1", port=server.resp_port, username="beta", password="beta-token")
    default = redis.Redis(host="127.0.0.1", port=server.resp_port)
    k = f"iso:{RUN}"
    assert alpha.set(k, b"alpha's") is True
    assert beta.get(k) is None
    assert default.get(k) is None
    assert beta.exists(k) == 0
    assert beta.set(k, b"beta's") is True
    assert alpha.get(k) == b"alpha's"
    assert beta.get(k) == b"beta's"
    assert default.set(k, b"default's") is True
    assert alpha.mget([k]) == [b"alpha's"]
    # SCAN and DBSIZE see one namespace.
    assert k.encode() in set(alpha.scan_iter(match=k))
    assert beta.delete(k) == 1
    assert alpha.get(k) == b"alpha's"
    assert default.get(k) == b"default's"
    assert list(beta.scan_iter(match=k)) == []
    beta.set(f"{k}:b", b"1")
    assert beta.flushdb() is True
    assert beta.dbsize() == 0
    assert alpha.get(k) == b"alpha's" and default.get(k) == b"default's"
    # AUTH on an open connection moves it into another namespace.
    raw = Raw(server.resp_port)
    assert raw.cmd("GET", k) == b"default's"
    assert raw.cmd("AUTH", "alpha", "alpha-token") == "OK"
    assert raw.cmd("GET", k) == b"alpha's"
    assert raw.cmd("AUTH", "alpha", "wrong") == Err("WRONGPASS invalid username-password pair or user is disabled.")
    assert raw.cmd("GET", k) == b"alpha's"  # a failed AUTH leaves the connection where it was
    raw.close()
    # The same namespace name on another daemon is another keyspace; AUTH <token> is "default".
    other = Raw(auth_server.resp_port)
    assert other.cmd("AUTH", "alpha", "alpha-token") == "OK"
    assert other.cmd("GET", k) is None
    other.close()
    for c in (alpha, beta, default):
        c.delete(k)
        c.close()


# --- redis-cli ----------------------------------------------------------------------------------


def test_redis_cli_arguments(server):
    cli = need_tool("redis-cli")
    p = ["-h", "127.0.0.1", "-p", str(server.resp_port)]
    k = f"cli:{RUN}"
    out = run([cli, *p, "SET", k, "hello world"])
    assert out.returncode == 0 and out.stdout == b"OK\n", out
    assert run([cli, *p, "GET", k]).stdout == b"hello world\n"
    assert run([cli, *p, "--no-raw", "GET", k]).stdout == b'"hello world"\n'
    assert run([cli, *p, "--no-raw", "GET", k + ":missing"]).stdout == b"(nil)\n"
    assert run([cli, *p, "--no-raw", "EXISTS", k, k]).stdout == b"(integer) 2\n"
    assert run([cli, *p, "--no-raw", "MGET", k, k + ":missing"]).stdout == b'1) "hello world"\n2) (nil)\n'
    assert run([cli, *p, "STRLEN", k]).stdout == b"11\n"
    err = run([cli, *p, "NOSUCHCMD", "x"])
    assert err.stdout.startswith(b"ERR unknown command 'NOSUCHCMD'"), err
    assert run([cli, *p, "--no-raw", "DEL", k]).stdout == b"(integer) 1\n"
    assert run([cli, "-s", server.resp_unix_path, "PING"]).stdout == b"PONG\n"
    # INFO keyspace as redis-cli shows it.
    dbsize = int(run([cli, *p, "DBSIZE"]).stdout)
    info = run([cli, *p, "INFO", "keyspace"]).stdout.decode()
    m = re.search(r"^db0:keys=(\d+),", info, re.M)
    assert m and int(m.group(1)) == dbsize, info


def test_redis_cli_pipe_scan_bigkeys(server):
    cli = need_tool("redis-cli")
    p = ["-h", "127.0.0.1", "-p", str(server.resp_port)]
    prefix = f"pipe:{RUN}:"
    data = b"".join(resp_command("SET", f"{prefix}{i}", f"value-{i}-" + "x" * (i % 97)) for i in range(10000))
    out = run([cli, *p, "--pipe"], input=data)
    assert out.returncode == 0, out
    assert b"errors: 0, replies: 10000" in out.stdout, out.stdout
    c = redis.Redis(host="127.0.0.1", port=server.resp_port)
    sample = [0, 1, 4999, 9998, 9999] + random.Random(5).sample(range(10000), 50)
    assert c.mget([f"{prefix}{i}" for i in sample]) == [f"value-{i}-{'x' * (i % 97)}".encode() for i in sample]
    # --pipe counts error replies.
    bad = run([cli, *p, "--pipe"], input=resp_command("SET", f"{prefix}e", "v") + resp_command("NOSUCH"))
    assert bad.returncode == 1 and b"errors: 1, replies: 2" in bad.stdout, bad
    # --scan walks SCAN with MATCH.
    scanned = run([cli, *p, "--scan", "--pattern", prefix + "*"]).stdout.split(b"\n")
    assert len(scanned) == 10002 and scanned[-1] == b""  # 10000 + "e", and the last newline
    assert set(scanned[:-1]) == {f"{prefix}{i}".encode() for i in range(10000)} | {f"{prefix}e".encode()}
    # --bigkeys: SCAN, TYPE and STRLEN over the whole keyspace.
    big = run([cli, *p, "--bigkeys"])
    assert big.returncode == 0, big
    m = re.search(rb"Sampled (\d+) keys in the keyspace", big.stdout)
    assert m and int(m.group(1)) == c.dbsize(), big.stdout[-2000:]
    assert b"Biggest string found" in big.stdout
    c.close()


def test_redis_cli_auth(auth_server):
    cli = need_tool("redis-cli")
    p = ["-h", "127.0.0.1", "-p", str(auth_server.resp_port), "--no-auth-warning"]
    k = f"cliauth:{RUN}"
    out = run([cli, *p, "--user", "alpha", "-a", "alpha-token", "SET", k, "alpha value"])
    assert out.stdout == b"OK\n", out
    assert run([cli, *p, "--user", "alpha", "--pass", "alpha-token", "GET", k]).stdout == b"alpha value\n"
    assert run([cli, *p, "-a", "default-token", "PING"]).stdout == b"PONG\n"
    noauth = run([cli, *p, "GET", k])
    assert noauth.stdout.startswith(b"NOAUTH Authentication required."), noauth
    wrong = run([cli, *p, "--user", "alpha", "-a", "nope", "GET", k])
    assert b"WRONGPASS invalid username-password pair or user is disabled." in wrong.stderr + wrong.stdout, wrong
    if not REDIS_MODE:  # alpha's key is alpha's alone
        assert run([cli, *p, "--user", "beta", "-a", "beta-token", "--no-raw", "GET", k]).stdout == b"(nil)\n"


# --- redis-benchmark ----------------------------------------------------------------------------


def parse_quiet(text):
    rates = {}
    for piece in re.split(r"[\r\n]", text):
        m = re.match(r"\s*([A-Z_]+): ([\d.]+) requests per second", piece)
        if m:
            rates[m.group(1)] = float(m.group(2))
    return rates


@pytest.mark.parametrize("pipeline", [1, 16])
def test_redis_benchmark(server, pipeline):
    bench = need_tool("redis-benchmark")
    out = run([bench, "-h", "127.0.0.1", "-p", str(server.resp_port), "-t", "set,get", "-n", "2000", "-c", "8",
               "-d", "4096", "-P", str(pipeline), "-q"], timeout=120)
    text = out.stdout.decode() + out.stderr.decode()
    assert out.returncode == 0, text
    rates = parse_quiet(text)
    assert set(rates) == {"SET", "GET"}, text
    assert all(v > 0 for v in rates.values()), rates
    c = redis.Redis(host="127.0.0.1", port=server.resp_port)
    assert c.strlen("key:__rand_int__") == 4096  # the key redis-benchmark's SET writes without -r
    c.close()


def test_redis_benchmark_csv(server):
    bench = need_tool("redis-benchmark")
    out = run([bench, "-h", "127.0.0.1", "-p", str(server.resp_port), "-t", "set,get", "-n", "2000", "-c", "8",
               "-d", "4096", "-r", "1000", "--csv"], timeout=120)
    assert out.returncode == 0, out
    # Printed (without -q) when its CONFIG GET save / CONFIG GET appendonly fail.
    assert b"Could not fetch server CONFIG" not in out.stdout + out.stderr, out
    rows = [line.split(",") for line in out.stdout.decode().splitlines() if line.startswith('"')]
    header = [h.strip('"') for h in rows[0]]
    assert header[:2] == ["test", "rps"], header
    table = {row[0].strip('"'): float(row[1].strip('"')) for row in rows[1:]}
    assert set(table) == {"SET", "GET"} and all(v > 0 for v in table.values()), table


# --- hostile input ------------------------------------------------------------------------------


@pytest.mark.parametrize("data, reply", [
    (b"*1\r\n$2147483648\r\n", b"-ERR Protocol error: invalid bulk length\r\n"),
    (b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$2147483648\r\n", b"-ERR Protocol error: invalid bulk length\r\n"),
    (b"*1\r\n$-3\r\n", b"-ERR Protocol error: invalid bulk length\r\n"),
    (b"*1\r\n$x\r\n", b"-ERR Protocol error: invalid bulk length\r\n"),
    (b"*2147483648\r\n", b"-ERR Protocol error: invalid multibulk length\r\n"),
    (b"*99999999999999999999\r\n", b"-ERR Protocol error: invalid multibulk length\r\n"),
    (b"*x\r\n", b"-ERR Protocol error: invalid multibulk length\r\n"),
    (b'SET "a b\r\n', b"-ERR Protocol error: unbalanced quotes in request\r\n"),
    (b"SET 'a b\r\n", b"-ERR Protocol error: unbalanced quotes in request\r\n"),
    (b'SET "a"b c\r\n', b"-ERR Protocol error: unbalanced quotes in request\r\n"),
    (b"*1\r\nfoo\r\n", None),  # "-ERR Protocol error: expected '$', got 'f'" in Redis 7.0
], ids=["bulk-2^31", "3rd-bulk-2^31", "bulk-negative", "bulk-garbage", "multibulk-2^31", "multibulk-overflow",
        "multibulk-garbage", "unbalanced-double", "unbalanced-single", "quote-then-text", "no-dollar"])
def test_protocol_errors_close(server, canary, data, reply):
    other = Raw(server.resp_port)  # connected before, served after
    raw = Raw(server.resp_port)
    assert raw.cmd("PING") == "PONG"
    raw.send(data)
    got = raw.until_close()
    if reply is None:
        assert got.startswith(b"-ERR Protocol error: ") and got.endswith(b"\r\n") and got.count(b"\r\n") == 1, got
    else:
        assert got == reply
    raw.close()
    assert other.cmd("PING") == "PONG"
    other.close()
    check_canary(server, canary)


def test_negative_multibulk_is_ignored(server):
    raw = Raw(server.resp_port)
    raw.send(b"*-5\r\n*-1\r\n*0\r\n*1\r\n$4\r\nPING\r\n")
    assert raw.line() == b"+PONG"
    raw.close()


def test_unterminated_then_close(server, canary):
    k = f"half:{RUN}"
    for data in [resp_command("SET", k, "v")[:-7], b"*3\r\n$3\r\nSET\r\n", b"*3\r\n$3\r\nSE", b"SET " + k.encode(),
                 b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$100000\r\n" % (len(k), k.encode()) + b"x" * 50000]:
        raw = Raw(server.resp_port)
        raw.send(data)
        raw.close()
    c = redis.Redis(host="127.0.0.1", port=server.resp_port)
    assert c.get(k) is None  # never completed, never run
    c.close()
    check_canary(server, canary)


def test_huge_bulk_declared_then_silence(server, canary):
    """A client that announces a 100 MB value and sends nothing more holds no one else up."""
    raw = Raw(server.resp_port)
    raw.send(b"*3\r\n$3\r\nSET\r\n$1\r\nh\r\n$100000000\r\n" + b"y" * 1000)
    other = redis.Redis(host="127.0.0.1", port=server.resp_port, socket_timeout=10)
    assert other.ping() is True
    assert other.set(f"hb:{RUN}", b"ok") is True and other.get(f"hb:{RUN}") == b"ok"
    other.close()
    raw.close()
    check_canary(server, canary)


def test_100000_pipelined_pings_unread(server, canary):
    raw = Raw(server.resp_port, timeout=10)
    data = b"PING\r\n" * 50000 + b"*1\r\n$4\r\nPING\r\n" * 50000
    try:
        raw.sock.sendall(data)  # the server may stop reading while its replies go unread: fine
    except (socket.timeout, OSError):
        pass
    raw.close()  # unread replies: the close is a reset
    time.sleep(0.2)
    check_canary(server, canary)
    # And one that reads them all back.
    raw = Raw(server.resp_port, timeout=30)
    sender = threading.Thread(target=raw.sock.sendall, args=(b"PING\r\n" * 100000,))
    sender.start()
    got = 0
    while got < 100000 * 7:
        chunk = raw.sock.recv(1 << 20)
        assert chunk
        got += len(chunk)
    sender.join()
    assert got == 100000 * 7
    raw.close()


def test_slowloris_blocks_no_one(server, canary):
    raw = Raw(server.resp_port, timeout=10)
    request = b"*2\r\n$4\r\nECHO\r\n$4\r\nslow\r\n"
    done = threading.Event()

    def drip():
        try:
            for i in range(len(request)):  # one byte per 100 ms for the first second
                raw.sock.sendall(request[i:i + 1])
                time.sleep(0.1 if i < 10 else 0.01)
        finally:
            done.set()

    t = threading.Thread(target=drip)
    t.start()
    c = redis.Redis(host="127.0.0.1", port=server.resp_port, socket_timeout=5)
    served_meanwhile, worst = 0, 0.0
    deadline = time.monotonic() + 30
    while not done.is_set() and time.monotonic() < deadline:
        start = time.monotonic()
        assert c.set(f"sl:{RUN}", b"v%d" % served_meanwhile) is True
        assert c.get(f"sl:{RUN}") == b"v%d" % served_meanwhile
        worst = max(worst, time.monotonic() - start)
        if not done.is_set():
            served_meanwhile += 1
        time.sleep(0.01)
    t.join()
    assert served_meanwhile >= 10, f"only {served_meanwhile} requests were served during the slow one"
    assert worst < 1.0, f"a request took {worst:.2f} s while a slow client dripped"
    assert raw.reply() == b"slow"  # the slow request is served once whole
    raw.close()
    c.close()
    check_canary(server, canary)


# --- large SETs: sparsekvd reads a value of 1 MiB or more straight into host memory ------------
# (RespConnection::StartRoom). Whatever path a value takes, a client sees Redis's behaviour.


def test_large_sets_land_whole_and_the_requests_behind_them_are_served(r, server):
    rnd = random.Random(11)
    values = {f"big:{RUN}:{n}": rnd.randbytes(n) for n in (1 << 20, (1 << 20) + 1, (3 << 20) + 7, 6 << 20)}
    for k, v in values.items():
        assert r.set(k, v) is True
    for k, v in values.items():
        assert r.get(k) == v
    # One write: a large SET, then requests; the bytes after the value are requests, not value.
    raw = Raw(server.resp_port, timeout=30)
    k = f"big:{RUN}:tail"
    v = rnd.randbytes((2 << 20) + 3)
    raw.send(resp_command("SET", k, v) + resp_command("PING") + resp_command("GET", k) + resp_command("STRLEN", k))
    assert raw.reply() == "OK"
    assert raw.reply() == "PONG"
    assert raw.reply() == v
    assert raw.reply() == len(v)
    # The same, dripped in pieces that split the value's header, its bytes and its CRLF.
    k2 = f"big:{RUN}:drip"
    v2 = rnd.randbytes((1 << 20) + 9)
    data = resp_command("SET", k2, v2) + resp_command("GET", k2)
    cuts = sorted({1, 20, 30, 40, 4096, 500000, len(data) - len(resp_command("GET", k2)) - 1, len(data) - 5})
    last = 0
    for c in cuts + [len(data)]:
        raw.send(data[last:c])
        last = c
        time.sleep(0.01)
    assert raw.reply() == "OK"
    assert raw.reply() == v2
    raw.close()
    # Pipelined through redis-py, large and small mixed, each key written twice.
    p = r.pipeline(transaction=False)
    want = {}
    for i in range(12):
        key = f"big:{RUN}:p{i % 6}"
        want[key] = rnd.randbytes(rnd.choice([100, 70000, 1 << 20, (2 << 20) + i]))
        p.set(key, want[key])
    assert p.execute() == [True] * 12
    assert r.mget(list(want)) == list(want.values())
    assert r.delete(*values, k, k2, *want) == len(values) + 2 + len(want)


def test_a_large_set_finishing_last_wins(server):
    """Two connections SET one key; the one whose request arrives whole last wins, as in Redis,
    even when its large value started arriving first."""
    k = f"race:{RUN}"
    big = os.urandom(3 << 20)
    slow = Raw(server.resp_port, timeout=30)
    data = resp_command("SET", k, big)
    slow.send(data[:1 << 20])
    time.sleep(0.2)
    fast = redis.Redis(host="127.0.0.1", port=server.resp_port, socket_timeout=30)
    assert fast.set(k, b"small") is True
    assert fast.get(k) == b"small"
    slow.send(data[1 << 20:])
    assert slow.reply() == "OK"
    assert fast.get(k) == big
    # And the other way round: the large SET answered first, then a small one.
    assert fast.set(k, b"after") is True
    assert fast.get(k) == b"after"
    assert fast.delete(k) == 1
    fast.close()
    slow.close()


def test_a_large_set_cut_off_or_malformed_stores_nothing_and_holds_no_memory(server, canary):
    """Large SETs broken off mid-value, with a bad CRLF, or left hanging: nothing is stored, no
    older value is lost, and the memory they took is all back (more than the host tier's size is
    declared in all)."""
    c = redis.Redis(host="127.0.0.1", port=server.resp_port, socket_timeout=30)
    k = f"cut:{RUN}"
    assert c.set(k, b"before") is True
    declared = 8 << 20
    head = b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(k), k.encode(), declared)
    for i in range(80):  # 640 MiB declared, against a 512 MiB host tier
        raw = Raw(server.resp_port)
        raw.send(head + b"z" * (64 << 10 if i % 2 else 3 << 20))
        raw.close()
    if not REDIS_MODE:
        # The value whole, then no CRLF: a protocol error, and the connection closed (Redis
        # skips the two bytes unread and stores the value).
        raw = Raw(server.resp_port, timeout=30)
        raw.send(head + b"q" * declared + b"XX")
        assert b"Protocol error" in raw.until_close(timeout=30)
    # Left hanging on many connections at once, while others are served.
    hanging = []
    for _ in range(24):
        h = Raw(server.resp_port)
        h.send(head + b"h" * (1 << 20))
        hanging.append(h)
    time.sleep(0.2)
    assert c.get(k) == b"before"
    full = os.urandom(declared)
    assert c.set(f"{k}:full", full) is True and c.get(f"{k}:full") == full
    for h in hanging:
        h.close()
    time.sleep(0.5)
    # Everything the broken requests took is back: the largest values still fit, many at once.
    keep = {f"{k}:after{i}": os.urandom(declared) for i in range(24)}
    for key, v in keep.items():
        assert c.set(key, v) is True
    assert c.get(k) == b"before"
    assert c.get(f"{k}:after23") == keep[f"{k}:after23"]
    assert c.delete(k, f"{k}:full", *keep) == 2 + len(keep)
    c.close()
    check_canary(server, canary)


@sparsekv_only
def test_a_large_set_past_its_deadline_is_cut_off():
    """A client that stops mid-value is closed at the frame deadline; its room goes back, and
    the wait of a connection that is only slow to send does not make anyone else wait."""
    d = Daemon(resp=True, host_bytes="64MiB", extra_config={"frame_timeout_ms": 1000})
    try:
        k = b"deadline"
        head = b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(k), k, 15 << 20)
        stalled = [Raw(d.resp_port, timeout=10) for _ in range(3)]
        for s in stalled:
            s.send(head + b"s" * (2 << 20))
        c = redis.Redis(host="127.0.0.1", port=d.resp_port, socket_timeout=10)
        assert c.set(b"other", b"v") is True
        for s in stalled:
            assert s.until_close(timeout=10) == b""  # closed at the deadline, unanswered
        assert c.get(k) is None
        # The stalled ones held 15 MiB of the 64 MiB tier (a room, within the pin budget's quarter)
        # and buffers; with that back, 4 x 15 MiB fit, none evicted.
        vals = [os.urandom(15 << 20) for _ in range(4)]
        for i, v in enumerate(vals):
            assert c.set(b"after%d" % i, v) is True
        assert [c.get(b"after%d" % i) for i in range(4)] == vals
        c.close()
    finally:
        assert d.stop() == 0


@sparsekv_only
def test_put_in_place_bytes_sets_which_values_are_received_into_host_memory():
    """The config key put_in_place_bytes (4 MiB here): a SET of a 6 MiB value, held mid-value,
    has its room in the host tier (charged to the pin budget), one of 2 MiB does not; with 0,
    none does. Each SET then lands whole."""
    import urllib.request

    def pinned(mport):
        text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10).read().decode()
        return int(float(re.search(r"^sparsekv_pinned_reply_bytes (\S+)$", text, re.M).group(1)))

    for in_place, sizes in ((4 << 20, {6 << 20: True, 2 << 20: False}), (0, {6 << 20: False})):
        mport = _free_port()
        d = Daemon(resp=True, host_bytes="64MiB",
                   extra_config={"metrics_listen": f"127.0.0.1:{mport}", "put_in_place_bytes": in_place})
        try:
            c = redis.Redis(host="127.0.0.1", port=d.resp_port, socket_timeout=10)
            rooms = 0
            for size, in_room in sizes.items():
                k = b"inplace:%d" % size
                v = os.urandom(size)
                head = b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(k), k, size)
                raw = Raw(d.resp_port, timeout=10)
                raw.send(head + v[:256 << 10])
                deadline = time.time() + 5
                while in_room and pinned(mport) < size and time.time() < deadline:
                    time.sleep(0.01)
                if not in_room:
                    time.sleep(0.2)
                held = pinned(mport)
                assert (held >= size) == in_room, (in_place, size, held)
                text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10).read().decode()
                counted = int(float(re.search(r"^sparsekv_put_in_place_total (\S+)$", text, re.M).group(1)))
                rooms += in_room
                assert counted == rooms, (in_place, size, counted)
                raw.send(v[256 << 10:] + b"\r\n")
                assert raw.line() == b"+OK"
                raw.close()
                assert c.get(k) == v
            c.close()
        finally:
            assert d.stop() == 0


# --- sparsekvd's limits and keys ----------------------------------------------------------------


@sparsekv_only
def test_key_limit(server):
    raw = Raw(server.resp_port)
    longest = b"K" * (64 << 10)
    assert raw.cmd("SET", longest, b"longest key") == "OK"
    assert raw.cmd("GET", longest) == b"longest key"
    too_long = longest + b"K"
    reply = raw.cmd("SET", too_long, b"v")
    assert isinstance(reply, Err) and reply.startswith("ERR key too long"), reply
    reply = raw.cmd("GET", too_long)
    assert isinstance(reply, Err) and reply.startswith("ERR key too long"), reply
    assert raw.cmd("GET", longest) == b"longest key"
    assert raw.cmd("DEL", longest) == 1
    raw.close()


@sparsekv_only
def test_value_above_the_record_limit(server):
    k = f"limit:{RUN}"
    c = redis.Redis(host="127.0.0.1", port=server.resp_port)
    c.set(k, b"before")
    raw = Raw(server.resp_port, timeout=30)
    try:
        raw.send(resp_command("SET", k, b"z" * (RECORD_LIMIT + (4 << 20))))
    except OSError:
        pass  # refused from the length alone, and closed: allowed
    first = raw.line()
    assert first.startswith(b"-ERR"), first[:200]
    raw.close()
    assert c.get(k) == b"before"
    assert c.strlen(k) == 6
    # Just under the limit still fits.
    fits = os.urandom(RECORD_LIMIT - (1 << 20))
    assert c.set(k, fits) is True and c.get(k) == fits
    c.delete(k)
    c.close()


@sparsekv_only
def test_bridge_key_round_trip(r):
    k = "0123456789abcdef" + RUN * 2  # 32 lowercase hex digits
    assert len(k) == 32
    v = os.urandom(8192)
    assert r.set(k, v) is True
    assert r.get(k) == v
    assert r.exists(k) == 1
    assert r.delete(k) == 1
    assert r.get(k) is None


@sparsekv_only
def test_bridge_keys_cross_protocols(server, r):
    """A block PUT through the native protocol (the sparsekv CLI) is read through RESP under its
    hash as 32 hex digits, and a value SET through RESP under such a key is read natively."""
    cli = os.path.join(os.path.dirname(os.path.abspath(server.binary)), "sparsekv")
    if not os.access(cli, os.X_OK):
        pytest.skip("no sparsekv CLI beside the daemon")
    out = run([cli, "put", "--addr", server.tcp, "--key", f"native:{RUN}", "--value", "from the native side"])
    assert out.returncode == 0, out.stderr
    hex_hash = re.search(rb"under ([0-9a-f]{32})", out.stdout).group(1).decode()
    assert r.get(hex_hash) == b"from the native side"
    assert r.strlen(hex_hash) == len("from the native side")
    assert r.getrange(hex_hash, 5, 10) == b"the na"
    # The reverse: RESP SET, native GET by --hash.
    other = "fedcba9876543210" + RUN * 2
    assert r.set(other, b"from the redis side") is True
    got = run([cli, "get", "--addr", server.tcp, "--hash", other])
    assert got.returncode == 0, got.stderr
    assert b"from the redis side" in got.stdout
    # An ordinary key is never read as a native block, nor the reverse.
    assert r.get(f"native:{RUN}") is None


@sparsekv_only
def test_write_through_survives_kill_9():
    """Under write-through every OK has reached the SSD tier: after SIGKILL and a restart on the
    same data directory, every value acknowledged is read back byte for byte."""
    d = Daemon(resp=True, host_bytes="64MiB", ssd_bytes="256MiB", write_policy="write-through")
    try:
        c = redis.Redis(host="127.0.0.1", port=d.resp_port)
        values = {f"wt:{RUN}:{i}": os.urandom(1000 + 97 * i) for i in range(300)}
        pipe = c.pipeline(transaction=False)
        for k, v in values.items():
            pipe.set(k, v)
        assert all(x is True for x in pipe.execute())
        c.set(f"wt:{RUN}:0", b"newest")  # a second version: the newest must come back
        values[f"wt:{RUN}:0"] = b"newest"
        c.close()
        d.kill_and_restart()
        c = redis.Redis(host="127.0.0.1", port=d.resp_port)
        keys = list(values)
        got = c.mget(keys)
        lost = [k for k, g in zip(keys, got) if g != values[k]]
        assert not lost, f"{len(lost)} acknowledged values lost or wrong after kill -9, e.g. {lost[:3]}"
        assert c.dbsize() == len(values)
        c.close()
    finally:
        assert d.stop() == 0


@sparsekv_only
def test_reads_racing_write_back_moves_never_miss():
    """A working set of 3x the host tier under write-back: values move down to the SSD tier while
    MGETs and pipelined GETs read them. Every acknowledged value must come back (before the tier
    chain served a bundle on its way down, a read routed to the host tier just before its
    eviction missed: 2 to 6 of these 384 per run). The SSD tier holds both trials (768 records
    of 68 KiB, 51 MiB) with room to spare: what this tests is the race, not which values an SSD
    too small for them keeps (under ARC, values read once outlive values written once and never
    read, so an SSD of 48 MiB dropped a few of the second trial's)."""
    d = Daemon(resp=True, host_bytes=8 << 20, ssd_bytes=96 << 20, ssd_durability="none")
    try:
        c = redis.Redis(host="127.0.0.1", port=d.resp_port)
        for trial in range(2):
            values = {f"race:{RUN}:{trial}:{i}": os.urandom(64 << 10) for i in range(384)}
            keys = list(values)
            for lo in range(0, len(keys), 64):
                p = c.pipeline(transaction=False)
                for k in keys[lo:lo + 64]:
                    p.set(k, values[k])
                assert all(x is True for x in p.execute())
            random.shuffle(keys)
            missed = []
            for lo in range(0, len(keys), 64):
                part = keys[lo:lo + 64]
                if (lo // 64) % 2 == 0:
                    got = c.mget(part)
                else:
                    p = c.pipeline(transaction=False)
                    for k in part:
                        p.get(k)
                    got = p.execute()
                missed += [k for k, g in zip(part, got) if g != values[k]]
            assert not missed, f"trial {trial}: {len(missed)} of {len(keys)} missed, e.g. {missed[:3]}"
        c.close()
    finally:
        assert d.stop() == 0


def read_until_closed(sock):
    """Everything `sock` receives until the server closes it; the socket is closed then."""
    data = b""
    with sock:
        while True:
            chunk = sock.recv(4096)
            if not chunk:
                return data
            data += chunk


@sparsekv_only
def test_namespace_quota_counts_resp_connections():
    """A namespace's max_connections holds for RESP connections too: past it, an AUTH into that
    namespace is refused (the connection stays where it was and is served), and a connection that
    would start in it is refused; a slot given back is taken again."""
    d = Daemon(resp=True, extra_config={"namespaces": [
        {"name": "default", "token": "", "max_connections": 2},
        {"name": "alpha", "token": "alpha-token", "max_connections": 1}]})
    try:
        time.sleep(0.3)  # the start-up probes' connections are closed and counted out
        a1 = redis.Redis(host="127.0.0.1", port=d.resp_port, username="alpha", password="alpha-token")
        assert a1.set("q", "alpha's") is True  # holds alpha's one connection
        d1 = redis.Redis(host="127.0.0.1", port=d.resp_port)
        assert d1.set("q", "default's") is True  # one of default's two
        raw = Raw(d.resp_port)  # default's second
        assert raw.cmd("AUTH", "alpha", "alpha-token").startswith("ERR max number of clients reached for namespace")
        assert raw.cmd("GET", "q") == b"default's"  # still in default, still served
        data = read_until_closed(socket.create_connection(("127.0.0.1", d.resp_port), timeout=10))
        assert data.startswith(b"-ERR max number of clients reached for namespace 'default'"), data
        a1.connection_pool.disconnect()  # alpha's slot comes back once the server has seen the close
        deadline = time.monotonic() + 10
        while True:
            reply = raw.cmd("AUTH", "alpha", "alpha-token")
            if reply == "OK":
                break
            assert time.monotonic() < deadline, reply
            time.sleep(0.05)
        assert raw.cmd("GET", "q") == b"alpha's"
        raw.close()
        d1.close()
    finally:
        assert d.stop() == 0


@sparsekv_only
@sparsekv_only
def test_many_large_sets_at_once_through_a_small_budget_all_land():
    """LMCache's offload pattern (kv_bytes then metadata, then read back) with 16 chunks of 12 MiB
    stored at once through a 16 MiB budget and a 5 s request deadline: the daemon reads them in
    turns, one past the budget at a time (its pass), and a wait on its own budget is not charged
    to the client's deadline. Before, parked connections were closed by that deadline."""
    import urllib.request
    mport = _free_port()
    d = Daemon(resp=True, host_bytes="512MiB", max_record_bytes=13 << 20,
               extra_config={"metrics_listen": f"127.0.0.1:{mport}", "max_buffered_bytes": 16 << 20,
                             "frame_timeout_ms": 5000, "max_frame_bytes": 13 << 20, "max_connections": 64})
    tasks, kv_size = 16, 12 << 20
    # Made before the clients start: the client's own slowness (one event loop sending 192 MiB)
    # is charged to it, and must not be what the deadline measures here.
    values = [random.Random(i).randbytes(kv_size) for i in range(tasks)]
    try:
        async def main():
            pool = redis.asyncio.ConnectionPool(host="127.0.0.1", port=d.resp_port, max_connections=tasks)
            client = redis.asyncio.Redis(connection_pool=pool)

            async def one(i):
                key = f"big:{RUN}:{i}@chunk"
                kv = values[i]
                assert await client.set(key + "kv_bytes", kv) is True
                assert await client.set(key + "metadata", b"m%d" % i) is True
                assert await client.exists(key + "metadata") == 1
                got = await client.get(key + "kv_bytes")
                assert got == kv, f"chunk {i} came back different"
                return len(got)

            results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(tasks))), timeout=120)
            await client.close()
            await pool.disconnect()
            return results

        assert asyncio.run(main()) == [kv_size] * tasks
        text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10).read().decode()
        assert re.search(r"^sparsekv_resp_timeouts_total 0$", text, re.M), \
            "a wait on the daemon's budget was charged to a client: " + \
            "\n".join(l for l in text.splitlines() if "timeout" in l)
        assert re.search(r"^sparsekv_budget_passes_total [1-9]", text, re.M), "the budget never held a request back"
    finally:
        assert d.stop() == 0


def test_metrics_and_the_connection_limit():
    """/metrics counts RESP commands by name; past max_connections a RESP client gets Redis's
    refusal and the connection is closed, while the ones admitted go on being served."""
    import urllib.request
    mport = _free_port()
    d = Daemon(resp=True, extra_config={"metrics_listen": f"127.0.0.1:{mport}", "max_connections": 4})
    socks = []
    try:
        c = redis.Redis(host="127.0.0.1", port=d.resp_port)
        assert c.set("m", "v") is True
        assert c.get("m") == b"v" and c.get("m") == b"v"
        with pytest.raises(redis.ResponseError):
            c.execute_command("NOSUCH")
        for _ in range(3):
            s = socket.create_connection(("127.0.0.1", d.resp_port), timeout=10)
            s.sendall(b"PING\r\n")
            assert s.recv(100) == b"+PONG\r\n"
            socks.append(s)
        extra = socket.create_connection(("127.0.0.1", d.resp_port), timeout=10)
        extra.sendall(b"PING\r\n")
        data = read_until_closed(extra)
        assert data == b"-ERR max number of clients reached\r\n"
        assert c.get("m") == b"v"  # the admitted ones are served
        for s in socks:
            s.close()
        socks = []
        deadline = time.monotonic() + 10
        while True:  # the slots come back once the server has seen the closes
            try:
                assert redis.Redis(host="127.0.0.1", port=d.resp_port).ping() is True
                break
            except (redis.ConnectionError, AssertionError):
                assert time.monotonic() < deadline
                time.sleep(0.05)
        text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10).read().decode()
        assert 'sparsekv_resp_commands_total{command="get"} 3' in text, text
        assert 'sparsekv_resp_commands_total{command="set"} 1' in text
        assert 'sparsekv_resp_commands_total{command="unknown"} 1' in text
        assert 'sparsekv_resp_command_errors_total{command="unknown"} 1' in text
        assert re.search(r"^sparsekv_resp_rejected_total [1-9]", text, re.M), text
    finally:
        for s in socks:
            s.close()
        assert d.stop() == 0


# --- hiredis ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hiredis_client():
    path = os.environ.get("SPARSEKV_RESP_HIREDIS")
    if path:
        yield path
        return
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or not os.path.exists("/usr/include/hiredis/hiredis.h"):
        pytest.skip("no SPARSEKV_RESP_HIREDIS, and no cc with libhiredis-dev to build it")
    with tempfile.TemporaryDirectory(prefix="sparsekv_hiredis_") as d:
        out = os.path.join(d, "resp_hiredis_client")
        build = run([cc, "-O1", "-Wall", "-o", out, os.path.join(HERE, "resp_hiredis_client.c"), "-lhiredis"])
        assert build.returncode == 0, build.stderr.decode()
        yield out


def test_hiredis(server, auth_server, hiredis_client):
    out = run([hiredis_client, "127.0.0.1", str(server.resp_port)], timeout=120)
    assert out.returncode == 0, out.stdout.decode() + out.stderr.decode()
    assert re.fullmatch(rb"ok (\d+)\n", out.stdout), out.stdout
    assert int(out.stdout.split()[1]) >= 20
    out = run([hiredis_client, "127.0.0.1", str(auth_server.resp_port), "alpha", "alpha-token"], timeout=120)
    assert out.returncode == 0, out.stdout.decode()
    assert out.stdout.startswith(b"ok ")
    out = run([hiredis_client, "127.0.0.1", str(auth_server.resp_port), "alpha", "wrong"], timeout=120)
    assert out.returncode == 1 and b"WRONGPASS" in out.stdout, out.stdout


# --- the benchmark script, in its quick form ----------------------------------------------------


def test_resp_bench_quick():
    need_tool("redis-server")
    need_tool("redis-benchmark")
    argv = [sys.executable, os.path.join(ROOT, "bench", "python", "resp_bench.py"), "--quick", "--json",
            "--working-set"]
    if REDIS_MODE:
        argv.append("--redis-only")
    out = run(argv, timeout=240)
    assert out.returncode == 0, out.stderr.decode()[-4000:]
    result = json.loads(out.stdout)
    assert result["machine"]["cores"] >= 1 and result["machine"]["cpu"]
    assert result["cells"]
    for cell in result["cells"]:
        assert cell["op"] in ("SET", "GET") and cell["size"] > 0 and cell["pipeline"] in (1, 16)
        assert cell["redis_rps"] > 0
        if REDIS_MODE:
            assert cell["sparsekvd_rps"] is None
        else:
            assert cell["sparsekvd_rps"] > 0
            assert cell["ratio"] == pytest.approx(cell["sparsekvd_rps"] / cell["redis_rps"], rel=1e-3)
    assert {(c["op"], c["pipeline"]) for c in result["cells"]} == {("SET", 1), ("GET", 1), ("SET", 16), ("GET", 16)}
    ws = result["working_set"]
    for name in ["redis"] + ([] if REDIS_MODE else ["sparsekvd"]):
        assert 0.0 <= ws[name]["hit_ratio"] <= 1.0
        assert ws[name]["gets"] > 0 and ws[name]["get_rps"] > 0
    # Redis with maxmemory H cannot keep a working set of 3 H.
    assert ws["redis"]["hit_ratio"] < 0.9


# --- last: everything stored before the hostile input is still there ----------------------------


def test_after_everything_the_server_is_whole(server, canary):
    assert server.alive()
    check_canary(server, canary)
    raw = Raw(server.resp_port)
    assert raw.cmd("PING") == "PONG"
    raw.close()
