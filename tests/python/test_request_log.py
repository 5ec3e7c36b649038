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


def _records(count, tokens_each):
    """Record ends in a segment written by appends of `tokens_each` tokens (request_log.h)."""
    return [16 + i * (24 + 16 + 4 * tokens_each) for i in range(count + 1)]


def _snapshot(path):
    return {p: open(os.path.join(path, p), "rb").read() for p in sorted(os.listdir(path))}


def test_damage_is_refused_unless_cutting_is_asked_for(tmp_path):
    with sparsekv.RequestLog(tmp_path) as log:
        for i in range(40):
            log.append(4, i * 3, [i, i, i])
    seg = sorted(p for p in os.listdir(tmp_path) if p.endswith(".skvlog"))[-1]
    path = os.path.join(tmp_path, seg)
    ends = _records(40, 3)
    assert os.path.getsize(path) == ends[-1]
    with open(path, "r+b") as f:  # a bit flipped in record 20, whole records after it
        f.seek(ends[20] + 30)
        b = f.read(1)
        f.seek(ends[20] + 30)
        f.write(bytes([b[0] ^ 8]))
    before = _snapshot(tmp_path)
    with pytest.raises(sparsekv.Corruption, match=f"{seg} at byte {ends[20]}:"):
        sparsekv.RequestLog(tmp_path)
    assert _snapshot(tmp_path) == before, "a refused open changed nothing"
    with pytest.raises(sparsekv.InvalidArgument):
        sparsekv.RequestLog(tmp_path, recovery="cut_everything")
    with sparsekv.RequestLog(tmp_path, recovery="point_in_time") as log:
        (rid, tokens, _), = log.recover()
        assert rid == 4 and tokens == [t for i in range(20) for t in (i, i, i)]
        s = log.stats()
        assert s["damage_bytes_cut"] == ends[-1] - ends[20]
        assert s["damage_records_cut"] == 19 and s["damage_tokens_cut"] == 57
    with sparsekv.RequestLog(tmp_path) as log:  # cut: it opens by default again
        assert len(log.recover()[0][1]) == 60 and log.stats()["damage_bytes_cut"] == 0


def test_a_newer_releases_segment_is_refused_and_kept(tmp_path):
    with sparsekv.RequestLog(tmp_path) as log:
        log.append(1, 0, [1, 2])
    seg = sorted(p for p in os.listdir(tmp_path) if p.endswith(".skvlog"))[-1]
    newer = "%016x.skvlog" % (int(seg[:16], 16) + 1)
    with open(os.path.join(tmp_path, newer), "wb") as f:
        f.write(b"SKVLOG02" + bytes(8) + b"whatever it holds")
    before = _snapshot(tmp_path)
    for recovery in ("tolerate_torn_tail", "point_in_time"):
        with pytest.raises(sparsekv.NotSupported, match=f"{newer} at byte 0:.*newer release"):
            sparsekv.RequestLog(tmp_path, recovery=recovery)
    assert _snapshot(tmp_path) == before
