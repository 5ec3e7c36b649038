"""sparsekv.CacheManager from Python: page pools lent to numpy in place (a write through the
array is what C++ reads, and the reverse), arrays outliving the manager, the prefix cache
sharing pages between requests, and errors as the status codes' exceptions."""

import gc

import numpy as np
import pytest

import sparsekv

BLOCK = 64


def manager(capacity=16):
    spec = sparsekv.model_preset("deepseek-v3.2-exp", "fp8")
    return sparsekv.CacheManager(spec, capacity_blocks=capacity, block_tokens=BLOCK)


def test_presets_and_pools():
    assert "deepseek-v3.2-exp" in sparsekv.model_presets()
    spec = sparsekv.model_preset("deepseek-v3.2-exp", "fp8")
    assert spec.num_layers == 61
    assert sparsekv.model_spec_from_json(spec.to_json()).num_layers == 61
    m = manager()
    assert m.num_pools == 2
    kinds = sorted(m.pool_info(i)["kind"] for i in range(m.num_pools))
    assert kinds == ["indexer_key", "mla_latent"]
    for i in range(m.num_pools):
        info = m.pool_info(i)
        arr = m.pool_array(i)
        assert arr.dtype == np.uint8 and arr.flags.writeable
        assert arr.shape == (info["capacity"], info["block_stride"])
        assert info["block_stride"] == len(info["layers"]) * info["layer_stride"]


def test_writes_are_shared_both_ways_without_a_copy():
    m = manager()
    arr = m.pool_array(0)
    arr2 = m.pool_array(0)
    assert arr.ctypes.data == arr2.ctypes.data  # the same memory each time
    arr[3, :] = 0x5A                            # Python writes, C++ reads
    assert m._m._page_bytes(0, 3) == bytes([0x5A]) * arr.shape[1]
    m._m._fill_page(0, 4, 0x17)                 # C++ writes, Python reads
    assert np.all(arr[4] == 0x17)


def test_an_array_outlives_its_manager():
    m = manager()
    arr = m.pool_array(1)
    arr[0, :8] = np.arange(8, dtype=np.uint8)
    del m
    gc.collect()
    assert list(arr[0, :8]) == list(range(8))  # the pool's memory is still there
    arr[1, :] = 1


def test_the_prefix_cache_hands_a_second_request_the_first_ones_pages():
    m = manager()
    prompt = list(range(1000, 1000 + 4 * BLOCK + 1))
    a = m.create_sequence()
    m.append_tokens(a, prompt)
    assert m.acquire_cached_prefix(a)["blocks"] == 0
    alloc = m.allocate_slots(a, len(prompt))
    assert alloc["new_blocks"] == 5
    # The "engine" writes each block's KV through the arrays.
    tables = [m.block_table(a, p) for p in range(m.num_pools)]
    arrays = [m.pool_array(p) for p in range(m.num_pools)]
    for p in range(m.num_pools):
        for b, page in enumerate(tables[p]):
            arrays[p][page, :] = (b * 7 + p + 1) % 256
    m.commit_computed(a, len(prompt))
    m.free(a)
    assert m.lookup_prefix(prompt)["blocks"] == 4
    b = m.create_sequence()
    m.append_tokens(b, prompt)
    hit = m.acquire_cached_prefix(b)
    assert hit["blocks"] == 4 and hit["tokens"] == 4 * BLOCK
    for p in range(m.num_pools):
        table = m.block_table(b, p)
        assert table[:4] == tables[p][:4]
        for blk, page in enumerate(table[:4]):
            assert np.all(arrays[p][page] == (blk * 7 + p + 1) % 256)
    assert m.sequence_info(b)["computed_tokens"] == 4 * BLOCK
    assert m.stats()["hits"] == 1
    m.free(b)


def test_errors():
    m = manager(capacity=4)
    with pytest.raises(sparsekv.NotFound):
        m.free(12345)
    s = m.create_sequence()
    m.append_tokens(s, list(range(10 * BLOCK)))
    with pytest.raises(sparsekv.ResourceExhausted):
        m.allocate_slots(s, 10 * BLOCK)
    with pytest.raises(sparsekv.OutOfRange):
        m.pool_array(7)
    with pytest.raises(sparsekv.NotFound):
        sparsekv.model_preset("no-such-model")
    with pytest.raises(sparsekv.InvalidArgument):
        sparsekv.model_preset("deepseek-v3.2-exp", "fp4")
    with pytest.raises(sparsekv.InvalidArgument):
        sparsekv.CacheManager(sparsekv.model_preset("deepseek-v3.2-exp"), capacity_blocks=0)


def test_memory_planner():
    spec = sparsekv.model_preset("deepseek-v3.2-exp", "fp8")
    plan = sparsekv.plan_for_sequences(spec, batch=4, seq_len=8192, block_tokens=64)
    assert plan["total_bytes"] > 0
    # V3.2 fp8: 656 + 132 bytes per token per layer, 61 layers, 4 x 8192 tokens.
    assert plan["total_bytes"] == 4 * 8192 * 61 * (656 + 132)
    fit = sparsekv.plan_for_budget(spec, plan["total_bytes"], batch=4, block_tokens=64)
    assert fit["seq_len"] == 8192
    with pytest.raises(sparsekv.Error):
        sparsekv.plan_for_budget(spec, 1000, batch=4, block_tokens=64)


def _run(m, tokens):
    seq = m.create_sequence()
    m.append_tokens(seq, tokens)
    m.acquire_cached_prefix(seq)
    m.allocate_slots(seq, len(tokens))
    m.commit_computed(seq, len(tokens))
    m.free(seq)


@pytest.mark.parametrize("eviction", ["lru", "arc"])
def test_a_hinted_prompt_outlives_the_churn(eviction):
    spec = sparsekv.model_preset("deepseek-v3.2-exp", "fp8")
    m = sparsekv.CacheManager(spec, capacity_blocks=12, block_tokens=BLOCK, eviction=eviction)
    assert m.stats()["eviction"] == eviction
    a = [1000 + i for i in range(2 * BLOCK + 1)]
    b = [5000 + i for i in range(2 * BLOCK + 1)]
    _run(m, a)
    _run(m, b)
    h = m.hint_prefix(a, ttl=60)
    assert h["found_blocks"] == 2 and h["protected_blocks"] == 2
    assert m.stats()["hinted_blocks"] == 2
    for k in range(8):
        _run(m, [100000 * (k + 1) + i for i in range(2 * BLOCK + 1)])
    assert m.lookup_prefix(a)["blocks"] == 2, "protected"
    assert m.lookup_prefix(b)["blocks"] == 0, "the unhinted one of the same age went"
    m.drop_hint(h["id"])
    assert m.stats()["hinted_blocks"] == 0
    with pytest.raises(sparsekv.NotFound):
        m.drop_hint(h["id"])
    with pytest.raises(sparsekv.InvalidArgument):
        m.hint_prefix(a, ttl=0)
    with pytest.raises(sparsekv.InvalidArgument):
        sparsekv.CacheManager(spec, capacity_blocks=12, block_tokens=BLOCK, eviction="lfu")
    with pytest.raises(sparsekv.InvalidArgument):
        sparsekv.CacheManager(spec, capacity_blocks=12, block_tokens=BLOCK, hint_bound=2.0)
