#!/usr/bin/env python3
"""A KV connector in the shape an engine's (vLLM's, SGLang's) calls it, over sparsekv: the
engine's L1 is a sparsekv.CacheManager whose page pools the "model" writes in place (numpy
arrays), and the shared tier is sparsekvd. A tiny numpy model stands in for the engine, so the
example runs here:

    PYTHONPATH=build/release/python python3 examples/kv_connector.py [--address unix:PATH]

Without --address it starts its own sparsekvd (SPARSEKVD_PATH, else build/release/api/sparsekvd).

On a new request the connector hashes the prompt's blocks, asks the engine's own prefix cache,
then the daemon, how many are cached, and loads the daemon's blocks into the pages the model
reads. After prefill it saves the blocks the daemon lacks. A second engine (an empty L1)
serving the same prompt then computes only what follows it.
"""

import argparse
import os
import sys

import numpy as np

import sparsekv


class TinyModel:
    """Writes each block's KV into every pool as a function of its tokens (and the tokens
    before it), so that a block loaded from elsewhere can be checked byte for byte."""

    def __init__(self, manager):
        self.m = manager
        self.arrays = [manager.pool_array(p) for p in range(manager.num_pools)]
        self.computed_blocks = 0

    def block_kv(self, pool, prefix_tokens):
        seed = hash((pool, tuple(prefix_tokens))) & 0xFFFFFFFF
        return np.random.default_rng(seed).integers(0, 256, self.arrays[pool].shape[1], dtype=np.uint8)

    def prefill(self, seq, tokens, first_block, last_block):
        bt = self.m.block_tokens
        for p in range(self.m.num_pools):
            table = self.m.block_table(seq, p)
            for b in range(first_block, last_block):
                self.arrays[p][table[b]] = self.block_kv(p, tokens[: (b + 1) * bt])
        self.computed_blocks += last_block - first_block


class Connector:
    def __init__(self, manager, client):
        self.m = manager
        self.c = client
        self.arrays = [manager.pool_array(p) for p in range(manager.num_pools)]
        self.page_bytes = [a.shape[1] for a in self.arrays]

    def on_new_request(self, tokens):
        """Returns (sequence, blocks ready): the engine's cached blocks, then the daemon's,
        loaded into the sequence's pages."""
        bt = self.m.block_tokens
        seq = self.m.create_sequence()
        self.m.append_tokens(seq, tokens)
        local = self.m.acquire_cached_prefix(seq)["blocks"]
        hashes = sparsekv.block_hashes(tokens, bt)
        loadable = (len(tokens) - 1) // bt  # leave the last token to compute, as a request must
        remote, _ = self.c.lookup(hashes[:loadable])
        if remote <= local:
            return seq, local
        self.m.allocate_slots(seq, remote * bt)
        values = self.c.get(hashes[local:remote])
        tables = [self.m.block_table(seq, p) for p in range(self.m.num_pools)]
        loaded = local
        for i, v in enumerate(values):
            if v is None:  # evicted since the lookup: compute from here
                break
            block = np.frombuffer(v, dtype=np.uint8)
            if block.size != sum(self.page_bytes):
                raise sparsekv.Corruption(f"block {local + i}: {block.size} bytes, expected {sum(self.page_bytes)}")
            at = 0
            for p in range(self.m.num_pools):
                self.arrays[p][tables[p][local + i]] = block[at: at + self.page_bytes[p]]
                at += self.page_bytes[p]
            loaded += 1
        self.m.commit_computed(seq, loaded * bt)
        return seq, loaded

    def after_prefill(self, seq, tokens):
        """Saves the sequence's full blocks that the daemon does not hold."""
        bt = self.m.block_tokens
        hashes = sparsekv.block_hashes(tokens, bt)
        held, tiers = self.c.lookup(hashes)
        missing = [b for b, t in enumerate(tiers) if t == "absent"]
        if not missing:
            return 0
        tables = [self.m.block_table(seq, p) for p in range(self.m.num_pools)]
        values = [np.concatenate([self.arrays[p][tables[p][b]] for p in range(self.m.num_pools)]) for b in missing]
        errors = self.c.put([hashes[b] for b in missing], values)
        return sum(e is None for e in errors)


def serve(connector, model, tokens):
    """One request through the connector: load what is cached, compute the rest, save."""
    m = connector.m
    seq, ready = connector.on_new_request(tokens)
    m.allocate_slots(seq, len(tokens))
    full = len(tokens) // m.block_tokens
    model.prefill(seq, tokens, ready, full)
    m.commit_computed(seq, len(tokens))
    saved = connector.after_prefill(seq, tokens)
    # Every full block's pages hold what the model computes for it, loaded or not.
    for p in range(m.num_pools):
        table = m.block_table(seq, p)
        for b in range(full):
            want = model.block_kv(p, tokens[: (b + 1) * m.block_tokens])
            if not np.array_equal(connector.arrays[p][table[b]], want):
                raise AssertionError(f"block {b} of pool {p} holds other bytes")
    m.free(seq)
    return {"loaded_blocks": ready, "computed_blocks": full - ready, "saved_blocks": saved}


def engine(address, namespace="default", token=""):
    spec = sparsekv.model_preset("deepseek-v3.2-exp", "fp8")
    m = sparsekv.CacheManager(spec, capacity_blocks=32, block_tokens=64)
    c = sparsekv.Client(address, namespace, token)
    return Connector(m, c), TinyModel(m)


def run(address, namespace="default", token=""):
    prompt = list(range(5000, 5000 + 6 * 64 + 10))
    first, model1 = engine(address, namespace, token)
    r1 = serve(first, model1, prompt)
    # A second engine, empty L1, the same system prompt and a new question after it.
    second, model2 = engine(address, namespace, token)
    r2 = serve(second, model2, prompt + list(range(100, 100 + 2 * 64)))
    first.c.close()
    second.c.close()
    return r1, r2


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--address")
    ap.add_argument("--namespace", default="default")
    ap.add_argument("--token", default="")
    a = ap.parse_args()
    daemon = None
    if a.address is None:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "python"))
        from daemon_process import Daemon
        daemon = Daemon(namespaces=((a.namespace, a.token),))
        a.address = daemon.unix
    try:
        r1, r2 = run(a.address, a.namespace, a.token)
        print("first engine: ", r1)
        print("second engine:", r2)
    finally:
        if daemon:
            daemon.stop()


if __name__ == "__main__":
    main()
