"""sparsekv.Client against a real sparsekvd: values round-trip over TCP and the Unix socket
(shared memory), memoryviews outlive their client, errors are the status codes' exceptions,
namespaces are kept apart, and threads share one client."""

import asyncio
import gc
import os
import sys
import threading

import numpy as np
import pytest

import sparsekv


def key(i, tag=b"k"):
    return i.to_bytes(8, "little") + tag.ljust(8, b"\0")


def test_version():
    assert sparsekv.__version__ == "0.1.0"


@pytest.mark.parametrize("where", ["tcp", "unix"])
def test_values_round_trip(daemon, where):
    address = daemon.tcp if where == "tcp" else daemon.unix
    with sparsekv.Client(address, "alpha", "alpha-token") as c:
        assert c.shared_memory == (where == "unix")
        sizes = [1, 100, 4096, 65536, 300000, c.max_payload_bytes // 4]
        values = [os.urandom(n) for n in sizes]
        keys = [key(i, where.encode()) for i in range(len(sizes))]
        assert c.put(keys, values) == [None] * len(keys)
        got = c.get(keys + [key(999, b"absent")])
        assert got[-1] is None
        for v, g in zip(values, got):
            assert isinstance(g, memoryview)
            assert g.readonly
            assert g.nbytes == len(v)
            assert g.tobytes() == v
        # Any contiguous bytes-like value: bytearray, memoryview, numpy.
        arr = np.arange(1000, dtype=np.float32)
        assert c.put([key(50, where.encode()), key(51, where.encode()), key(52, where.encode())],
                     [bytearray(b"xyz"), memoryview(b"abcd"), arr]) == [None] * 3
        a, b, n = c.get([key(50, where.encode()), key(51, where.encode()), key(52, where.encode())])
        assert bytes(a) == b"xyz" and bytes(b) == b"abcd"
        assert np.array_equal(np.frombuffer(n, dtype=np.float32), arr)


def test_overwrite_reads_the_newest(daemon):
    with sparsekv.Client(daemon.unix, "alpha", "alpha-token") as c:
        k = key(7, b"over")
        for round_ in range(5):
            v = bytes([round_]) * (1000 + round_)
            assert c.put([k], [v]) == [None]
            [g] = c.get([k])
            assert bytes(g) == v


def test_a_value_outlives_its_client(daemon):
    c = sparsekv.Client(daemon.tcp, "alpha", "alpha-token")
    v = os.urandom(70000)
    c.put([key(1, b"life")], [v])
    [view] = c.get([key(1, b"life")])
    c.close()
    del c
    gc.collect()
    assert view.tobytes() == v  # the view owns its bytes
    with pytest.raises(TypeError):
        view[0] = 1  # read-only
    # Lent on without a copy: two numpy arrays over the view share its memory.
    a1 = np.frombuffer(view, dtype=np.uint8)
    a2 = np.frombuffer(view, dtype=np.uint8)
    assert a1.ctypes.data == a2.ctypes.data
    assert not a1.flags.writeable
    del view, a2
    gc.collect()
    assert a1.tobytes() == v  # numpy keeps the buffer alive in turn


def test_lookup_delete_stats(daemon):
    with sparsekv.Client(daemon.tcp, "alpha", "alpha-token") as c:
        keys = [key(i, b"prefix") for i in range(4)]
        c.put(keys[:3], [b"a", b"b", b"c"])
        blocks, tiers = c.lookup(keys)
        assert blocks == 3
        assert tiers == ["host", "host", "host", "absent"]
        assert c.delete(keys[1:2]) == [None]
        assert c.lookup(keys)[0] == 1
        assert c.get(keys[1:2]) == [None]
        stats = c.stats()
        assert isinstance(stats, dict) and stats
        c.ping()


def test_errors_are_the_status_codes(daemon):
    with pytest.raises(sparsekv.PermissionDenied) as e:
        sparsekv.Client(daemon.tcp, "alpha", "wrong-token")
    assert isinstance(e.value, sparsekv.Error) and str(e.value)
    with pytest.raises(sparsekv.PermissionDenied):
        sparsekv.Client(daemon.tcp, "no-such-namespace", "")
    with pytest.raises(sparsekv.Error):
        sparsekv.Client("127.0.0.1:1", "alpha", "alpha-token", timeout=2)
    c = sparsekv.Client(daemon.tcp, "alpha", "alpha-token")
    with pytest.raises(ValueError):
        c.get([b"short"])
    with pytest.raises(ValueError):
        c.put([key(1)], [])
    with pytest.raises(TypeError):
        c.get([12345])
    # A value past the daemon's largest frame is refused for that item only.
    too_big = bytes(c.max_payload_bytes + 1)
    out = c.put([key(2, b"big"), key(3, b"small")], [too_big, b"fine"])
    assert isinstance(out[0], sparsekv.Error), out
    assert out[1] is None
    assert c.get([key(2, b"big")]) == [None]
    c.close()
    with pytest.raises(sparsekv.FailedPrecondition):
        c.get([key(1)])
    assert issubclass(sparsekv.NotFound, sparsekv.Error)
    assert sparsekv.NotFound.code == "NotFound"


def test_namespaces_are_kept_apart(daemon):
    with sparsekv.Client(daemon.tcp, "alpha", "alpha-token") as a, \
            sparsekv.Client(daemon.unix, "beta", "beta-token") as b:
        a.put([key(5, b"ns")], [b"alpha's"])
        assert b.get([key(5, b"ns")]) == [None]
        assert b.lookup([key(5, b"ns")]) == (0, ["absent"])
        b.put([key(5, b"ns")], [b"beta's"])
        assert bytes(a.get([key(5, b"ns")])[0]) == b"alpha's"
        assert bytes(b.get([key(5, b"ns")])[0]) == b"beta's"


@pytest.mark.parametrize("where", ["tcp", "unix"])
def test_threads_share_one_client(daemon, where):
    address = daemon.tcp if where == "tcp" else daemon.unix
    errors = []
    with sparsekv.Client(address, "alpha", "alpha-token") as c:
        def work(t):
            try:
                for i in range(40):
                    k = key(t * 1000 + i, b"thr" + where.encode())
                    v = os.urandom(1000 + (i * 997 + t) % 60000)
                    assert c.put([k], [v]) == [None]
                    [g] = c.get([k])
                    assert g is not None and g.tobytes() == v
            except Exception as e:  # noqa: BLE001 (reported below)
                errors.append(e)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []


def test_asyncio(daemon):
    async def main():
        with sparsekv.Client(daemon.tcp, "alpha", "alpha-token") as c:
            keys = [key(i, b"aio") for i in range(16)]
            assert await c.put_async(keys, [bytes([i]) * 100 for i in range(16)]) == [None] * 16
            results = await asyncio.gather(*(c.get_async([k]) for k in keys))
            return [bytes(r[0]) for r in results]

    got = asyncio.run(main())
    assert got == [bytes([i]) * 100 for i in range(16)]


def test_bench_script_runs(daemon):
    import client_bench
    out = client_bench.run(daemon.tcp, daemon.unix, "alpha", "alpha-token", values=8, value_bytes=4096, rounds=2,
                           iterations=3)
    for where in ("tcp", "unix_shm"):
        assert out[where]["python_get_seconds"] > 0
        assert out[where]["cpp_get_seconds"] > 0
    assert out["unix_shm"]["shared_memory"] is True


def test_block_hashes_are_the_managers_chain():
    tokens = list(range(300))
    h = sparsekv.block_hashes(tokens, 64)
    assert len(h) == 4 and all(len(x) == 16 for x in h)  # full blocks only
    assert sparsekv.block_hashes(tokens[:128], 64) == h[:2]  # a prefix hashes alike
    assert sparsekv.block_hashes(tokens, 64, namespace_salt="other")[0] != h[0]
    assert sparsekv.block_hashes([1] + tokens[1:], 64)[3] != h[3]  # the chain carries the past


def test_connector_example(daemon):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
    import kv_connector
    r1, r2 = kv_connector.run(daemon.unix, "alpha", "alpha-token")
    assert r1 == {"loaded_blocks": 0, "computed_blocks": 6, "saved_blocks": 6}
    # The second engine loads the shared prompt's 6 blocks and computes only the question's 2.
    assert r2 == {"loaded_blocks": 6, "computed_blocks": 2, "saved_blocks": 2}


def _pieces_of(arrays, rows):
    """(ptrs, sizes, counts) of values made of row `r` of each array, for each r in `rows`."""
    ptrs, sizes = [], []
    for r in rows:
        for a in arrays:
            ptrs.append(a.ctypes.data + r * a.strides[0])
            sizes.append(a.strides[0])
    return (np.array(ptrs, dtype=np.uint64), np.array(sizes, dtype=np.uint64),
            np.full(len(rows), len(arrays), dtype=np.uint64))


@pytest.mark.parametrize("where", ["tcp", "unix"])
def test_values_in_pieces_round_trip(daemon, where):
    """put_pieces gathers each value from its pieces and get_into_pieces spreads it back, over
    more than one 16 MiB call (the calls overlap), with keys as an array or a list."""
    address = daemon.tcp if where == "tcp" else daemon.unix
    rng = np.random.default_rng(5)
    # Three "layers" of 24 blocks with rows of different sizes: 24 values of ~1.4 MiB.
    src = [rng.integers(0, 256, (24, n), dtype=np.uint8) for n in (700_000, 4_000, 720_000)]
    keys = np.frombuffer(os.urandom(24 * 16), dtype=np.uint8).reshape(24, 16)
    with sparsekv.Client(address, "alpha", "alpha-token") as c:
        ptrs, sizes, counts = _pieces_of(src, range(24))
        assert c.put_pieces(keys, ptrs, sizes, counts) == [None] * 24
        whole = c.get([keys[5].tobytes()])[0]
        assert bytes(whole) == b"".join(a[5].tobytes() for a in src)
        dst = [np.zeros_like(a) for a in src]
        ptrs, sizes, counts = _pieces_of(dst, range(24))
        got = c.get_into_pieces([k.tobytes() for k in keys], ptrs, sizes, counts)
        assert got == [sum(a.shape[1] for a in src)] * 24
        for a, b in zip(src, dst):
            assert np.array_equal(a, b)
        n, tiers = c.lookup_array(np.concatenate([keys[:3], keys[-1:] ^ 1]))
        assert n == 3 and tiers[:3] == b"\x01\x01\x01" and tiers[3] == 0


def test_values_in_pieces_refuse_what_does_not_fit(daemon):
    """A miss is None and a value of another size than its pieces' total writes nothing; arrays
    that disagree are refused before anything is sent."""
    with sparsekv.Client(daemon.unix, "alpha", "alpha-token") as c:
        a = np.arange(4 * 1000, dtype=np.uint8).reshape(4, 1000)
        keys = np.frombuffer(os.urandom(4 * 16), dtype=np.uint8).reshape(4, 16)
        assert c.put([keys[0].tobytes(), keys[1].tobytes()], [a[0].tobytes(), b"short"]) == [None, None]
        dst = np.full_like(a, 7)
        ptrs, sizes, counts = _pieces_of([dst], range(3))
        got = c.get_into_pieces(keys[:3], ptrs, sizes, counts)
        assert got == [1000, 5, None]
        assert np.array_equal(dst[0], a[0]) and (dst[1] == 7).all() and (dst[2] == 7).all()
        with pytest.raises(ValueError, match="pieces"):
            c.get_into_pieces(keys[:3], ptrs, sizes, counts[:2])
        with pytest.raises(ValueError, match="pieces"):
            c.put_pieces(keys[:3], ptrs, sizes[:-1], counts)
        with pytest.raises(ValueError, match="pieces"):
            c.put_pieces(keys[:3], ptrs, sizes, counts + 1)
        with pytest.raises(ValueError, match="keys"):
            c.lookup_array(np.zeros(15, dtype=np.uint8))
        assert c.lookup_array(keys[3:])[1] == b"\x00"  # nothing was stored by the refused calls


def test_put_pieces_from_threads_at_once(daemon):
    """One client's put_pieces from four threads at once: each value is its own pieces'."""
    with sparsekv.Client(daemon.unix, "alpha", "alpha-token") as c:
        rng = np.random.default_rng(9)
        data = [rng.integers(0, 256, (6, 3_000_000), dtype=np.uint8) for _ in range(4)]
        keys = [np.frombuffer(os.urandom(6 * 16), dtype=np.uint8).reshape(6, 16) for _ in range(4)]
        errors = []

        def put(t):
            try:
                assert c.put_pieces(keys[t], *_pieces_of([data[t]], range(6))) == [None] * 6
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=put, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for t in range(4):
            for r in (0, 5):
                assert bytes(c.get([keys[t][r].tobytes()])[0]) == data[t][r].tobytes()
