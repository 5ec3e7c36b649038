"""HINT through a real sparsekvd and sparsekv.Client: hinted blocks stay in host memory through a
flood of puts, blocks held only on SSD are brought up, hints end at their time to live, on
drop_hint and when their client closes, a session's hinted blocks are bounded, a hint never makes
a put fail, and one namespace's hints neither protect nor reach another's blocks."""

import os
import time

import pytest

import sparsekv

VALUE = 60000  # a record of 15 units of 4 KiB: the 1 MiB host tier holds 17


def key(i, tag=b"h"):
    return i.to_bytes(8, "little") + tag.ljust(8, b"\0")


@pytest.fixture(scope="module")
def daemon():
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "python"))
    from daemon_process import Daemon

    d = Daemon(namespaces=(("alpha", "a"), ("beta", "b")), host_bytes="1MiB", ssd_bytes="32MiB",
               ssd_durability="none",
               extra_config={"max_hinted_blocks_per_session": 64, "max_hint_ttl_ms": 5000})
    yield d
    assert d.stop() == 0, "sparsekvd did not stop cleanly"


def client(d, ns="alpha"):
    return sparsekv.Client(d.unix, ns, "a" if ns == "alpha" else "b")


def flood(c, tag, n=40):
    """Puts n fresh values: more than the host tier holds twice over."""
    keys = [key(i, tag) for i in range(n)]
    assert c.put(keys, [os.urandom(VALUE) for _ in keys]) == [None] * n


def tiers(c, keys):
    return c.lookup(keys)[1]


def test_hinted_blocks_stay_in_memory_through_a_flood(daemon):
    with client(daemon) as c:
        keys = [key(i, b"keep") for i in range(4)]
        others = [key(i, b"plain") for i in range(4)]
        assert c.put(keys + others, [os.urandom(VALUE) for _ in range(8)]) == [None] * 8
        info = c.hint(keys, ttl=5)
        assert info.found == 4 and info.in_memory == 4 and info.prefetching == 0
        flood(c, b"flood1")
        assert tiers(c, keys) == ["host"] * 4
        assert set(tiers(c, others)) == {"ssd"}, "unhinted blocks went down to the SSD tier"
        c.drop_hint(info.hint)
        with pytest.raises(sparsekv.NotFound):
            c.drop_hint(info.hint)
        flood(c, b"flood2")
        assert "host" not in tiers(c, keys), "dropped: no longer protected"


def test_a_hint_brings_ssd_blocks_up(daemon):
    with client(daemon) as c:
        keys = [key(i, b"up") for i in range(3)]
        assert c.put(keys, [os.urandom(VALUE) for _ in keys]) == [None] * 3
        flood(c, b"flood3")
        assert tiers(c, keys) == ["ssd"] * 3
        info = c.hint(keys, ttl=5)
        assert info.found == 3 and info.in_memory == 0 and info.prefetching == 3
        deadline = time.monotonic() + 5
        while tiers(c, keys) != ["host"] * 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert tiers(c, keys) == ["host"] * 3
        flood(c, b"flood4")
        assert tiers(c, keys) == ["host"] * 3, "prefetched blocks are protected as they land"
        c.drop_hint(info.hint)


def test_hints_expire(daemon):
    with client(daemon) as c:
        keys = [key(i, b"ttl") for i in range(2)]
        assert c.put(keys, [os.urandom(VALUE) for _ in keys]) == [None] * 2
        before = c.stats()["hints"]["expired"]
        info = c.hint(keys, ttl=0.2)
        time.sleep(0.4)
        flood(c, b"flood5")
        assert "host" not in tiers(c, keys)
        assert c.stats()["hints"]["expired"] == before + 1
        with pytest.raises(sparsekv.NotFound):
            c.drop_hint(info.hint)


def test_bounds_and_bad_arguments(daemon):
    with client(daemon) as c:
        many = [key(i, b"bound") for i in range(64)]
        info = c.hint(many, ttl=5)  # absent keys count too: a hint may precede the put
        assert info.found == 0
        with pytest.raises(sparsekv.ResourceExhausted, match="max_hinted_blocks_per_session"):
            c.hint([key(1000, b"bound")], ttl=5)
        c.drop_hint(info.hint)
        c.drop_hint(c.hint([key(1000, b"bound")], ttl=5).hint)
        with pytest.raises(sparsekv.InvalidArgument, match="max_hint_ttl_ms"):
            c.hint([key(1, b"bound")], ttl=6)
        with pytest.raises(ValueError):
            c.hint([key(1, b"bound")], ttl=0)
        with pytest.raises(ValueError):
            c.hint([b"short"], ttl=1)
        assert c.stats()["hints"]["refused"] >= 1


def test_a_hint_never_makes_a_put_fail(daemon):
    with client(daemon) as c:
        keys = [key(i, b"all") for i in range(40)]
        c.hint(keys, ttl=5)  # more than the host tier's hint bound (half of it) could protect
        flood(c, b"all")     # the very keys hinted: every put lands, evicting protected ones last
        c.hint([key(0, b"x")], ttl=5)  # the session is still usable
        assert all(t != "absent" for t in tiers(c, keys))


def test_closing_the_client_ends_its_hints(daemon):
    c = client(daemon)
    c.hint([key(i, b"close") for i in range(8)], ttl=5)
    c.hint([key(i, b"close2") for i in range(8)], ttl=5)
    with client(daemon) as watcher:
        assert watcher.stats()["hints"]["live"] >= 2
        before = watcher.stats()["hints"]["ended_with_session"]
        c.close()
        deadline = time.monotonic() + 5
        while watcher.stats()["hints"]["ended_with_session"] < before + 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert watcher.stats()["hints"]["ended_with_session"] == before + 2


def test_namespaces_are_apart(daemon):
    with client(daemon, "alpha") as a, client(daemon, "beta") as b:
        k = [key(7, b"ns")]
        assert a.put(k, [os.urandom(VALUE)]) == [None]
        info = b.hint(k, ttl=5)  # the same 16 bytes in beta: not alpha's block
        assert info.found == 0
        with pytest.raises(sparsekv.NotFound):
            a.drop_hint(info.hint)  # another session's hint
        flood(a, b"flood6")
        assert tiers(a, k) == ["ssd"], "beta's hint protected alpha's block"
        assert b.stats()["hints"]["live"] >= 1
        b.drop_hint(info.hint)
