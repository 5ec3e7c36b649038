"""A tiny stand-in for vLLM's engine around a KV connector, for sparsekv.vllm's tests and bench.

It drives the connector in the order vLLM's scheduler and model runner call it (read at the commits
named in sparsekv/vllm.py): the factory constructs one connector per role from the
kv_transfer_config (kv_connector_module_path); the worker's connector gets register_kv_caches;
per request the scheduler asks get_num_new_matched_tokens (twice: it must be side-effect free),
allocates every group's blocks (null block 0 for sliding-window blocks a hit skips), calls
update_state_after_alloc(request, all its blocks, external tokens), then per step
build_connector_meta(scheduler_output); the metadata crosses to the worker pickled; the worker
runs bind_connector_metadata, start_load_kv, per layer wait_for_layer_load / (the forward pass
writes the step's blocks) / save_kv_layer, then wait_for_save, get_finished,
get_block_ids_with_load_errors, clear_connector_metadata; the scheduler gets
update_connector_output and recomputes from the first block that failed to load. Blocks a sliding
window left behind go back to the pool after each step, as vLLM's sliding-window manager frees
them. At the end: request_finished_all_groups.

The KV caches are CPU torch tensors laid out as vLLM lays them out for DeepSeek V3.2
(fp8_ds_mla MLA, 656 B per token, and indexer keys, 132 B per token, in 64-token blocks) and V4
(C4/C128 compressed entries of 584 B and C4 indexer keys in 256-token blocks, the 584 B sliding
window in 64-token blocks, fp32 compressor states in 4- and 8-token blocks). The "forward pass"
fills each block it computes with bytes drawn from (seed, layer, the block's hash), so a block
loaded from another instance is checked byte for byte.

Run as a script it is the other process of a test: one JSON object in argv[1], one JSON answer on
stdout."""

import hashlib
import json
import os
import pickle
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# vLLM's own classes where it is installed and SPARSEKV_VLLM_STANDIN is not "1"; else the stand-in.
if os.environ.get("SPARSEKV_VLLM_STANDIN") == "1" or __import__("importlib").util.find_spec("vllm") is None:
    sys.path.insert(0, os.path.join(HERE, "vllm_standin"))

import torch  # noqa: E402

from vllm.config import CacheConfig, ModelConfig, ParallelConfig, VllmConfig  # noqa: E402
from vllm.config.kv_transfer import KVTransferConfig  # noqa: E402
from vllm.distributed import parallel_state  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole  # noqa: E402
from vllm.forward_context import ForwardContext  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher, sha256  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, MLAAttentionSpec, SlidingWindowMLASpec, SlidingWindowSpec,
    UniformTypeKVCacheSpecs)
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

V32_MODEL = "deepseek-ai/DeepSeek-V3.2-Exp"
V4_MODEL = "deepseek-ai/DeepSeek-V4-Flash"


def v32_layers(layers, layout="fp8_ds_mla"):
    """[(group spec, {layer: (spec, tensor shape per block, dtype)})] of DeepSeek V3.2: one group of
    64-token blocks holding each layer's MLA cache and its indexer keys."""
    specs, shapes = {}, {}
    for i in range(layers):
        mla, idx = f"model.layers.{i}.self_attn.attn", f"model.layers.{i}.self_attn.indexer.k_cache"
        if layout == "fp8_ds_mla":
            specs[mla] = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.uint8,
                                          cache_dtype_str="fp8_ds_mla")
            shapes[mla] = ((64, 656), torch.uint8)
        else:  # the bf16 cache ("auto"): 576 values of 2 bytes
            specs[mla] = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16,
                                          cache_dtype_str="auto")
            shapes[mla] = ((64, 576), torch.bfloat16)
        specs[idx] = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=132, dtype=torch.uint8)
        shapes[idx] = ((64, 132), torch.uint8)
    return [(UniformTypeKVCacheSpecs(block_size=64, kv_cache_specs=specs), specs, shapes)]


def v4_layers(layers):
    """DeepSeek V4's groups: compressed KV + C4 indexer keys (256-token blocks), the sliding window
    (64-token blocks, window 128), and the compressor states: C4 (4-token blocks, window 8, 2048
    fp32 per row), C4 indexer (4-token blocks, window 8, 512 fp32) and C128 (8-token blocks,
    window 128, 1024 fp32). Layers 0 and 1 are sliding-window only; then ratio 4 and 128 alternate."""
    mla, swa, c4s, c4is, c128s = {}, {}, {}, {}, {}
    shapes = {}
    for i in range(layers):
        ratio = 1 if i < 2 else (4 if i % 2 == 0 else 128)
        p = f"model.layers.{i}.attn"
        swa[p + ".swa_cache"] = SlidingWindowMLASpec(block_size=64, num_kv_heads=1, head_size=512, dtype=torch.uint8,
                                                     sliding_window=128, cache_dtype_str="fp8_ds_mla", alignment=576,
                                                     model_version="deepseek_v4")
        shapes[p + ".swa_cache"] = ((64, 584), torch.uint8)
        if ratio == 1:
            continue
        mla[p] = MLAAttentionSpec(block_size=256, num_kv_heads=1, head_size=512, dtype=torch.uint8,
                                  compress_ratio=ratio, cache_dtype_str="fp8_ds_mla", alignment=576,
                                  model_version="deepseek_v4")
        shapes[p] = ((256 // ratio, 584), torch.uint8)
        if ratio == 4:
            mla[p + ".indexer.k_cache"] = MLAAttentionSpec(block_size=256, num_kv_heads=1, head_size=132,
                                                           dtype=torch.uint8, compress_ratio=4, alignment=576)
            shapes[p + ".indexer.k_cache"] = ((64, 132), torch.uint8)
            c4s[p + ".compressor"] = SlidingWindowMLASpec(block_size=4, num_kv_heads=1, head_size=2048,
                                                          dtype=torch.float32, sliding_window=8, alignment=576)
            shapes[p + ".compressor"] = ((4, 2048), torch.float32)
            c4is[p + ".indexer.compressor"] = SlidingWindowMLASpec(block_size=4, num_kv_heads=1, head_size=512,
                                                                   dtype=torch.float32, sliding_window=8,
                                                                   alignment=576)
            shapes[p + ".indexer.compressor"] = ((4, 512), torch.float32)
        else:
            c128s[p + ".compressor"] = SlidingWindowMLASpec(block_size=8, num_kv_heads=1, head_size=1024,
                                                            dtype=torch.float32, sliding_window=128, alignment=576)
            shapes[p + ".compressor"] = ((8, 1024), torch.float32)
    out = [(UniformTypeKVCacheSpecs(block_size=256, kv_cache_specs=mla), mla, shapes)]
    for specs in (swa, c4s, c4is, c128s):
        if specs:
            out.append((next(iter(specs.values())), specs, shapes))
    return out


def fill_bytes(seed, layer, block_hash, nbytes):
    """The bytes the forward pass writes into one block of one layer."""
    s = int.from_bytes(hashlib.blake2b(f"{seed}|{layer}|".encode() + block_hash, digest_size=8).digest(), "little")
    g = torch.Generator().manual_seed(s & ((1 << 63) - 1))
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def digest(t):
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


class Instance:
    """One vLLM instance (one scheduler and one worker, or a worker of rank `tp_rank` of
    `tp_size`) with its KV caches, its connectors and block pools."""

    def __init__(self, model, address, layers=4, tp_rank=0, tp_size=1, layout="fp8_ds_mla", extra=None,
                 num_blocks=96, seed=0, chunk=512, namespace="default", token=""):
        self.model, self.seed, self.chunk = model, seed, chunk
        groups = v32_layers(layers, layout) if model == "v32" else v4_layers(layers)
        self.kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks, kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(layer_names=list(specs), kv_cache_spec=gspec)
                             for gspec, specs, _ in groups])
        shapes = groups[0][2]
        self.group_layers = [list(specs) for _, specs, _ in groups]
        self.windows = [getattr(g, "sliding_window", None) if isinstance(g, SlidingWindowSpec) else None
                        for g, _, _ in groups]
        self.block_sizes = [int(g.block_size) for g, _, _ in groups]
        cfg = {"address": address, "namespace": namespace, "token": token, "reconnect_interval": 0,
               "timeout": 5.0}
        cfg.update(extra or {})
        ktc = KVTransferConfig(kv_connector="SparseKVConnector", kv_connector_module_path="sparsekv.vllm",
                               kv_role="kv_both", kv_connector_extra_config=cfg)
        self.vllm_config = VllmConfig(model_config=ModelConfig(model=V32_MODEL if model == "v32" else V4_MODEL),
                                      cache_config=CacheConfig(block_size=64, cache_dtype=layout),
                                      parallel_config=ParallelConfig(tensor_parallel_size=tp_size, rank=tp_rank),
                                      kv_transfer_config=ktc)
        self.kv_cache_config.kv_cache_tensors = [KVCacheTensor(size=0, shared_by=[n]) for n in shapes]
        self.scheduler = KVConnectorFactory.create_connector(self.vllm_config, KVConnectorRole.SCHEDULER,
                                                             self.kv_cache_config)
        parallel_state._TP = parallel_state.GroupCoordinator(rank_in_group=tp_rank, world_size=tp_size)
        try:
            self.worker = KVConnectorFactory.create_connector(self.vllm_config, KVConnectorRole.WORKER,
                                                              self.kv_cache_config)
        finally:
            parallel_state._TP = None
        self.kv_caches = {name: torch.empty((num_blocks,) + shape, dtype=dtype)
                          for name, (shape, dtype) in shapes.items() if any(name in g for g in self.group_layers)}
        self.worker.register_kv_caches(self.kv_caches)
        self.free = list(range(num_blocks - 1, 0, -1))  # one pool for every group; block 0: the null block
        self.hash_block = self.scheduler.layout.hash_block
        self.block_hasher = get_request_block_hasher(self.hash_block, sha256)
        self.finished = set()

    # -- helpers --
    def _alloc(self):
        if not self.free:
            raise RuntimeError("the block pool ran out of blocks")
        return self.free.pop()

    def _grow(self, table, tokens):
        """Allocates every group's blocks up to `tokens`; answers the new ids per group."""
        new = []
        for g, ids in enumerate(table):
            need = -(-tokens // self.block_sizes[g])
            add = [self._alloc() for _ in range(max(0, need - len(ids)))]
            ids.extend(add)
            new.append(add)
        return tuple(new)

    def block_hash(self, request, g, j):
        f = self.block_sizes[g] // self.hash_block
        i = (j + 1) * f - 1
        return request.block_hashes[i] if i < len(request.block_hashes) else b"partial%d" % j

    def expected(self, seed, request, g, layer, j):
        t = self.kv_caches[layer][0]
        return fill_bytes(seed, layer, self.block_hash(request, g, j), t.numel() * t.element_size())

    def _write(self, request, g, j, block_id):
        for layer in self.group_layers[g]:
            t = self.kv_caches[layer][block_id]
            t.view(-1).view(torch.uint8).copy_(self.expected(self.seed, request, g, layer, j))

    def lookup(self, req_id, tokens):
        r = Request(req_id, tokens, block_hasher=self.block_hasher)
        return self.scheduler.get_num_new_matched_tokens(r, 0)

    def run(self, req_id, tokens, writer_seed=None):
        """Serves one prompt; answers what happened: external tokens, blocks loaded (with whether
        their bytes are the writer's), load failures, and where recomputing started."""
        sched, worker = self.scheduler, self.worker
        req = Request(req_id, tokens, block_hasher=self.block_hasher)
        ext, load_async = sched.get_num_new_matched_tokens(req, 0)
        again = sched.get_num_new_matched_tokens(req, 0)
        assert (ext, load_async) == again, f"get_num_new_matched_tokens is not side-effect free: {again}"
        assert load_async is False
        ext = ext or 0
        n = req.num_tokens
        G = len(self.block_sizes)
        table = []
        for g in range(G):  # a hit's sliding-window blocks before the window are the null block
            w = self.windows[g]
            table.append([0] * (max(0, (ext - (w - 1)) // self.block_sizes[g]) if (w and ext) else 0))
        self._grow(table, min(n, ext + self.chunk))
        blocks = KVCacheBlocks(tuple([KVCacheBlock(b, is_null=(b == 0)) for b in ids] for ids in table))
        sched.update_state_after_alloc(req, blocks, ext)
        new_ids = tuple([] for _ in range(G))
        computed, first, result = ext, True, {"ext": ext, "loaded": 0, "loaded_ok": 0, "load_errors": [],
                                              "recomputed_from": None, "stored_blocks": 0}
        while computed < n:
            step = min(self.chunk, n - computed)
            new_ids = self._grow(table, computed + step)
            if first:
                so = SchedulerOutput(
                    scheduled_new_reqs=[NewRequestData(req_id, list(tokens), block_ids=tuple(list(t) for t in table),
                                                       num_computed_tokens=computed)],
                    scheduled_cached_reqs=CachedRequestData.make_empty(), num_scheduled_tokens={req_id: step},
                    total_num_scheduled_tokens=step, finished_req_ids=set(self.finished))
            else:
                so = SchedulerOutput(
                    scheduled_new_reqs=[],
                    scheduled_cached_reqs=CachedRequestData(req_ids=[req_id], resumed_req_ids=set(), new_token_ids=[[]],
                                                            all_token_ids={}, new_block_ids=[new_ids],
                                                            num_computed_tokens=[computed], num_output_tokens=[0]),
                    num_scheduled_tokens={req_id: step}, total_num_scheduled_tokens=step,
                    finished_req_ids=set(self.finished))
            self.finished.clear()
            first = False
            so.kv_connector_metadata = sched.build_connector_meta(so)
            meta = pickle.loads(pickle.dumps(so.kv_connector_metadata))  # to the worker process
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(ForwardContext())
            stored_before = worker.counters["blocks_stored"]
            loads = list(getattr(meta, "loads", []))
            for layer in self.kv_caches:
                worker.wait_for_layer_load(layer)
            errors = set()
            for layer in self.kv_caches:  # the forward pass writes this step's blocks
                worker.save_kv_layer(layer, self.kv_caches[layer], None)
            for g in range(G):
                B = self.block_sizes[g]
                for j in range(computed // B, -(-(computed + step) // B)):
                    if j < len(table[g]) and table[g][j] != 0:
                        self._write(req, g, j, table[g][j])
            worker.wait_for_save()
            sending, recving = worker.get_finished(set())
            errors = worker.get_block_ids_with_load_errors()
            worker.clear_connector_metadata()
            sched.update_connector_output(KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                                            invalid_block_ids=errors))
            result["stored_blocks"] += worker.counters["blocks_stored"] - stored_before
            for t in loads:  # what the load put into the blocks, checked against the writer's bytes
                G_ = t.group
                for bid in t.block_ids:
                    j = table[G_].index(bid)
                    result["loaded"] += 1
                    if bid in errors:
                        continue
                    same = writer_seed is not None and all(
                        torch.equal(self.kv_caches[layer][bid].contiguous().view(-1).view(torch.uint8),
                                    self.expected(writer_seed, req, G_, layer, j))
                        for layer in self.group_layers[G_])
                    result["loaded_ok"] += int(same)
            if errors:  # vLLM recomputes from the first block that failed to load
                first_bad = min(table[g].index(b) * self.block_sizes[g] for g in range(G) for b in errors
                                if b in table[g])
                result["load_errors"] = sorted(errors)
                result["recomputed_from"] = first_bad
                computed = first_bad
                continue
            computed += step
            for g in range(G):  # blocks that fell out of a sliding window go back to the pool
                w = self.windows[g]
                if not w:
                    continue
                B = self.block_sizes[g]
                for j in range(max(0, (computed - (w - 1)) // B)):
                    if table[g][j] != 0:
                        self.free.append(table[g][j])
                        table[g][j] = 0
        ok = sched.request_finished_all_groups(req, tuple(list(t) for t in table))
        assert ok == (False, None), ok
        self.finished.add(req_id)
        for g in range(G):
            self.free.extend(b for b in table[g] if b != 0)
        result["block_hashes"] = len(req.block_hashes)
        return result

    def close(self):
        self.scheduler.shutdown()
        self.worker.shutdown()


def prompt(n, salt=0):
    g = torch.Generator().manual_seed(1234 + salt)
    return torch.randint(0, 100000, (n,), generator=g).tolist()


if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    inst = Instance(args["model"], args["address"], layers=args.get("layers", 4), seed=args.get("seed", 0),
                    num_blocks=args.get("num_blocks", 96), tp_rank=args.get("tp_rank", 0),
                    tp_size=args.get("tp_size", 1))
    out = inst.run(args.get("req_id", "other-process"), prompt(args["tokens"], args.get("salt", 0)),
                   writer_seed=args.get("writer_seed"))
    out["counters"] = inst.worker.counters
    inst.close()
    print(json.dumps(out))
