"""sparsekv.RequestLog from Python: tokens and suspensions survive a reopen, finished requests
do not, refusals raise the status's exception, and a torn tail is cut."""

import os

import pytest

import sparsekv


def test_round_trip_and_refusals(tmp_path):
    with sparsekv.RequestLog(tmp_path) as log:
        log.append(1, 0, [5, 6, 7])
        log.append(1, 3, [8])
        log.append(2, 0, [1])
        log.suspended(1, 4, b"k" * 16, tag=9)
        log.finish(2)
        with pytest.raises(sparsekv.FailedPrecondition):
            log.append(1, 9, [1])
        with pytest.raises(sparsekv.NotFound):
            log.finish(2)
        with pytest.raises(ValueError):
            log.suspended(1, 1, b"short")
        with pytest.raises(ValueError):
            log.append(1, 4, [1 << 40])
        assert log.stats()["tokens"] == 5
    with sparsekv.RequestLog(tmp_path) as log:
        assert log.recover() == [(1, [5, 6, 7, 8], (4, b"k" * 16, 9))]
    with pytest.raises(sparsekv.InvalidArgument):
        sparsekv.RequestLog(tmp_path, durability="sometimes")


def test_a_torn_tail_is_cut(tmp_path):
    with sparsekv.RequestLog(tmp_path) as log:
        for i in range(10):
            log.append(3, i * 2, [i, i])
    seg = sorted(p for p in os.listdir(tmp_path) if p.endswith(".skvlog"))[-1]
    path = os.path.join(tmp_path, seg)
    os.truncate(path, os.path.getsize(path) - 5)
    with sparsekv.RequestLog(tmp_path) as log:
        (rid, tokens, susp), = log.recover()
        assert rid == 3 and tokens == [t for i in range(9) for t in (i, i)] and susp is None
        assert log.stats()["torn_bytes_cut"] > 0
