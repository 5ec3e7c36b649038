#!/usr/bin/env python3
"""sparsekv.vllm.SparseKVConnector moving DeepSeek V3.2 blocks (64 tokens x 61 layers of 656 B of
fp8_ds_mla MLA KV and 132 B of indexer keys, each layer its own [num_blocks, 64, bytes] CPU
tensor, as vLLM lays them out; one value per block with every layer's pages) between the KV cache
tensors and a sparsekvd: store = the worker's
wait_for_save over a step's metadata, load = its start_load_kv, against a single-threaded torch
copy_ of the same blocks between two such caches, interleaved in the same run. Also the
scheduler's cost of a lookup: get_num_new_matched_tokens for a new 1,000-block request (64,000
tokens), p50 and p99. vLLM's classes come from tests/python/vllm_standin when vLLM is absent.

    PYTHONPATH=build/release/python python3 bench/python/vllm_backend_bench.py --json
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "python"))

import torch  # noqa: E402

import vllm_engine as E  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from sparsekv import vllm as skv  # noqa: E402

LAYERS, TOKENS, MLA, INDEX = 61, 64, 656, 132


def transfers(inst, tokens, blocks, first_id):
    req = Request("bench", tokens, block_hasher=inst.block_hasher)
    hashes = b"".join(h[:16] for h in req.block_hashes[:blocks])
    return [skv._Transfer("bench", 0, list(range(first_id, first_id + blocks)), hashes)]


def move(blocks, address, rounds, iterations, layers):
    tokens = E.prompt(blocks * TOKENS + 1, salt=int(time.time()))
    nb = 2 * blocks + 2
    w = E.Instance("v32", address, layers=layers, num_blocks=nb)
    r = E.Instance("v32", address, layers=layers, num_blocks=nb)
    for t in w.kv_caches.values():
        t.random_(0, 256)
    saves = skv.SparseKVConnectorMetadata(saves=transfers(w, tokens, blocks, 1))
    loads = skv.SparseKVConnectorMetadata(loads=transfers(r, tokens, blocks, blocks + 1))
    pairs = [(w.kv_caches[n], r.kv_caches[n]) for n in w.kv_caches]

    def store():
        w.worker.bind_connector_metadata(saves)
        w.worker.wait_for_save()
        w.worker.clear_connector_metadata()

    def load():
        r.worker.bind_connector_metadata(loads)
        r.worker.start_load_kv(None)
        r.worker.clear_connector_metadata()
        assert not r.worker.get_block_ids_with_load_errors(), "a load failed"

    def copy():
        for src, dst in pairs:
            dst[blocks + 1:2 * blocks + 1].copy_(src[1:blocks + 1])

    store()
    load()
    for src, dst in pairs:
        assert torch.equal(dst[blocks + 1:2 * blocks + 1], src[1:blocks + 1]), "loaded bytes differ"
    times = {"store": [], "load": [], "copy": []}
    for _ in range(rounds):
        for name, f in (("copy", copy), ("load", load), ("store", store)):
            t0 = time.perf_counter()
            for _ in range(iterations):
                f()
            times[name].append((time.perf_counter() - t0) / iterations)
    for _, dst in pairs:
        dst.zero_()
    load()
    for src, dst in pairs:
        assert torch.equal(dst[blocks + 1:2 * blocks + 1], src[1:blocks + 1]), "loaded bytes differ"
    failures = w.worker.counters["store_failures"] + r.worker.counters["load_failures"]
    assert failures == 0, f"{failures} failed stores or loads"
    block_bytes = layers * TOKENS * (MLA + INDEX)
    med = {k: statistics.median(v) for k, v in times.items()}
    # One value per (block, group): every layer's MLA and indexer page of a block together.
    out = {"blocks": blocks, "layers": layers, "block_bytes": block_bytes,
           "values_per_call": blocks * len(w.worker.layout.groups)}
    for k in ("store", "load", "copy"):
        out[f"{k}_ms"] = med[k] * 1e3
        out[f"{k}_bytes_per_s"] = blocks * block_bytes / med[k]
    out["load_vs_copy"] = med["copy"] / med["load"]
    out["store_vs_copy"] = med["copy"] / med["store"]
    w.close()
    r.close()
    return out


def lookup(address, blocks, samples):
    """p50/p99 of get_num_new_matched_tokens for a new request: first with the collector as it
    is, then with the heap frozen as vLLM freezes it after warm-up (vllm/utils/gc_utils.py
    freeze_gc_heap at ca78ce6297d7, "invoked after server init / warmup"), which is how a
    serving scheduler runs."""
    tokens = E.prompt(blocks * TOKENS + 1, salt=7 + int(time.time()))
    inst = E.Instance("v32", address, layers=1, num_blocks=blocks + 2, chunk=blocks * TOKENS)
    inst.run("w", tokens)
    out = {"blocks": blocks, "keys_per_lookup": blocks * len(inst.scheduler.layout.groups), "samples": samples}
    for frozen in (False, True):
        if frozen:
            gc.collect()
            gc.freeze()
        reqs = [Request(f"r{frozen}{i}", tokens, block_hasher=inst.block_hasher) for i in range(samples)]
        times = []
        for q in reqs:
            t0 = time.perf_counter()
            got = inst.scheduler.get_num_new_matched_tokens(q, 0)
            times.append(time.perf_counter() - t0)
            assert got == (blocks * TOKENS, False), got
        times.sort()
        tag = "" if frozen else "_gc_unfrozen"
        out["p50_us" + tag] = times[len(times) // 2] * 1e6
        out["p99_us" + tag] = times[min(len(times) - 1, int(len(times) * 0.99))] * 1e6
    gc.unfreeze()
    inst.close()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--unix", help="unix:PATH of a running sparsekvd (default: start one)")
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--lookup-blocks", type=int, default=1000)
    ap.add_argument("--lookup-samples", type=int, default=1000)
    ap.add_argument("--write-leases", action="store_true",
                    help="start the daemon with write_leases on (stores written straight into its memory)")
    ap.add_argument("--json", action="store_true", help="print JSON (the only output format)")
    a = ap.parse_args()
    torch.set_num_threads(1)  # copy_ on one thread, as the client copies
    daemon = None
    if a.unix is None:
        from daemon_process import Daemon
        biggest = a.blocks * a.layers * TOKENS * (MLA + INDEX) + a.lookup_blocks * TOKENS * (MLA + INDEX)
        daemon = Daemon(host_bytes=str(max(256 << 20, 2 * biggest)),
                        extra_config={"write_leases": True} if a.write_leases else None)
        a.unix = daemon.unix
    try:
        out = {"cpu": next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                            if line.startswith("model name")), "unknown"), "transport": "unix_shm", "write_leases": a.write_leases,
               "move": move(a.blocks, a.unix, a.rounds, a.iterations, a.layers),
               "lookup": lookup(a.unix, a.lookup_blocks, a.lookup_samples)}
        print(json.dumps(out, indent=2))
    finally:
        if daemon:
            daemon.stop()


if __name__ == "__main__":
    main()
