"""KV events on vLLM's wire (sparsekv/vllm_kv_events.h) against a real sparsekvd.

The subscriber here is written from vLLM's schema (vllm/distributed/kv_events.py; see
docs/guide/kv-events.md for the commit read), with python3-zmq and python3-msgpack only:
- a ZMQ SUB socket; every message is [topic, 8-byte big-endian sequence, msgpack payload];
- the payload is [ts, [events], data_parallel_rank]; an event is a map tagged "type"
  (current vLLM) or, from older vLLM, an array whose first element is the tag;
- a DEALER socket asks the ROUTER replay socket for batches from a sequence number:
  ["", start_seq] out, ["", topic, seq, payload] back per batch, then ["", "", -1, ""].

It keeps an index per medium and must end equal to what the daemon holds per tier (RESP's
INFO items per tier, KEYS for the blocks) after a mixed load with a kill -9 restart, eviction and
demotion to the SSD tier; a subscriber that starts late, or falls behind past the high-water
mark, catches up through replay; events the daemon drops show as sequence gaps and in /metrics;
and over `sparsekv replay` of the Mooncake trace, an index built from the events predicts exactly
the hits the cache serves. SPARSEKV_KV_EVENTS_SECONDS sets the mixed load's length (default 8;
60 for the issue's run).
"""

import os
import random
import shutil
import socket
import threading
import time
import json
import subprocess
import tempfile
import urllib.request

import msgpack
import pytest
import redis
import zmq
import zmq.utils.monitor

from daemon_process import Daemon

END_SEQ = (-1).to_bytes(8, "big", signed=True)

# Field order of the positional (array_like) events of older vLLM, after the tag.
LEGACY_FIELDS = {
    "BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name"],
    "BlockRemoved": ["block_hashes", "medium"],
    "AllBlocksCleared": [],
}
# Current vLLM's fields in declaration order: required ones always sent, optional ones only when
# not their default (msgspec omit_defaults).
REQUIRED = {
    "BlockStored": ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name"],
    "BlockRemoved": ["type", "block_hashes", "medium"],
    "AllBlocksCleared": ["type"],
}
OPTIONAL = {
    "BlockStored": ["event_version", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
                    "locality", "ownership"],
    "BlockRemoved": ["group_idx", "locality", "ownership"],
    "AllBlocksCleared": [],
}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def decode_events(payload):
    """[(type, fields)] from one payload, in vLLM's layout (map events, or legacy arrays)."""
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    assert isinstance(batch, list) and len(batch) in (2, 3), batch
    out = []
    for ev in batch[1]:
        if isinstance(ev, dict):
            out.append((ev["type"], ev))
        else:
            tag = ev[0]
            out.append((tag, dict(zip(LEGACY_FIELDS[tag], ev[1:]))))
    return out


def hash_key(h):
    return h.hex() if isinstance(h, bytes) else int(h)


class Index:
    """What a router keeps: per medium, the block hashes held."""

    def __init__(self):
        self.media = {}

    def apply(self, payload):
        for tag, f in decode_events(payload):
            if tag == "BlockStored":
                self.media.setdefault(f.get("medium") or "GPU", set()).update(hash_key(h) for h in f["block_hashes"])
            elif tag == "BlockRemoved":
                s = self.media.setdefault(f.get("medium") or "GPU", set())
                s.difference_update(hash_key(h) for h in f["block_hashes"])
            elif tag == "AllBlocksCleared":
                self.media = {}

    def snapshot(self):
        return {m: set(s) for m, s in self.media.items() if s}


class Subscriber:
    """What a router runs: a live SUB socket, replay on a sequence gap, and a fresh index when the
    publisher restarted (the socket monitor saw its connection drop), rebuilt through replay from
    0 (a new publisher starts with AllBlocksCleared)."""

    def __init__(self, endpoint, replay_endpoint, topic="", rcvhwm=0, rcvbuf=None):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.setsockopt(zmq.RCVHWM, rcvhwm)
        if rcvbuf is not None:
            self.sub.setsockopt(zmq.RCVBUF, rcvbuf)
        self.monitor = self.sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.index = Index()
        self.expected = 0  # a publisher numbers its batches from 0
        self.gaps = 0  # gaps seen live (each filled by replay as far as the buffer holds)
        self.missing = set()  # sequence numbers neither live nor in replay (the publisher dropped)
        self.replays = 0
        self.replays_since_restart = 0  # asked of the current publisher
        self.restarts = 0
        self.publisher_lost = False
        self.batches = 0
        self.payloads = []
        self.lock = threading.RLock()
        self.stop = False
        self.paused = False
        self.thread = None

    def replay(self, start):
        """Batches from `start` on, as [(seq, payload)], through the ROUTER socket."""
        d = self.ctx.socket(zmq.DEALER)
        d.connect(self.replay_endpoint)
        d.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert d.poll(10000), "no replay reply"
            frames = d.recv_multipart()
            assert len(frames) == 4 and frames[0] == b"", frames[:2]  # "", topic, seq, payload
            if frames[2] == END_SEQ:
                assert frames[1] == b"" and frames[3] == b""
                break
            out.append((int.from_bytes(frames[2], "big"), frames[3]))
        d.close(0)
        self.replays += 1
        self.replays_since_restart += 1
        return out

    def _apply(self, seq, payload):
        self.index.apply(payload)
        self.payloads.append((seq, payload))
        self.batches += 1

    def _take(self, seq, payload):
        with self.lock:
            if seq < self.expected and not self.publisher_lost:
                return  # had it already (through replay)
            if self.publisher_lost:
                # A new publisher (the connection dropped): what it sent before this batch, from
                # its first.
                self.publisher_lost = False
                self.restarts += 1
                self.replays_since_restart = 0
                self.index = Index()
                self.expected = 0
            if seq > self.expected:
                self.gaps += 1
                got = {s: p for s, p in self.replay(self.expected) if self.expected <= s < seq}
                for s in range(self.expected, seq):
                    if s in got:
                        self._apply(s, got[s])
                    else:
                        self.missing.add(s)
            self._apply(seq, payload)
            self.expected = seq + 1

    def catch_up(self):
        """A late subscriber: everything it lacks (from 0 for a new one) through replay."""
        with self.lock:
            for seq, payload in self.replay(self.expected):
                if seq >= self.expected:
                    self._take(seq, payload)

    def run(self):
        poller = zmq.Poller()
        poller.register(self.sub, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        while not self.stop:
            if self.paused:
                time.sleep(0.02)
                continue
            ready = dict(poller.poll(50))
            if self.monitor in ready:
                ev = zmq.utils.monitor.recv_monitor_message(self.monitor)
                if ev["event"] == zmq.EVENT_DISCONNECTED:
                    with self.lock:
                        self.publisher_lost = True
                continue
            if self.sub in ready:
                topic, seq, payload = self.sub.recv_multipart()
                self._take(int.from_bytes(seq, "big"), payload)

    def start(self):
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def close(self):
        self.stop = True
        if self.thread:
            self.thread.join()
        self.sub.disable_monitor()
        self.monitor.close(0)
        self.sub.close(0)
        self.ctx.destroy(linger=0)


# ---- (a) the wire, without a daemon ----

def test_reference_payloads_decode():
    """Payloads laid out as vLLM writes them: current (map events; a capture from vLLM 0.26 has
    this shape) and older (positional events)."""
    current = msgpack.packb([1789095808.83, [
        {"type": "BlockStored", "block_hashes": [15760518052499183552], "parent_block_hash": None,
         "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None,
         "extra_keys": [None], "group_idx": 0, "kv_cache_spec_kind": "full_attention"},
        {"type": "BlockRemoved", "block_hashes": [15760518052499183552], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
        {"type": "BlockStored", "block_hashes": [b"\x01" * 16], "parent_block_hash": b"\x02" * 16,
         "token_ids": [3, 4], "block_size": 2, "lora_id": None, "medium": "CPU", "lora_name": None}], 0],
        use_bin_type=True)
    legacy = msgpack.packb([1.0, [["BlockStored", [7, 8], None, [1, 2, 3, 4], 2, None, "GPU", None],
                                  ["BlockRemoved", [7], "GPU"]], 0], use_bin_type=True)
    idx = Index()
    idx.apply(current)
    assert idx.snapshot() == {"CPU": {(b"\x01" * 16).hex()}}
    idx = Index()
    idx.apply(legacy)
    assert idx.snapshot() == {"GPU": {8}}


def check_reference_layout(payload):
    """Our bytes, held strictly to current vLLM's layout: array batch, map events whose keys are
    the required fields in declaration order, then only known optional ones."""
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    assert isinstance(batch, list) and len(batch) == 3
    assert isinstance(batch[0], float) and isinstance(batch[2], int)
    for ev in batch[1]:
        assert isinstance(ev, dict)
        keys = list(ev.keys())
        tag = ev["type"]
        assert keys[:len(REQUIRED[tag])] == REQUIRED[tag], keys
        assert all(k in OPTIONAL[tag] for k in keys[len(REQUIRED[tag]):]), keys
        if tag != "AllBlocksCleared":
            assert all(isinstance(h, (bytes, int)) for h in ev["block_hashes"])
            assert ev["medium"] in ("GPU", "CPU", "DISK", "SHARED")
        if tag == "BlockStored":
            assert isinstance(ev["token_ids"], list) and isinstance(ev["block_size"], int)


# ---- a daemon under load ----

def ground_truth(r):
    """Per medium, the daemon's item counts, and every block (32-hex bridge keys)."""
    info = r.info("all")
    counts = {}
    for k, v in info.items():
        if k.startswith("tier") and isinstance(v, dict):
            medium = {"host": "CPU"}.get(v["name"], "DISK")
            counts[medium] = counts.get(medium, 0) + int(v["items"])
    keys = {k.decode() for k in r.keys("*")}
    return counts, keys


def tier_evictions(r):
    """{tier name: evictions} (host evictions go down to the SSD tier: demotions)."""
    return {v["name"]: int(v["evictions"]) for k, v in r.info("all").items()
            if k.startswith("tier") and isinstance(v, dict)}


def wait_equal(sub, r, timeout=15):
    """Waits until the subscriber's index per medium equals the daemon's: the same item count per
    medium and the same blocks (0 missing, 0 extra)."""
    deadline = time.monotonic() + timeout
    while True:
        counts, keys = ground_truth(r)
        with sub.lock:
            snap = sub.index.snapshot()
        got_counts = {m: len(s) for m, s in snap.items()}
        union = set().union(*snap.values()) if snap else set()
        want_counts = {m: c for m, c in counts.items() if c}
        if got_counts == want_counts and union == keys:
            return snap
        if time.monotonic() > deadline:
            missing = keys - union
            extra = union - keys
            pytest.fail(f"index per medium {got_counts} != daemon {want_counts}; "
                        f"{len(missing)} blocks missing, {len(extra)} extra")
        time.sleep(0.2)


def metrics(port):
    """sparsekv_kv_events_* of /metrics, as {name: value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("sparsekv_kv_events"):
            name, value = line.split()
            out[name] = float(value)
    return out


def evented_daemon(ssd_bytes="8MiB", **kv):
    port, replay_port, metrics_port = _free_port(), _free_port(), _free_port()
    events = {"endpoint": f"tcp://127.0.0.1:{port}", "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
              "topic": "kv@test-pod@deepseek", "hash": "bytes", "buffer_batches": 100000, "tick_ms": 50}
    events.update(kv)
    d = Daemon(resp=True, host_bytes="2MiB", ssd_bytes=ssd_bytes, ssd_durability="none",
               extra_config={"kv_events": events, "metrics_listen": f"127.0.0.1:{metrics_port}"})
    d.kv_endpoint = events["endpoint"]
    d.kv_replay = events["replay_endpoint"]
    d.metrics_port = metrics_port
    return d


def mixed_load(d, seconds, restart_at=None, keys=400, on_restart=None):
    """PUT (55%), GET (30%), DELETE (15%) of 8-64 KiB values over `keys` bridge keys: the 2 MiB
    host tier demotes to the 8 MiB SSD tier, which evicts; FLUSHDB at 40% of the time; a kill -9
    and restart at `restart_at` of it."""
    rng = random.Random(49)
    r = redis.Redis(host="127.0.0.1", port=d.resp_port, socket_timeout=30)
    names = [rng.getrandbits(128).to_bytes(16, "big").hex() for _ in range(keys)]
    start = time.monotonic()
    flushed = restarted = False
    ops = 0
    while time.monotonic() - start < seconds:
        elapsed = time.monotonic() - start
        if not flushed and elapsed > seconds * 0.4:
            r.flushdb()
            flushed = True
        if restart_at is not None and not restarted and elapsed > seconds * restart_at:
            if on_restart:
                on_restart(r)
            r.close()
            d.kill_and_restart()  # SIGKILL: no drain; the SSD tier's blocks come back
            r = redis.Redis(host="127.0.0.1", port=d.resp_port, socket_timeout=30)
            restarted = True
        k = rng.choice(names)
        op = rng.random()
        if op < 0.55:
            r.set(k, os.urandom(rng.choice((8192, 32768, 65536))))
        elif op < 0.85:
            r.get(k)
        else:
            r.delete(k)
        ops += 1
    return r, ops


def burst_load(d, seconds, value_bytes=1024):
    """Pipelined SETs of new keys: thousands of blocks a second stored, demoted and evicted,
    so every tick's batch is large."""
    r = redis.Redis(host="127.0.0.1", port=d.resp_port, socket_timeout=30)
    value = os.urandom(value_bytes)
    start = time.monotonic()
    n = 0
    while time.monotonic() - start < seconds:
        p = r.pipeline(transaction=False)
        for _ in range(200):
            p.set(os.urandom(16).hex(), value)
        p.execute()
        n += 200
    return n


def test_index_per_medium_equals_the_daemon_after_a_mixed_load():
    """(a) PUT, GET, DELETE, demotion to the SSD tier, eviction, FLUSHDB and a kill -9 restart:
    the index per medium ends equal to the daemon's; a late subscriber gets the same by replay."""
    d = evented_daemon()
    seconds = float(os.environ.get("SPARSEKV_KV_EVENTS_SECONDS", "8"))
    sub = Subscriber(d.kv_endpoint, d.kv_replay, "kv@")
    sub.start()  # what was published before it joined comes through replay (a gap from 0)
    before_restart = {}
    try:
        r, ops = mixed_load(d, seconds, restart_at=0.7,
                            on_restart=lambda r: before_restart.update(tier_evictions(r)))
        snap = wait_equal(sub, r)
        after = tier_evictions(r)
        assert before_restart["host"] + after["host"] > 0, "no demotion to the SSD tier"
        assert before_restart["ssd"] + after["ssd"] > 0, "the SSD tier evicted nothing"
        assert "DISK" in snap and "CPU" in snap, snap.keys()
        assert sub.restarts >= 1, "the restart was not seen"
        print(f"{ops} ops in {seconds:.0f} s; index {({m: len(v) for m, v in snap.items()})} equals the daemon's; "
              f"evictions before/after the restart {before_restart} {after}; {sub.batches} batches, "
              f"{sub.replays} replays, {sub.restarts} restarts")
        assert not sub.missing, f"batches lost: {sorted(sub.missing)[:10]}"
        for _, p in sub.payloads[:300]:
            check_reference_layout(p)
        m = metrics(d.metrics_port)
        assert m["sparsekv_kv_events_dropped_total"] == 0 and m["sparsekv_kv_events_sequence_gaps_total"] == 0
        # The restarted daemon served every replay the subscriber asked of it (one when it joined
        # after the daemon's first batch, as it usually does; none when it was in time for it).
        assert m["sparsekv_kv_events_replay_requests_total"] == sub.replays_since_restart
        # Ticks follow the tiers' journals: the restarted daemon listed its tiers once, at start.
        assert m["sparsekv_kv_events_listings_total"] == 1

        # A subscriber that starts late catches up through replay alone.
        late = Subscriber(d.kv_endpoint, d.kv_replay, "kv@")
        try:
            late.catch_up()
            assert late.index.snapshot() == sub.index.snapshot()
        finally:
            late.close()
    finally:
        sub.close()
        d.stop()


def test_a_subscriber_behind_past_the_high_water_mark_catches_up_through_replay():
    """(b) The PUB socket's high-water mark is 1 message and the subscriber's too, with a small
    receive buffer; it stops reading for a while under load: ZMQ drops batches for it (gaps it
    sees), replay fills them, and its index ends equal to the daemon's. The daemon dropped
    nothing itself."""
    # No SSD tier: a burst of small PUTs leaves it a write-back backlog that stalls later PUTs
    # for seconds (not this test's subject).
    # Over ipc:// (a Unix socket's fixed buffers; TCP's autotuned ones would hold the whole
    # backlog).
    tmp = tempfile.mkdtemp(prefix="sparsekv_kv_")
    d = evented_daemon(ssd_bytes=None, tick_ms=10, send_hwm=1, endpoint=f"ipc://{tmp}/kv.sock")
    sub = Subscriber(d.kv_endpoint, d.kv_replay, "kv@", rcvhwm=1, rcvbuf=4096)
    sub.start()
    try:
        r, _ = mixed_load(d, 1.0, keys=3000)
        wait_equal(sub, r)
        with sub.lock:
            gaps, batches = sub.gaps, sub.batches
        replayed = metrics(d.metrics_port)["sparsekv_kv_events_replayed_batches_total"]
        sub.paused = True
        burst_load(d, 3.0)
        sub.paused = False
        mixed_load(d, 1.0, keys=3000)
        wait_equal(sub, r)
        assert sub.gaps > gaps, "the subscriber never fell behind past the high-water mark"
        assert not sub.missing, "replay did not fill every gap"
        m = metrics(d.metrics_port)
        assert m["sparsekv_kv_events_dropped_total"] == 0
        assert m["sparsekv_kv_events_replayed_batches_total"] > replayed
        print(f"gaps {sub.gaps - gaps}, batches {sub.batches - batches}, "
              f"replayed {m['sparsekv_kv_events_replayed_batches_total'] - replayed}")
    finally:
        sub.close()
        d.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def test_dropped_events_show_as_sequence_gaps_and_in_metrics():
    """(c) A queue of 3 events: a tick with more changes than that loses some. The subscriber
    sees each loss as a sequence number that neither the live stream nor replay has, /metrics
    counts the same gaps and the dropped events, and the daemon resyncs (AllBlocksCleared, then
    everything), so the index still ends equal to the daemon's."""
    d = evented_daemon(tick_ms=20, max_queued_events=3)
    sub = Subscriber(d.kv_endpoint, d.kv_replay, "kv@")
    sub.start()
    try:
        r, _ = mixed_load(d, 4.0)
        wait_equal(sub, r)
        m = metrics(d.metrics_port)
        assert m["sparsekv_kv_events_dropped_total"] > 0, m
        assert m["sparsekv_kv_events_resyncs_total"] >= 1, m
        with sub.lock:
            missing = set(sub.missing)
            expected = sub.expected
        # Every sequence number skipped so far: the subscriber saw each as a gap.
        assert len(missing) == m["sparsekv_kv_events_sequence_gaps_total"] > 0, (missing, m)
        assert max(missing) < expected
    finally:
        sub.close()
        d.stop()


# ---- `sparsekv replay`: the library's CacheManager publishing ----

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
TRACE = os.path.join(ROOT, "..", "shared", "data", "mooncake_conversation_trace.jsonl")
CLI = os.path.join(os.path.dirname(os.path.abspath(os.environ.get("SPARSEKVD_PATH", "build/release/api/sparsekvd"))),
                   "sparsekv")


def predicted_hits(index, hashes):
    """What a router predicts a prompt hits: its leading blocks that the index holds (GPU)."""
    held = index.media.get("GPU", set())
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += 1
    return n


@pytest.mark.skipif(not os.path.exists(TRACE), reason="no Mooncake trace in ../shared/data")
@pytest.mark.parametrize("hash_mode,token_ids", [("uint64", True), ("bytes", False)])
def test_replay_events_predict_the_hits_the_cache_serves(hash_mode, token_ids):
    """A slice of the Mooncake conversation trace through `sparsekv replay` with events on and a
    capacity that evicts: replaying the events in order up to each request's lookup, the index
    predicts exactly the blocks it hits (every request, hits and misses)."""
    requests = int(os.environ.get("SPARSEKV_KV_EVENTS_REPLAY_REQUESTS", "1500"))
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "slice.jsonl")
        with open(TRACE) as f, open(trace, "w") as out:
            for _, line in zip(range(requests), f):
                out.write(line)
        log = os.path.join(tmp, "requests.jsonl")
        endpoint = f"ipc://{tmp}/kv.sock"
        replay_endpoint = f"ipc://{tmp}/kv-replay.sock"
        sub = Subscriber(endpoint, replay_endpoint, "kv@")
        sub.start()
        proc = subprocess.Popen([CLI, "replay", "--trace", trace, "--capacity-blocks", "1500",
                                 "--kv-events-endpoint", endpoint, "--kv-events-replay-endpoint", replay_endpoint,
                                 "--kv-events-topic", "kv@replay@single-kind", "--kv-events-hash", hash_mode,
                                 "--kv-events-hold-ms", "20000", "--requests-out", log, "--json"]
                                + (["--kv-events-token-ids"] if token_ids else []),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            text = ""
            while True:  # the JSON comes first; the publisher then stays up for replay
                line = proc.stdout.readline()
                assert line, proc.stderr.read()
                text += line
                if line.rstrip() == "}":
                    break
            res = json.loads(text)
            ev = res["kv_events"]
            assert ev["dropped"] == 0
            deadline = time.monotonic() + 20
            while sub.expected < ev["next_sequence"]:
                assert time.monotonic() < deadline, f"{sub.expected} of {ev['next_sequence']} batches"
                time.sleep(0.1)
                if sub.expected == 0:
                    sub.catch_up()  # the live stream ended before this SUB joined: all by replay
        finally:
            proc.terminate()
            proc.wait()
            sub.close()
        assert not sub.missing and sub.restarts == 0
        # Every event in publishing order.
        events = []
        for seq, payload in sorted(sub.payloads):
            events.extend(decode_events(payload))
        assert len(events) == ev["events"]
        index = Index()
        applied = 0
        records = [json.loads(x) for x in open(log)]
        assert len(records) == res["requests"]
        hits = removed = mismatched = 0
        for rec in records:
            for tag, f in events[applied:rec["events_before"]]:
                index.apply(msgpack.packb([0.0, [f], 0], use_bin_type=True))
                removed += tag == "BlockRemoved"
            applied = rec["events_before"]
            want = [hash_key(bytes.fromhex(h)) if hash_mode == "bytes" else h for h in rec["hashes"]]
            if predicted_hits(index, want) != rec["hit_blocks"]:
                mismatched += 1
            hits += rec["hit_blocks"]
        assert mismatched == 0, f"{mismatched} of {len(records)} requests predicted wrong"
        print(f"{len(records)} requests, {hits} hit blocks predicted exactly, {len(events)} events, "
              f"{removed} removals")
        assert hits == res["hit_blocks"] and hits > 0
        assert removed > 0, "the capacity evicted nothing"
        for t, f in events:
            if t == "BlockStored":
                assert f["medium"] == "GPU" and f["block_size"] == 512 and f["parent_block_hash"] is not None
                assert len(f["token_ids"]) == (512 * len(f["block_hashes"]) if token_ids else 0)
