"""GET into caller memory from Python (Client.get_into), zero-copy views (Client.get_views),
and clients killed while holding views or in the middle of a GET, against a real one-namespace
sparsekvd (its host arena lent to shared-memory clients)."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request

import numpy as np
import pytest

import sparsekv

torch = pytest.importorskip("torch")  # Debian's python3-torch; every CI machine has it

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "python"))
from daemon_process import Daemon  # noqa: E402


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def one():
    port = _free_port()
    d = Daemon(namespaces=(("solo", "solo-token"),), host_bytes="128MiB",
               extra_config={"metrics_listen": f"127.0.0.1:{port}"})
    d.metrics_port = port
    yield d
    assert d.stop() == 0, "sparsekvd did not stop cleanly"


def gauge(d, name):
    body = urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=5).read().decode()
    for line in body.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def wait_gauge(d, name, want, seconds=5.0):
    deadline = time.monotonic() + seconds
    v = gauge(d, name)
    while v != want and time.monotonic() < deadline:
        time.sleep(0.02)
        v = gauge(d, name)
    return v


def key(i, tag=b"dp"):
    return i.to_bytes(8, "little") + tag.ljust(8, b"\0")


def values(n, size, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]


@pytest.fixture(params=["tcp", "unix_shm"])
def client(one, request):
    address = one.tcp if request.param == "tcp" else one.unix
    with sparsekv.Client(address, "solo", "solo-token", shared_memory=request.param == "unix_shm") as c:
        if request.param == "unix_shm":
            assert c.shared_memory
        yield c


def test_get_into_every_kind_of_destination(client):
    n, size = 8, 70000
    keys = [key(i, b"kinds") for i in range(n)]
    data = values(n, size, 1)
    assert client.put(keys, data) == [None] * n
    # One numpy array cut into n slices.
    arr = np.zeros((n, size), dtype=np.uint8)
    assert client.get_into(keys, arr) == [size] * n
    assert all(arr[i].tobytes() == data[i] for i in range(n))
    # A torch tensor of pages, and a list of its page slices (non-contiguous as a whole: each
    # page is contiguous).
    t = torch.zeros((n, size), dtype=torch.uint8)
    assert client.get_into(keys, t) == [size] * n
    assert all(bytes(t[i].numpy()) == data[i] for i in range(n))
    wide = torch.zeros((n, size + 5000), dtype=torch.uint8)
    assert client.get_into(keys, [wide[i] for i in range(n)]) == [size] * n
    assert all(bytes(wide[i, :size].numpy()) == data[i] for i in range(n))
    assert int(wide[:, size:].sum()) == 0  # nothing past each value
    # bytearrays, memoryviews, and (pointer, length) pairs.
    bufs = [bytearray(size) for _ in range(n)]
    assert client.get_into(keys, bufs) == [size] * n
    assert [bytes(b) for b in bufs] == data
    views = [memoryview(bytearray(size)) for _ in range(n)]
    assert client.get_into(keys, views) == [size] * n
    assert [v.tobytes() for v in views] == data
    raw = np.zeros(n * size, dtype=np.uint8)
    pairs = [(raw.ctypes.data + i * size, size) for i in range(n)]
    assert client.get_into(keys, pairs) == [size] * n
    assert raw.tobytes() == b"".join(data)


def test_get_into_misses_and_mistakes(client):
    keys = [key(i, b"miss") for i in range(3)]
    data = values(3, 5000, 2)
    assert client.put(keys[:2], data[:2]) == [None, None]
    out = np.full((3, 6000), 7, dtype=np.uint8)
    assert client.get_into(keys, out) == [5000, 5000, None]
    assert (out[2] == 7).all()
    assert (out[0, 5000:] == 7).all()
    with pytest.raises(sparsekv.OutOfRange):
        client.get_into(keys[:1], np.zeros(4999, dtype=np.uint8))
    with pytest.raises(ValueError):
        client.get_into(keys, np.zeros(3 * 5000 + 1, dtype=np.uint8))  # not 3 equal slices
    with pytest.raises(ValueError):
        client.get_into(keys, [bytearray(10)] * 2)  # 3 keys, 2 destinations
    with pytest.raises(TypeError):
        client.get_into(keys[:1], b"\0" * 6000)  # read-only
    with pytest.raises(TypeError):
        client.get_into(keys[:1], np.zeros((6000, 2), dtype=np.uint8)[:, 0])  # not contiguous
    with pytest.raises(ValueError):
        client.get_into(keys[:1], torch.zeros((100, 100), dtype=torch.uint8).t())  # not contiguous
    # The client goes on working after each refusal.
    assert client.get_into(keys[:1], bytearray(5000)) == [5000]


def test_a_second_get_into_reads_locally_and_sees_other_writers(one):
    """Local reads in the shipped daemon (api/PROTOCOL.md): a get_into of values lent before is
    copied from the arena without a request (sparsekv_local_reads_total counts them once the
    client reports them), and an overwrite or a DELETE by another client is seen at once."""
    n, size = 8, 65536
    keys = [key(i, b"local") for i in range(n)]
    first = [bytes([i + 1]) * size for i in range(n)]
    with sparsekv.Client(one.tcp, "solo", "solo-token") as w, \
            sparsekv.Client(one.unix, "solo", "solo-token") as c:
        w.put(keys, first)
        before = gauge(one, "sparsekv_local_reads_total")
        out = np.zeros((n, size), dtype=np.uint8)
        for _ in range(3):
            out[:] = 0
            assert c.get_into(keys, out) == [size] * n
            assert all(out[i].tobytes() == first[i] for i in range(n))
        time.sleep(0.01)
        c.get_into(keys[:1], np.zeros(size, dtype=np.uint8))  # carries the last reads' TOUCH
        want = before + 2 * n + 1
        assert wait_gauge(one, "sparsekv_local_reads_total", want) == want
        # Another client overwrites half and deletes one: the next read sees both.
        second = [bytes([0x80 + i]) * size for i in range(n // 2)]
        w.put(keys[: n // 2], second)
        w.delete(keys[n - 1 :])
        out[:] = 0
        got = c.get_into(keys, out)
        assert got == [size] * (n - 1) + [None]
        for i in range(n - 1):
            assert out[i].tobytes() == (second[i] if i < n // 2 else first[i]), i


def test_views_are_lent_and_given_back(one):
    keys = [key(i, b"views") for i in range(4)]
    data = values(4, 40000, 3)
    with sparsekv.Client(one.tcp, "solo", "solo-token") as w:
        assert w.put(keys, data) == [None] * 4
    with sparsekv.Client(one.unix, "solo", "solo-token") as c:
        base = wait_gauge(one, "sparsekv_pinned_reply_bytes", 0)
        assert base == 0
        got = c.get_views(keys + [key(99, b"views")])
        assert got[4] is None
        assert [g.tobytes() for g in got[:4]] == data
        assert gauge(one, "sparsekv_pinned_reply_bytes") == 4 * 40000
        arr = np.frombuffer(got[1], dtype=np.uint8)  # an array over a view keeps the lease
        del got
        assert gauge(one, "sparsekv_pinned_reply_bytes") == 4 * 40000
        assert arr.tobytes() == data[1]
        del arr
        assert wait_gauge(one, "sparsekv_pinned_reply_bytes", 0) == 0


CHILD = textwrap.dedent("""
    import sys, numpy as np, sparsekv
    address, mode = sys.argv[1], sys.argv[2]
    keys = [i.to_bytes(8, "little") + b"die".ljust(8, b"\\0") for i in range(24)]
    c = sparsekv.Client(address, "solo", "solo-token", shared_memory=address.startswith("unix:"))
    out = np.zeros((24, 1 << 20), dtype=np.uint8)
    held = c.get_views(keys) if mode == "views" else None
    print("ready", flush=True)
    while True:
        c.get_into(keys, out)
""")


@pytest.mark.parametrize("where,mode", [("unix", "views"), ("unix", "get_into"), ("tcp", "get_into")])
def test_a_killed_client_leaves_nothing_held(one, where, mode):
    keys = [key(i, b"die") for i in range(24)]
    with sparsekv.Client(one.tcp, "solo", "solo-token") as w:
        assert w.put(keys, values(24, 1 << 20, 4)) == [None] * 24
    staging = wait_gauge(one, "sparsekv_shared_staging_bytes", 0)
    assert staging == 0
    address = one.unix if where == "unix" else one.tcp
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    child = subprocess.Popen([sys.executable, "-c", CHILD, address, mode], stdout=subprocess.PIPE, env=env)
    try:
        assert child.stdout.readline().strip() == b"ready"
        time.sleep(0.3)  # in the middle of its GETs
        if mode == "views":
            assert gauge(one, "sparsekv_pinned_reply_bytes") >= 24 * (1 << 20)  # every view lent
        if where == "unix":
            assert gauge(one, "sparsekv_shared_staging_bytes") > 0
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert wait_gauge(one, "sparsekv_pinned_reply_bytes", 0) == 0
    assert wait_gauge(one, "sparsekv_buffered_bytes", 0) == 0
    assert wait_gauge(one, "sparsekv_shared_staging_bytes", 0) == 0
    with sparsekv.Client(one.unix, "solo", "solo-token") as c:
        assert c.get_into(keys[:2], np.zeros((2, 1 << 20), dtype=np.uint8)) == [1 << 20] * 2
