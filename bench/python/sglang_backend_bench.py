#!/usr/bin/env python3
"""sparsekv.sglang.SparseKVStorage moving DeepSeek V3.2 pages (64 tokens x 61 layers of 656 B of
MLA KV in the host KV pool, and 132 B of DSA indexer keys in the indexer pool) the way SGLang's
HiCache controller moves them: backup = batch_set_v2 (indexer) + batch_set_v1 (KV), prefetch =
batch_get_v1 (KV) + batch_get_v2 (indexer), between host pools in the page_first layout (torch
tensors) and a sparsekvd, against a single-threaded memcpy (torch copy_) of the same pages
between two such pools, interleaved in the same run. Prints JSON: per transport and batch size,
pages/s and GB/s of each, the ratio to memcpy, and microseconds per call.

    PYTHONPATH=build/release/python python3 bench/python/sglang_backend_bench.py --pages 128 1
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from sparsekv import sglang as sk  # noqa: E402

TOKENS, LAYERS, KV_BYTES, INDEX_BYTES = 64, 61, 656, 132


class PageFirstPool:
    """A page_first host pool: (pages, layers, tokens x bytes) uint8, one buffer per page."""

    def __init__(self, pages, token_bytes):
        self.page_size = TOKENS
        self.layout = "page_first"
        self.row = TOKENS * token_bytes
        self.buf = torch.zeros((pages, LAYERS, 1, self.row), dtype=torch.uint8)

    def get_page_buffer_meta(self, indices):
        base, stride = self.buf.data_ptr(), LAYERS * self.row
        ptrs = [base + (int(indices[i]) // TOKENS) * stride for i in range(0, len(indices), TOKENS)]
        return ptrs, [stride] * len(ptrs)


def run(address, pages, rounds, iterations):
    n = pages
    kv_src, ix_src = PageFirstPool(2 * n, KV_BYTES), PageFirstPool(2 * n, INDEX_BYTES)
    kv_src.buf.random_(0, 256)
    ix_src.buf.random_(0, 256)
    kv_dst, ix_dst = PageFirstPool(2 * n, KV_BYTES), PageFirstPool(2 * n, INDEX_BYTES)
    cfg = sk.HiCacheStorageConfig(is_mla_model=True, model_name="deepseek-ai/DeepSeek-V3.2",
                                  extra_config={"address": address, "interface_v1": 1})
    w = sk.SparseKVStorage(cfg, {})
    w.register_mem_pool_host(kv_src)
    w.register_mem_host_pool_v2(ix_src, sk.PoolName.INDEXER)
    r = sk.SparseKVStorage(cfg, {})
    r.register_mem_pool_host(kv_dst)
    r.register_mem_host_pool_v2(ix_dst, sk.PoolName.INDEXER)
    keys = [f"{address}{n}{i:040x}"[-64:].rjust(64, "0") for i in range(n)]
    idx = torch.arange(0, n * TOKENS, dtype=torch.int64)
    dst_idx = torch.arange(n * TOKENS, 2 * n * TOKENS, dtype=torch.int64)

    def backup():
        ok = w.batch_set_v2([sk.PoolTransfer(name=sk.PoolName.INDEXER, host_indices=idx, keys=keys)])
        assert all(ok["indexer"]), "indexer backup failed"
        assert all(w.batch_set_v1(keys, idx)), "KV backup failed"

    def prefetch():
        assert all(r.batch_get_v1(keys, dst_idx)), "KV prefetch failed"
        ok = r.batch_get_v2([sk.PoolTransfer(name=sk.PoolName.INDEXER, host_indices=dst_idx, keys=keys)])
        assert all(ok["indexer"]), "indexer prefetch failed"

    def memcpy():
        kv_dst.buf[n:2 * n].copy_(kv_src.buf[:n])
        ix_dst.buf[n:2 * n].copy_(ix_src.buf[:n])

    backup()
    prefetch()
    assert torch.equal(kv_dst.buf[n:2 * n], kv_src.buf[:n]) and torch.equal(ix_dst.buf[n:2 * n], ix_src.buf[:n])
    memcpy()
    times = {"set": [], "get": [], "memcpy": []}
    for _ in range(rounds):
        for name, f in (("memcpy", memcpy), ("get", prefetch), ("set", backup)):
            t0 = time.perf_counter()
            for _ in range(iterations):
                f()
            times[name].append((time.perf_counter() - t0) / iterations)
    kv_dst.buf.zero_()
    ix_dst.buf.zero_()
    prefetch()
    assert torch.equal(kv_dst.buf[n:2 * n], kv_src.buf[:n]) and torch.equal(ix_dst.buf[n:2 * n], ix_src.buf[:n])
    page_bytes = TOKENS * LAYERS * (KV_BYTES + INDEX_BYTES)
    out = {"pages": n, "page_bytes": page_bytes}
    med = {k: statistics.median(v) for k, v in times.items()}
    for k in ("set", "get", "memcpy"):
        out[f"{k}_pages_per_s"] = n / med[k]
        out[f"{k}_bytes_per_s"] = n * page_bytes / med[k]
        out[f"{k}_us_per_call"] = med[k] * 1e6
    out["get_vs_memcpy"] = med["memcpy"] / med["get"]
    out["set_vs_memcpy"] = med["memcpy"] / med["set"]
    w.close()
    r.close()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--unix", help="unix:PATH of a running sparsekvd (default: start one)")
    ap.add_argument("--tcp", help="HOST:PORT of the same daemon")
    ap.add_argument("--pages", type=int, nargs="+", default=[128, 1])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--write-leases", action="store_true",
                    help="start the daemon with write_leases on (backups written straight into its memory)")
    a = ap.parse_args()
    torch.set_num_threads(1)  # memcpy on one thread, as the client copies
    daemon = None
    if a.unix is None:
        from daemon_process import Daemon
        biggest = max(a.pages) * TOKENS * LAYERS * (KV_BYTES + INDEX_BYTES)
        daemon = Daemon(host_bytes=str(max(256 << 20, 3 * biggest)),
                        extra_config={"write_leases": True} if a.write_leases else None)
        a.unix, a.tcp = daemon.unix, daemon.tcp
    try:
        out = {"cpu": next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                            if line.startswith("model name")), "unknown"), "write_leases": a.write_leases,
               "runs": []}
        for address in (a.unix, a.tcp):
            if address is None:
                continue
            for pages in a.pages:
                res = run(address, pages, a.rounds, a.iterations if pages > 1 else 50 * a.iterations)
                res["transport"] = "unix_shm" if address.startswith("unix:") else "tcp"
                out["runs"].append(res)
        print(json.dumps(out, indent=2))
    finally:
        if daemon:
            daemon.stop()


if __name__ == "__main__":
    main()
