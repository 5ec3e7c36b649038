"""Suspend and resume from Python (sparsekv.OffloadedCache.suspend/resume, issue 35): a sequence
suspended mid-block comes back from the tiers with every page byte for byte, its tail key is
what the request log records, and after the log is reopened (as after a crash) the recovered
tokens and suspension resume it; a missing tail says how many tokens to compute again."""

import numpy as np

import sparsekv

BLOCK = 64


def make_cache(tmp_path):
    m = sparsekv.CacheManager(sparsekv.model_preset("deepseek-v3.2-exp", "fp8"), capacity_blocks=12,
                              block_tokens=BLOCK)
    offload = {"host": {"capacity_bytes": "64MiB"},
               "ssd": {"enabled": True, "capacity_bytes": "256MiB", "durability": "fdatasync"}}
    return m, sparsekv.OffloadedCache(m, offload, data_dir=tmp_path, write_policy="write-through")


def decode(cache, seq, tokens, upto, rng, block=BLOCK):
    """Computes tokens [computed, upto): allocate, write random bytes into the new rows' pages, commit."""
    m = cache.manager
    done = m.sequence_info(seq)["computed_tokens"]
    m.allocate_slots(seq, upto)
    for pool in range(m.num_pools):
        arr = m.pool_array(pool)
        table = m.block_table(seq, pool)
        for b in range(done // block, (upto + block - 1) // block):
            arr[table[b], :] = rng.integers(0, 256, size=arr.shape[1], dtype=np.uint8)
    cache.commit_computed(seq, upto)


def pages(m, seq):
    out = {}
    for pool in range(m.num_pools):
        arr = m.pool_array(pool)
        for b, page in enumerate(m.block_table(seq, pool)):
            out[(b, pool)] = arr[page].copy()
    return out


def test_suspend_resume_through_the_log(tmp_path):
    m, cache = make_cache(tmp_path)
    rng = np.random.default_rng(3)
    tokens = [int(t) for t in rng.integers(1, 50000, size=3 * BLOCK + 6)]
    seq = cache.create_sequence()
    cache.append_tokens(seq, tokens)
    state = 3 * BLOCK + 5  # five tokens into the fourth block; the sixth is the next input
    decode(cache, seq, tokens, state, rng)
    before = pages(m, seq)
    info = cache.suspend(seq)
    assert info["tokens"] == state and info["blocks"] == 3 and info["unsaved_blocks"] == 0
    assert len(info["tail"]) == 16
    assert info["tail"] == cache.suspension_key(tokens, state)
    log = sparsekv.RequestLog(tmp_path / "log")
    log.append(7, 0, tokens)
    log.suspended(7, state, info["tail"])
    del log

    cache.wait_idle()
    cache.evict(12)  # L1 empty: everything comes from the tiers
    [(rid, got_tokens, suspension)] = sparsekv.RequestLog(tmp_path / "log").recover()
    assert rid == 7 and got_tokens == tokens
    assert suspension[0] == state and suspension[1] == info["tail"]
    r = cache.resume(got_tokens, suspension[0])
    assert (r["restored_tokens"], r["recompute_tokens"], r["tail_restored"]) == (state, 0, True)
    assert r["lower_blocks"] == 3, r
    after = pages(m, r["seq"])
    assert before.keys() == after.keys()
    for k in before:
        assert np.array_equal(before[k], after[k]), k
    # It goes on as if never stopped: the next token is computed on top of the restored pages.
    decode(cache, r["seq"], got_tokens, state + 1, rng)
    cache.free(r["seq"])


def test_missing_tail_recomputes_from_the_block_edge(tmp_path):
    m, cache = make_cache(tmp_path)
    rng = np.random.default_rng(4)
    tokens = [int(t) for t in rng.integers(1, 50000, size=2 * BLOCK + 10)]
    seq = cache.create_sequence()
    cache.append_tokens(seq, tokens)
    decode(cache, seq, tokens, 2 * BLOCK + 9, rng)
    info = cache.suspend(seq)
    cache.drop_suspension(info["tail"])
    r = cache.resume(tokens, 2 * BLOCK + 9)
    assert r["restored_tokens"] == 2 * BLOCK and r["recompute_tokens"] == 9
    assert not r["tail_restored"] and "not found" in r["lost"]
    try:
        cache.resume(tokens, len(tokens) + 1)
        raise AssertionError("a state past the tokens was accepted")
    except sparsekv.InvalidArgument:
        pass


def test_long_v4_sequence_suspends_as_history_into_small_boundary_pools(tmp_path):
    # V4 (window and compressor state), write-back, window and state pools of 2 pages: 12 blocks
    # are computed a block at a time; their window and state leave L1 and are not demoted whole.
    # The suspend writes every block as a history record (full-history kinds only) plus one tail
    # that holds the window and state at the token; a resume into the same small pools gives
    # every page back.
    block = 128
    m = sparsekv.CacheManager(sparsekv.model_preset("deepseek-v4-flash", "fp8"), capacity_blocks=16,
                              block_tokens=block, window_capacity_blocks=2, state_capacity_blocks=2)
    offload = {"host": {"capacity_bytes": "256MiB"},
               "ssd": {"enabled": True, "capacity_bytes": "512MiB", "durability": "fdatasync"}}
    cache = sparsekv.OffloadedCache(m, offload, data_dir=tmp_path, write_policy="write-back",
                                    demote_on_boundary_eviction=False)
    rng = np.random.default_rng(5)
    state = 12 * block + 40
    tokens = [int(t) for t in rng.integers(1, 50000, size=state + 1)]
    seq = cache.create_sequence()
    cache.append_tokens(seq, tokens)
    for upto in list(range(block, state, block)) + [state]:
        decode(cache, seq, tokens, upto, rng, block)  # from the computed tokens to `upto`

    def held(s):
        out = {}
        for pool in range(m.num_pools):
            arr = m.pool_array(pool)
            for b, page in enumerate(m.block_table(s, pool)):
                if page < arr.shape[0]:
                    out[(b, pool)] = arr[page].copy()
        return out

    before = held(seq)
    info = cache.suspend(seq)
    assert info["history_blocks"] == info["written_blocks"] == 12, info
    cache.wait_idle()
    cache.evict(16)
    stats = cache.stats()
    assert stats["boundary_evictions_not_demoted"] > 0, stats
    r = cache.resume(tokens, state)
    assert (r["restored_tokens"], r["recompute_tokens"], r["tail_restored"]) == (state, 0, True), r
    after = held(r["seq"])
    assert before.keys() == after.keys()
    for k in before:
        assert np.array_equal(before[k], after[k]), k
    decode(cache, r["seq"], tokens, state + 1, rng, block)
    cache.free(r["seq"])


# ---- the request log through sparsekvd (LOG_* operations) ----

def test_daemon_request_log_survives_kill_and_keeps_namespaces_apart(daemon):
    a = sparsekv.Client(daemon.unix, "alpha", "alpha-token")
    b = sparsekv.Client(daemon.tcp, "beta", "beta-token")
    a.log_append(1, 0, [5, 6, 7])
    a.log_append(1, 3, [8])
    a.log_append(2, 0, [9] * 1000)
    tail = bytes(range(16))
    a.log_suspended(1, 3, tail, 42)
    b.log_append(1, 0, [100])  # the same id in another namespace is another request
    try:
        a.log_append(1, 7, [1])  # does not continue request 1
        raise AssertionError("a gap was accepted")
    except sparsekv.FailedPrecondition:
        pass
    a.log_append(3, 0, [1])
    a.log_finish(3)
    assert a.log_recover() == [(1, [5, 6, 7, 8], (3, tail, 42)), (2, [9] * 1000, None)]
    assert b.log_recover() == [(1, [100], None)]
    a.close()
    b.close()

    daemon.kill_and_restart()  # SIGKILL: what was acknowledged is in the log
    a = sparsekv.Client(daemon.unix, "alpha", "alpha-token")
    assert a.log_recover() == [(1, [5, 6, 7, 8], (3, tail, 42)), (2, [9] * 1000, None)]
    a.log_append(1, 4, [10])
    try:
        a.log_suspended(2, 1001, tail)  # past its tokens
        raise AssertionError("a suspension past the tokens was accepted")
    except sparsekv.FailedPrecondition:
        pass
    a.log_finish(1)
    a.log_finish(2)
    assert a.log_recover() == []
    try:
        a.log_finish(2)
        raise AssertionError("a finished request was finished twice")
    except sparsekv.NotFound:
        pass
    a.close()
