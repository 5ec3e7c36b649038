"""sparsekv.OffloadedCache and KV events from Python: blocks evicted from L1 come back from the
host and SSD tiers byte for byte into fresh pages, the write-back rules (evict through the
cache, one write-back cache per manager) hold, bad offload options name their key, and a
manager's KV events arrive as Python objects in order, with overflow counted."""

import gc
import threading

import numpy as np
import pytest

import sparsekv

BLOCK = 64


def manager(capacity=16):
    return sparsekv.CacheManager(sparsekv.model_preset("deepseek-v3.2-exp", "fp8"), capacity_blocks=capacity,
                                 block_tokens=BLOCK)


def prompt(blocks, seed):
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(1, 50000, size=blocks * BLOCK + 1)]


def pattern_of(seed):
    return lambda b, pool: (seed * 31 + b * 7 + pool * 3) % 251 + 1


def fill_new(m, seq, first_block, pattern):
    for pool in range(m.num_pools):
        arr = m.pool_array(pool)
        for b, page in enumerate(m.block_table(seq, pool)):
            if b >= first_block:
                arr[page, :] = pattern(b, pool)


def request(cache, tokens, pattern):
    m = cache.manager
    seq = cache.create_sequence()
    cache.append_tokens(seq, tokens)
    hit = cache.acquire_prefix(seq)
    m.allocate_slots(seq, len(tokens))
    fill_new(m, seq, hit["blocks"], pattern)
    cache.commit_computed(seq, len(tokens))
    return seq, hit


def assert_pages(m, seq, blocks, pattern):
    for pool in range(m.num_pools):
        arr = m.pool_array(pool)
        table = m.block_table(seq, pool)
        for b in range(blocks):
            assert np.all(arr[table[b]] == pattern(b, pool)), (pool, b)


@pytest.mark.parametrize("policy", ["write-through", "write-back"])
@pytest.mark.parametrize("tiers", ["host", "host+ssd"])
def test_evicted_blocks_come_back_byte_for_byte(tmp_path, policy, tiers):
    m = manager(capacity=16)
    offload = {"host": {"capacity_bytes": "64MiB"}}
    if tiers == "host+ssd":
        offload = {"host": {"capacity_bytes": 3 * m.pool_info(0)["block_stride"] + (1 << 20)},
                   "ssd": {"enabled": True, "capacity_bytes": "256MiB", "durability": "none"}}
    cache = sparsekv.OffloadedCache(m, offload, data_dir=tmp_path, write_policy=policy)
    tokens, pat = prompt(10, 1), pattern_of(1)
    seq, hit = request(cache, tokens, pat)
    assert hit["blocks"] == 0
    cache.free(seq)
    assert cache.evict(16) == 10  # every cached block leaves L1
    cache.wait_idle()
    assert m.lookup_prefix(tokens)["blocks"] == 0
    look = cache.lookup_prefix(tokens)
    assert (look["l1_blocks"], look["lower_blocks"]) == (0, 10)
    st = cache.stats()
    assert st["demoted_blocks"] == 10 and st["demote_failures"] == 0
    assert [t["name"] for t in st["tiers"]][0].startswith("host")
    if tiers == "host+ssd":
        assert len(st["tiers"]) == 2 and st["tiers"][1]["items"] > 0  # the host tier's room is 3 blocks
    # A second request restores them into fresh pages; every byte is the first one's.
    seq2, hit2 = request(cache, tokens, pattern_of(99))
    assert (hit2["l1_blocks"], hit2["lower_blocks"], hit2["blocks"]) == (0, 10, 10)
    assert_pages(m, seq2, 10, pat)
    assert cache.stats()["restored_blocks"] == 10


def test_write_back_rules(tmp_path):
    m = manager()
    cache = sparsekv.OffloadedCache(m, {}, write_policy="write-back")
    with pytest.raises(sparsekv.FailedPrecondition):
        sparsekv.OffloadedCache(m, {}, write_policy="write-back")  # one eviction hook per manager
    tokens = prompt(4, 2)
    seq, _ = request(cache, tokens, pattern_of(2))
    cache.free(seq)
    with pytest.raises(sparsekv.FailedPrecondition):
        m.evict(16)  # would drop blocks the tiers never got
    assert cache.evict(16, max_blocks=1) == 1  # max_blocks bounds it
    assert cache.evict(16) == 3
    cache.wait_idle()
    assert cache.stats()["evicted_demoted"] == 4
    del cache
    gc.collect()
    assert m.evict(16) == 0  # allowed again once the write-back cache is gone; nothing left to evict
    again = sparsekv.OffloadedCache(m, {}, write_policy="write-back")
    assert again.lookup_prefix(tokens)["lower_blocks"] == 0  # a new host tier: empty


def test_a_cache_outlives_its_manager_object(tmp_path):
    m = manager()
    cache = sparsekv.OffloadedCache(m, {}, write_policy="write-back")
    tokens = prompt(3, 3)
    seq, _ = request(cache, tokens, pattern_of(3))
    cache.free(seq)
    cache.manager = None  # the Python owner goes; the cache keeps the C++ manager
    del m
    gc.collect()
    assert cache.evict(16) == 3
    cache.wait_idle()
    assert cache.lookup_prefix(tokens)["lower_blocks"] == 3
    del cache
    gc.collect()


def test_bad_offload_options_name_their_key(tmp_path):
    m = manager()
    with pytest.raises(sparsekv.InvalidArgument, match=r"offload\.host\.capacity_bytes"):
        sparsekv.OffloadedCache(m, {"host": {"capacity_bytes": "lots"}})
    with pytest.raises(sparsekv.InvalidArgument, match=r"offload\.ssd\.depth: unknown key"):
        sparsekv.OffloadedCache(m, {"ssd": {"depth": 3}})
    with pytest.raises(sparsekv.InvalidArgument, match="write policy"):
        sparsekv.OffloadedCache(m, {}, write_policy="sometimes")
    with pytest.raises(sparsekv.InvalidArgument, match="no tier"):
        sparsekv.OffloadedCache(m, {"host": {"enabled": False}})
    # None of these took the manager's write-back slot.
    sparsekv.OffloadedCache(m, {}, write_policy="write-back")


def test_kv_events_arrive_in_order_with_the_block_hashes():
    m = manager(capacity=8)
    q = m.subscribe()
    tokens = prompt(3, 4)
    seq = m.create_sequence()
    m.append_tokens(seq, tokens)
    m.allocate_slots(seq, len(tokens))
    m.commit_computed(seq, len(tokens))
    m.free(seq)
    assert m.evict(8) == 3
    m.reset()
    events = q.drain()
    types = [e.type for e in events]
    assert types[0] == "blocks_stored" and types[-1] == "all_cleared" and "blocks_removed" in types
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
    stored = [h for e in events if e.type == "blocks_stored" for h in e.block_hashes]
    assert stored == sparsekv.block_hashes(tokens, BLOCK)  # the keys sparsekvd would file them under
    first = events[0]
    assert first.block_tokens == BLOCK and len(first.parent_hash) == 16
    assert set(first.kinds) == {"mla_latent", "indexer_key"}
    removed = {h for e in events if e.type == "blocks_removed" for h in e.block_hashes}
    assert removed == set(stored)
    assert events[-1].parent_hash is None
    assert q.pending == 0 and q.dropped == 0
    assert repr(first).startswith("sparsekv.KvEvent(blocks_stored")


def test_kv_event_queue_overflow_wait_and_close():
    m = manager(capacity=8)
    q = m.subscribe(max_events=2)
    for i in range(4):  # each request stores its own blocks: 4 events, 2 kept
        seq = m.create_sequence()
        tokens = prompt(1, 10 + i)
        m.append_tokens(seq, tokens)
        m.allocate_slots(seq, len(tokens))
        m.commit_computed(seq, len(tokens))
        m.free(seq)
    assert q.pending == 2 and q.dropped == 2
    kept = q.drain()
    assert [e.sequence_number for e in kept] == [3, 4]  # the oldest went
    # A drain with a timeout wakes when another thread's event arrives.
    got = []
    t = threading.Thread(target=lambda: got.extend(q.drain(timeout=10.0)))
    t.start()
    m.reset()
    t.join(timeout=10.0)
    assert not t.is_alive() and [e.type for e in got] == ["all_cleared"]
    with q:
        pass  # closed: nothing more is queued
    m.reset()
    assert q.pending == 0 and q.drain(timeout=0.01) == []
    with pytest.raises(sparsekv.InvalidArgument):
        m.subscribe(max_events=0)
