"""sparsekv.sglang.SparseKVStorage driven the way SGLang's HiCache controller drives an L3
backend (managers/cache_controller.py and hybrid_cache_controller.py, read at the commits named
in sparsekv/sglang.py): attach (construct as the dynamic factory does, register the host pools),
backup (batch_set_v2 for the side pools, then batch_set_v1 for the KV, in chunks of 128 pages),
prefetch (batch_exists_v2 with every pool's hit policy, then batch_get_v1 and batch_get_v2 into
freshly allocated host pages), against a real sparsekvd. The host pools are stand-ins with the
shapes and get_page_buffer_meta of SGLang's pool_host classes (MLA, the DSA indexer of DeepSeek
V3.2, DeepSeek V4's paged and state pools), as torch tensors, in every layout. Also: the generic
path SGLang takes without "interface_v1" (batch_set, batch_exists, batch_get with flat pages),
pools that count only once registered, and extra config keys this backend does not know."""

import logging
import os
import signal
import sys

import pytest

torch = pytest.importorskip("torch")

import sparsekv  # noqa: E402
from sparsekv import sglang as sk  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "python"))
from daemon_process import Daemon  # noqa: E402

BATCH = 128  # STORAGE_BATCH_SIZE: the controller's chunk


class MLAPool:
    """MLATokenToKVPoolHost's layouts: layer_first (L, size, 1, dim), page_first (size, L, 1, dim),
    page_first_direct (page_num, L, P, 1, dim); one buffer per page for page_first*, one per layer
    per page for layer_first. `dim` is in bytes; the flat data pages of the generic path
    (get_data_page, get_dummy_flat_data_page, set_from_flat_data_page) are handed out in `dtype`,
    as a pool of that dtype hands them (bf16 for an unquantized MLA cache)."""

    def __init__(self, layout, pages, page_size=64, layers=4, dim=656, dtype=torch.uint8):
        self.layout, self.page_size, self.layers, self.dim = layout, page_size, layers, dim
        self.dtype = dtype
        self.size = pages * page_size
        shape = {"layer_first": (layers, self.size, 1, dim), "page_first": (self.size, layers, 1, dim),
                 "page_first_direct": (pages, layers, page_size, 1, dim)}[layout]
        self.kv_buffer = torch.zeros(shape, dtype=torch.uint8)

    def get_page_buffer_meta(self, indices):
        base, L, P, d = self.kv_buffer.data_ptr(), self.layers, self.page_size, self.dim
        ptrs, sizes = [], []
        for i in range(0, len(indices), P):
            first = int(indices[i])
            if self.layout == "layer_first":
                for layer in range(L):
                    ptrs.append(base + (layer * self.size + first) * d)
                    sizes.append(P * d)
            else:
                ptrs.append(base + first * L * d)
                sizes.append(L * P * d)
        return ptrs, sizes

    def page(self, first):  # the page's bytes, in the order the pool lays them out
        P = self.page_size
        if self.layout == "layer_first":
            return self.kv_buffer[:, first:first + P].contiguous().view(-1)
        if self.layout == "page_first":
            return self.kv_buffer[first:first + P].contiguous().view(-1)
        return self.kv_buffer[first // P].contiguous().view(-1)

    def _slice(self, first):
        P = self.page_size
        if self.layout == "layer_first":
            return self.kv_buffer[:, first:first + P]
        if self.layout == "page_first":
            return self.kv_buffer[first:first + P]
        return self.kv_buffer[first // P:first // P + 1]

    def get_data_page(self, index, flat=True):  # the page starting at token slot `index`
        page = self._slice(int(index))
        return page.flatten().view(self.dtype) if flat else page

    def get_dummy_flat_data_page(self):
        return torch.zeros(self.layers * self.page_size * self.dim, dtype=torch.uint8).view(self.dtype)

    def set_from_flat_data_page(self, index, data_page):
        target = self._slice(int(index))
        target.copy_(data_page.view(torch.uint8).reshape(target.shape))

    def fill(self, first, seed):
        g = torch.Generator().manual_seed(seed)
        P = self.page_size
        data = torch.randint(0, 256, (self.layers * P * self.dim,), dtype=torch.uint8, generator=g)
        if self.layout == "layer_first":
            self.kv_buffer[:, first:first + P] = data.view(self.layers, P, 1, self.dim)
        elif self.layout == "page_first":
            self.kv_buffer[first:first + P] = data.view(P, self.layers, 1, self.dim)
        else:
            self.kv_buffer[first // P] = data.view(self.layers, P, 1, self.dim)


class BytesPerPagePool:
    """Pools holding one byte row per page per layer: the DSA indexer of V3.2 (uint8,
    `stride` bytes per page per layer, pages addressed as first slot // page_size) and DeepSeek
    V4's paged and state pools. page_first*: (pages, L, 1, stride), one buffer per page;
    layer_first: (L, pages, stride), one per layer per page."""

    def __init__(self, layout, pages, page_size=64, layers=4, stride=64 * 132):
        self.layout, self.page_size, self.layers, self.stride = layout, page_size, layers, stride
        self.pages = pages
        shape = (layers, pages, stride) if layout == "layer_first" else (pages, layers, 1, stride)
        self.buf = torch.zeros(shape, dtype=torch.uint8)

    def get_page_buffer_meta(self, indices):
        base, L, s = self.buf.data_ptr(), self.layers, self.stride
        ptrs, sizes = [], []
        for i in range(0, len(indices), self.page_size):
            page = int(indices[i]) // self.page_size
            if self.layout == "layer_first":
                for layer in range(L):
                    ptrs.append(base + (layer * self.pages + page) * s)
                    sizes.append(s)
            else:
                ptrs.append(base + page * L * s)
                sizes.append(L * s)
        return ptrs, sizes

    def page(self, first):
        p = first // self.page_size
        return (self.buf[:, p] if self.layout == "layer_first" else self.buf[p]).contiguous().view(-1)

    def fill(self, first, seed):
        g = torch.Generator().manual_seed(seed)
        p = first // self.page_size
        n = self.layers * self.stride
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        if self.layout == "layer_first":
            self.buf[:, p] = data.view(self.layers, self.stride)
        else:
            self.buf[p] = data.view(self.layers, 1, self.stride)


class LogicalAnchor:
    """DeepSeek V4's KV anchor pool: logical only, no bytes (get_page_buffer_meta is None)."""

    def __init__(self, page_size=64):
        self.page_size = page_size
        self.layout = "page_first"

    def get_page_buffer_meta(self, indices):
        return None


def hashes(n, tag="p"):
    return [f"{tag}{i:063x}"[-64:] for i in range(n)]


def numbered(n, base):
    """n page hashes of their own (64 hex digits from `base` on), shared with no other test."""
    return [f"{base + i:064x}" for i in range(n)]


def slots(first_page, pages, page_size=64):
    return torch.arange(first_page * page_size, (first_page + pages) * page_size, dtype=torch.int64)


def config(address, tp_rank=0, tp_size=1, mla=True, v1=True, **extra):
    """The storage config SGLang's controller builds; v1=False leaves "interface_v1" out of the
    extra config, as a user who does not set it does (the controller then takes the generic
    path)."""
    extra_config = {"backend_name": "sparsekv", "module_path": "sparsekv.sglang", "class_name": "SparseKVStorage",
                    "address": address, "namespace": "default", **extra}
    if v1:
        extra_config["interface_v1"] = 1
    return sk.HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                   attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
                                   is_page_first_layout=True, model_name="deepseek-ai/DeepSeek-V3.2",
                                   extra_config=extra_config)


def attach(cfg, kv_pool, side_pools=()):
    """As the controller attaches a backend: construct, register the host pool, then (hybrid
    models) every side pool."""
    b = sk.SparseKVStorage(cfg, {})
    b.register_mem_pool_host(kv_pool)
    for name, pool in side_pools:
        b.register_mem_host_pool_v2(pool, name)
    return b


def backup(b, keys, first_page, side=(), page_size=64):
    """_page_backup: per chunk of 128 pages, the side pools (batch_set_v2), then the KV."""
    done = 0
    for i in range(0, len(keys), BATCH):
        batch = keys[i:i + BATCH]
        idx = slots(first_page + i, len(batch), page_size)
        if side:
            res = b.batch_set_v2([sk.PoolTransfer(name=n, host_indices=idx, keys=batch) for n in side])
            if not all(all(v) for v in res.values()):
                break
        if not all(b.batch_set_v1(batch, idx)):
            break
        done += len(batch)
    return done


def prefetch(b, keys, first_page, transfers=(), page_size=64):
    """_storage_hit_query then _page_transfer: the hit (v2 when side pools exist), then the KV
    pages and the KV-indexed side pools into host pages from `first_page` on."""
    if transfers:
        hit = b.batch_exists_v2(keys, [sk.PoolTransfer(name=n, keys=k, hit_policy=p) for n, k, p in transfers])
        pages = hit.kv_hit_pages
    else:
        pages = b.batch_exists(keys)
    got = 0
    for i in range(0, pages, BATCH):
        batch = keys[i:min(pages, i + BATCH)]
        idx = slots(first_page + i, len(batch), page_size)
        ok = b.batch_get_v1(batch, idx)
        side = [n for n, _, p in transfers if p == sk.PoolHitPolicy.ALL_PAGES]
        if side:
            res = b.batch_get_v2([sk.PoolTransfer(name=n, host_indices=idx, keys=batch) for n in side])
            ok = [a and all(res[sk._name(n)][j] for n in side) for j, a in enumerate(ok)]
        n_ok = 0
        while n_ok < len(ok) and ok[n_ok]:
            n_ok += 1
        got += n_ok
        if n_ok < len(batch):
            break
    return pages, got


def generic_backup(b, pool, keys, first_page, page_size=64):
    """_generic_page_set, batch by batch as _page_backup: one flat data page per key,
    pool.get_data_page(first slot of the page), then batch_set; pages stored."""
    idx = slots(first_page, len(keys), page_size)
    for i in range(0, len(keys), BATCH):
        batch = keys[i:i + BATCH]
        data = [pool.get_data_page(idx[(i + j) * page_size]) for j in range(len(batch))]
        if not b.batch_set(batch, data):
            return i
    return len(keys)


def generic_prefetch(b, pool, keys, first_page, page_size=64):
    """_storage_hit_query (batch_exists per chunk, stopping at the first short answer), then
    _generic_page_get per chunk: batch_get into dummy flat pages, each hit copied into the pool
    with set_from_flat_data_page, stopping at the first None. (pages found, pages read)."""
    hit = 0
    for start in range(0, len(keys), BATCH):
        batch = keys[start:start + BATCH]
        n = b.batch_exists(batch, None)
        hit += n
        if n < len(batch):
            break
    idx = slots(first_page, hit, page_size)
    got = 0
    for i in range(0, hit, BATCH):
        batch = keys[i:min(hit, i + BATCH)]
        page_data = b.batch_get(batch, [pool.get_dummy_flat_data_page() for _ in batch])
        for j, data in enumerate(page_data):
            if data is None:
                return hit, got
            pool.set_from_flat_data_page(idx[(i + j) * page_size], data)
            got += 1
    return hit, got


@pytest.fixture(scope="module")
def daemon():
    d = Daemon(host_bytes="512MiB")
    yield d
    d.stop()


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct", "layer_first"])
def test_v32_pages_round_trip_between_two_workers(daemon, layout):
    """DeepSeek V3.2: MLA KV + the DSA indexer, written by TP rank 0 of one worker, read byte for
    byte by TP rank 1 of another into other host pages (MLA shares one copy across ranks)."""
    n = 150  # two chunks of the controller
    keys = hashes(n, f"v32{layout}")
    kv_a, ix_a = MLAPool(layout, 2 * n), BytesPerPagePool("page_first" if layout != "layer_first" else layout, 2 * n)
    for p in range(n):
        kv_a.fill(p * 64, p)
        ix_a.fill(p * 64, 10_000 + p)
    a = attach(config(daemon.unix, tp_rank=0, tp_size=2), kv_a, [(sk.PoolName.INDEXER, ix_a)])
    assert backup(a, keys, 0, side=[sk.PoolName.INDEXER]) == n
    kv_b, ix_b = MLAPool(layout, 2 * n), BytesPerPagePool(ix_a.layout, 2 * n)
    b = attach(config(daemon.tcp, tp_rank=1, tp_size=2), kv_b, [(sk.PoolName.INDEXER, ix_b)])
    pages, got = prefetch(b, keys, n, [(sk.PoolName.INDEXER, None, sk.PoolHitPolicy.ALL_PAGES)])
    assert (pages, got) == (n, n)
    for p in range(n):
        assert torch.equal(kv_b.page((n + p) * 64), kv_a.page(p * 64)), p
        assert torch.equal(ix_b.page((n + p) * 64), ix_a.page(p * 64)), p
    stats = b.get_stats()
    assert stats.sparsekv["hits"] >= 2 * n and stats.sparsekv["bytes_read"] > 0
    assert sum(stats.prefetch_pgs) >= 2 * n
    assert 0 < stats.sparsekv["get_p50_us"] <= stats.sparsekv["get_p99_us"]
    assert b.get_stats().prefetch_pgs == []  # handed over once, as SGLang's collector expects
    a.close()
    b.close()


def test_a_missing_indexer_page_shortens_the_hit(daemon):
    n = 10
    keys = hashes(n, "gap")
    kv, ix = MLAPool("page_first", n), BytesPerPagePool("page_first", n)
    for p in range(n):
        kv.fill(p * 64, p)
        ix.fill(p * 64, 99 + p)
    a = attach(config(daemon.unix), kv, [(sk.PoolName.INDEXER, ix)])
    assert backup(a, keys, 0, side=[sk.PoolName.INDEXER]) == n
    # The indexer page of position 6 goes (an eviction, a crash between two writes).
    layout = a._layout(ix)
    with sparsekv.Client(daemon.unix) as c:
        assert c.delete(a._page_keys("indexer", [keys[6]], layout)) == [None]
    r = a.batch_exists_v2(keys, [sk.PoolTransfer(name=sk.PoolName.INDEXER, hit_policy=sk.PoolHitPolicy.ALL_PAGES)])
    assert r.kv_hit_pages == 6
    assert r.extra_pool_hit_pages["indexer"] == 6
    # Without the indexer, the KV alone would be found whole: the policy is what shortens it.
    assert a.batch_exists(keys) == n
    kv2 = MLAPool("page_first", n)
    b = attach(config(daemon.unix), kv2, [(sk.PoolName.INDEXER, BytesPerPagePool("page_first", n))])
    assert prefetch(b, keys, 0, [(sk.PoolName.INDEXER, None, sk.PoolHitPolicy.ALL_PAGES)]) == (6, 6)


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_v4_pools_with_both_hit_policies(daemon, layout):
    """DeepSeek V4: a logical KV anchor, compressed pools c4 / c4_indexer / c128 hit on every
    page, SWA and the compressor states only on the last pages."""
    n = 12
    keys = hashes(n, "v4" + layout)
    every = [sk.PoolName.DEEPSEEK_V4_C4, sk.PoolName.DEEPSEEK_V4_C4_INDEXER, sk.PoolName.DEEPSEEK_V4_C128]
    trailing = [sk.PoolName.SWA, sk.PoolName.DEEPSEEK_V4_C4_STATE, sk.PoolName.DEEPSEEK_V4_C4_INDEXER_STATE,
                sk.PoolName.DEEPSEEK_V4_C128_STATE]
    pools = {name: BytesPerPagePool(layout, n, stride=512 + 64 * i) for i, name in enumerate(every + trailing)}
    for i, (name, pool) in enumerate(pools.items()):
        for p in range(n):
            pool.fill(p * 64, 1000 * i + p)
    a = attach(config(daemon.unix), LogicalAnchor(), list(pools.items()))
    assert a.batch_set_v1(keys, slots(0, n)) == [True] * n  # the anchor keeps no bytes
    assert backup(a, keys, 0, side=every) == n
    # SWA and states are written for the last 2 pages only, as the controller backs up a window.
    res = a.batch_set_v2([sk.PoolTransfer(name=t, host_indices=slots(n - 2, 2), keys=keys[-2:]) for t in trailing])
    assert all(all(v) for v in res.values())
    window = keys[-2:]
    transfers = [sk.PoolTransfer(name=t, hit_policy=sk.PoolHitPolicy.ALL_PAGES) for t in every]
    transfers += [sk.PoolTransfer(name=t, keys=window, hit_policy=sk.PoolHitPolicy.TRAILING_PAGES) for t in trailing]
    r = a.batch_exists_v2(keys, transfers)
    assert r.kv_hit_pages == n
    assert r.extra_pool_hit_pages["swa"] == 2
    assert r.extra_pool_hit_pages["deepseek_v4_c4"] == n
    # One state page of the last position gone: no window of 2 ends anywhere else, so no hit.
    layout = a._layout(pools[sk.PoolName.DEEPSEEK_V4_C128_STATE])
    with sparsekv.Client(daemon.unix) as c:
        c.delete(a._page_keys("deepseek_v4_c128_state", [keys[-1]], layout))
    assert a.batch_exists_v2(keys, transfers).kv_hit_pages == 0
    # A c128 page in the middle gone: every-page pools cut the prefix there.
    with sparsekv.Client(daemon.unix) as c:
        c.delete(a._page_keys("deepseek_v4_c128", [keys[4]], a._layout(pools[sk.PoolName.DEEPSEEK_V4_C128])))
    r = a.batch_exists_v2(keys, transfers[:3])
    assert r.kv_hit_pages == 4 and r.extra_pool_hit_pages["deepseek_v4_c128"] == 4
    # Read back into another worker's pools, byte for byte.
    fresh = {name: BytesPerPagePool(layout, n, stride=pools[name].stride) for name in every}
    b = attach(config(daemon.tcp), LogicalAnchor(), list(fresh.items()))
    got = b.batch_get_v2([sk.PoolTransfer(name=t, host_indices=slots(0, 4), keys=keys[:4]) for t in every])
    assert all(v == [True] * 4 for v in got.values())
    for name in every:
        for p in range(4):
            assert torch.equal(fresh[name].page(p * 64), pools[name].page(p * 64))


def test_ranks_of_a_non_mla_model_are_kept_apart(daemon):
    keys = hashes(3, "mha")
    pool = MLAPool("page_first", 3)  # the shape does not matter here: the keys do
    for p in range(3):
        pool.fill(p * 64, p)
    r0 = attach(config(daemon.unix, tp_rank=0, tp_size=2, mla=False), pool)
    r1 = attach(config(daemon.unix, tp_rank=1, tp_size=2, mla=False), MLAPool("page_first", 3))
    assert r0.batch_set_v1(keys, slots(0, 3)) == [True] * 3
    assert r0.batch_exists(keys) == 3
    assert r1.batch_exists(keys) == 0
    other_model = config(daemon.unix)
    other_model.model_name = "another/model"
    assert attach(other_model, MLAPool("page_first", 3)).batch_exists(keys) == 0
    # Another layout of the same model misses instead of reading bytes laid out otherwise.
    assert attach(config(daemon.unix), MLAPool("layer_first", 3)).batch_exists(keys) == 0


def test_generic_flat_page_path_and_clear(daemon):
    b = attach(config(daemon.unix), MLAPool("page_first", 4))
    pages = [torch.randint(0, 256, (1000,), dtype=torch.uint8) for _ in range(3)]
    keys = hashes(3, "flat")
    assert b.batch_set(keys, pages) is True
    out = [torch.zeros(1000, dtype=torch.uint8) for _ in range(4)]
    got = b.batch_get(keys + [hashes(1, "none")[0]], out)
    assert all(torch.equal(got[i], pages[i]) for i in range(3))
    assert got[3] is None
    assert b.set("x" * 64, pages[0]) is True
    assert torch.equal(b.get("x" * 64, torch.zeros(1000, dtype=torch.uint8)), pages[0])
    assert b.clear() is True
    assert b.batch_get(keys, [torch.zeros(1000, dtype=torch.uint8) for _ in range(3)]) == [None] * 3


def test_bad_config_names_the_field(daemon):
    cases = {
        "address": 7, "namespace": "", "token": 5, "transport": "carrier-pigeon", "timeout": -1,
        "reconnect_interval": "soon", "key_tag": 3,
    }
    for field, bad in cases.items():
        cfg = config(daemon.unix)
        cfg.extra_config[field] = bad
        with pytest.raises(ValueError, match=f"'{field}'"):
            sk.SparseKVStorage(cfg, {})
    with pytest.raises(ValueError, match="'transport'"):
        sk.SparseKVStorage(config(daemon.tcp, transport="shm"), {})
    assert issubclass(sk.SparseKVStorage, sk.HiCacheStorage)


def test_a_killed_and_restarted_daemon_gives_misses_not_exceptions():
    d = Daemon(host_bytes="128MiB", write_policy="write-through", ssd_bytes="256MiB", ssd_durability="none")
    try:
        n = 20
        keys = hashes(n, "kill")
        kv = MLAPool("page_first", 2 * n)
        for p in range(n):
            kv.fill(p * 64, p)
        b = attach(config(d.unix, reconnect_interval=0), kv, [(sk.PoolName.INDEXER, BytesPerPagePool("page_first", 2 * n))])
        assert backup(b, keys, 0, side=[sk.PoolName.INDEXER]) == n
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait()
        # Every call answers, none raises: misses, 0 and False.
        assert b.batch_exists(keys) == 0
        assert b.batch_get_v1(keys[:3], slots(n, 3)) == [False] * 3
        assert b.batch_set_v1(keys[:3], slots(0, 3)) == [False] * 3
        assert b.batch_exists_v2(keys, [sk.PoolTransfer(name=sk.PoolName.INDEXER)]).kv_hit_pages == 0
        assert b.batch_get_v2([sk.PoolTransfer(name=sk.PoolName.INDEXER, host_indices=slots(0, 2), keys=keys[:2])]) == {
            "indexer": [False, False]}
        assert b.get_stats().sparsekv["errors"] >= 1
        d._launch()  # the same data dir: what the SSD tier held is there again
        # Written through to the SSD tier before the kill: found again, byte for byte.
        pages, got = prefetch(b, keys, n, [(sk.PoolName.INDEXER, None, sk.PoolHitPolicy.ALL_PAGES)])
        assert (pages, got) == (n, n)
        for p in range(n):
            assert torch.equal(kv.page((n + p) * 64), kv.page(p * 64))
        b.close()
    finally:
        d.stop()


def test_pages_found_for_a_prefetch_are_hinted_to_the_daemon(daemon):
    """batch_exists and batch_exists_v2 hint what they found (every piece of every page the
    prefetch will read) for hint_ttl seconds; hint_ttl 0 turns hints off."""
    n = 6
    keys = [f"{0x4711_0000 + i:064x}" for i in range(n)]
    absent = [f"{0x4712_0000 + i:064x}" for i in range(2)]
    kv, ix = MLAPool("page_first", n), BytesPerPagePool("page_first", n)
    a = attach(config(daemon.unix), kv, [(sk.PoolName.INDEXER, ix)])
    assert backup(a, keys, 0, side=[sk.PoolName.INDEXER]) == n
    with sparsekv.Client(daemon.unix) as watch:
        given = watch.stats()["hints"]["given_blocks"]
        assert a.batch_exists(keys + absent) == n
        assert a.counters["hints"] == 1 and a.counters["hinted_keys"] == n  # one piece per MLA page
        assert watch.stats()["hints"]["given_blocks"] == given + n
        res = a.batch_exists_v2(keys, [sk.PoolTransfer(name=sk.PoolName.INDEXER, keys=None,
                                                       hit_policy=sk.PoolHitPolicy.ALL_PAGES)])
        assert res.kv_hit_pages == n
        assert a.counters["hints"] == 2 and a.counters["hinted_keys"] == 3 * n  # KV and indexer pages
        assert watch.stats()["hints"]["given_blocks"] == given + 3 * n
        off = attach(config(daemon.unix, hint_ttl=0), kv, [(sk.PoolName.INDEXER, ix)])
        assert off.batch_exists(keys) == n
        assert off.counters["hints"] == 0
        assert watch.stats()["hints"]["given_blocks"] == given + 3 * n
        off.close()
    with pytest.raises(ValueError, match="hint_ttl"):
        sk.SparseKVStorage(config(daemon.unix, hint_ttl=-1), {})
    a.close()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_generic_path_without_interface_v1_round_trips(daemon, layout):
    """Without "interface_v1" SGLang backs up with batch_set and prefetches with batch_exists then
    batch_get: what batch_set stored is found and read back, byte for byte, by another worker
    (bf16 flat pages, as an unquantized MLA pool hands them). batch_exists_v2 finds the KV there
    too, with the side pools."""
    n = 5
    base = 0x6e0_0000 if layout == "page_first" else 0x6e1_0000
    keys, absent = numbered(n, base), numbered(1, base + 0x8000)
    kv_a = MLAPool(layout, 2 * n, dim=576 * 2, dtype=torch.bfloat16)
    ix_a = BytesPerPagePool("page_first", 2 * n)
    for p in range(n):
        kv_a.fill(p * 64, 500 + p)
        ix_a.fill(p * 64, 900 + p)
    a = attach(config(daemon.unix, tp_rank=0, tp_size=2, v1=False), kv_a, [(sk.PoolName.INDEXER, ix_a)])
    assert a.interface_v1 is False
    assert generic_backup(a, kv_a, keys, 0) == n
    kv_b = MLAPool(layout, 2 * n, dim=576 * 2, dtype=torch.bfloat16)
    b = attach(config(daemon.tcp, tp_rank=1, tp_size=2, v1=False), kv_b, [(sk.PoolName.INDEXER,
                                                                          BytesPerPagePool("page_first", 2 * n))])
    assert b.batch_exists(keys + absent) == n
    assert b.exists(keys[0]) is True and b.exists(absent[0]) is False
    assert generic_prefetch(b, kv_b, keys + absent, n) == (n, n)
    for p in range(n):
        assert torch.equal(kv_b.page((n + p) * 64), kv_a.page(p * 64)), p
    assert b.get_stats().sparsekv["bytes_read"] == n * kv_a.get_dummy_flat_data_page().numel() * 2
    # Hybrid: the KV by the generic path, the indexer by batch_set_v2; the v2 hit covers both.
    res = a.batch_set_v2([sk.PoolTransfer(name=sk.PoolName.INDEXER, host_indices=slots(0, n), keys=keys)])
    assert res == {"indexer": [True] * n}
    r = b.batch_exists_v2(keys + absent, [sk.PoolTransfer(name=sk.PoolName.INDEXER,
                                                          hit_policy=sk.PoolHitPolicy.ALL_PAGES)])
    assert (r.kv_hit_pages, r.extra_pool_hit_pages["indexer"]) == (n, n)
    a.close()
    b.close()


def test_a_pool_counts_only_once_registered(daemon):
    """Before register_mem_pool_host nothing is present (batch_exists 0, v1 reads and writes
    fail); a side pool never registered is a miss for that pool whatever its hit policy, so
    batch_exists_v2 reports no hit and batch_get_v2 is never asked for it."""
    n = 4
    keys = numbered(n, 0x6e2_0000)
    kv, ix = MLAPool("page_first", n), BytesPerPagePool("page_first", n)
    for p in range(n):
        kv.fill(p * 64, 70 + p)
        ix.fill(p * 64, 80 + p)
    a = attach(config(daemon.unix), kv, [(sk.PoolName.INDEXER, ix)])
    assert backup(a, keys, 0, side=[sk.PoolName.INDEXER]) == n
    b = sk.SparseKVStorage(config(daemon.unix), {})  # constructed as the factory does, nothing registered
    assert b.batch_exists(keys) == 0
    assert b.exists(keys[0]) is False
    assert b.batch_get_v1(keys, slots(0, n)) == [False] * n
    assert b.batch_set_v1(keys, slots(0, n)) == [False] * n
    assert b.batch_exists_v2(keys, [sk.PoolTransfer(name=sk.PoolName.INDEXER)]).kv_hit_pages == 0
    b.register_mem_pool_host(MLAPool("page_first", n))
    assert b.batch_exists(keys) == n
    asked = []
    get_v2 = b.batch_get_v2
    b.batch_get_v2 = lambda transfers, extra_info=None: asked.append([t.name for t in transfers]) or get_v2(transfers)
    for policy, window in ((sk.PoolHitPolicy.ALL_PAGES, None), (sk.PoolHitPolicy.TRAILING_PAGES, keys[-2:])):
        r = b.batch_exists_v2(keys, [sk.PoolTransfer(name=sk.PoolName.INDEXER, keys=window, hit_policy=policy)])
        assert r.kv_hit_pages == 0, policy
        assert r.extra_pool_hit_pages.get("indexer", 0) == 0, policy
    assert prefetch(b, keys, 0, [(sk.PoolName.INDEXER, None, sk.PoolHitPolicy.ALL_PAGES)]) == (0, 0)
    assert asked == []
    assert b.batch_get_v2([sk.PoolTransfer(name=sk.PoolName.INDEXER, host_indices=slots(0, 2), keys=keys[:2])]) == {
        "indexer": [False, False]}
    # Registered, it counts: the same prefetch now finds and reads every page.
    asked.clear()
    b.register_mem_host_pool_v2(BytesPerPagePool("page_first", n), sk.PoolName.INDEXER)
    assert prefetch(b, keys, 0, [(sk.PoolName.INDEXER, None, sk.PoolHitPolicy.ALL_PAGES)]) == (n, n)
    assert asked == [[sk.PoolName.INDEXER]]
    a.close()
    b.close()


def test_an_unknown_extra_key_warns_naming_the_closest_known_one(daemon, caplog):
    """A key this backend does not know (a newer SGLang's, or a typo) is warned about, naming the
    closest known key, and the backend attaches; a bad value of a known key still refuses."""
    with caplog.at_level(logging.WARNING, logger="sparsekv.sglang"):
        b = attach(config(daemon.unix, adress="unix:/nowhere", hicache_future_knob=3), MLAPool("page_first", 2))
    warned = [r.getMessage() for r in caplog.records if r.name == "sparsekv.sglang" and r.levelno == logging.WARNING]
    assert any("'adress'" in m and "did you mean 'address'" in m for m in warned), warned
    assert any("'hicache_future_knob'" in m for m in warned), warned
    assert len(warned) == 2, warned
    keys = numbered(2, 0x6e3_0000)
    assert b.batch_set_v1(keys, slots(0, 2)) == [True, True]  # attached to the daemon of "address"
    assert b.batch_exists(keys) == 2
    b.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sparsekv.sglang"):
        attach(config(daemon.unix, **{"interface_v1": 1, "prefetch_threshold": 256, "tp_lcm_size": 2}),
               MLAPool("page_first", 2)).close()
    assert [r for r in caplog.records if r.name == "sparsekv.sglang"] == []  # SGLang's own keys: no warning
    with pytest.raises(ValueError, match="'hint_ttl'"):
        sk.SparseKVStorage(config(daemon.unix, hint_ttl="soon", hicache_future_knob=3), {})
