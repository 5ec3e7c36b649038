"""bench/python/trace_shapes.py: the generated traces are valid Mooncake-format traces, and the
offline model's LRU (`sparsekv replay --sim-policy lru`) keeps exactly the cache manager's hits
on every shape, as it does on the conversation trace: the model is fit to judge policies there.
And issue 34's generality check: on every shape, at every capacity of the README's table, no
eviction policy keeps fewer than 0.95x the hits LRU keeps (`sparsekv replay --vs-lru`)."""

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "python"))
import trace_shapes  # noqa: E402


def cli():
    daemon = os.environ.get("SPARSEKVD_PATH", "build/release/api/sparsekvd")
    return os.path.join(os.path.dirname(daemon), "sparsekv")


@pytest.mark.parametrize("shape", sorted(trace_shapes.SHAPES))
def test_the_models_lru_is_the_managers_on_every_shape(tmp_path, shape):
    lines = trace_shapes.generate(shape, 1500, seed=3)
    assert len(lines) == 1500
    for line in lines:
        assert len(line["hash_ids"]) == -(-line["input_length"] // 512)
    assert trace_shapes.generate(shape, 1500, seed=3) == lines  # deterministic
    path = tmp_path / f"{shape}.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    for capacity in (200, 1000):
        out = subprocess.run([cli(), "replay", "--trace", str(path), "--capacity-blocks", str(capacity),
                              "--policy", "lru", "--sim-policy", "lru", "--json"], check=True, capture_output=True,
                             text=True).stdout
        j = json.loads(out)
        assert j["sim_hit_blocks"] == j["hit_blocks"], (shape, capacity)
        assert j["belady_hit_blocks"] >= j["hit_blocks"]
        assert j["hit_blocks"] > 0


# The README's table: shape, capacities (blocks).
TABLE = {"short-sessions": (200, 500, 2000, 8000), "hot-prompt": (100, 500), "long-documents": (500, 2000, 8000)}


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("shape", sorted(TABLE))
def test_no_policy_falls_below_095_lru_on_any_shape(tmp_path, shape, policy):
    path = tmp_path / f"{shape}.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in trace_shapes.generate(shape, 12000, seed=1)))
    for capacity in TABLE[shape]:
        out = subprocess.run([cli(), "replay", "--trace", str(path), "--capacity-blocks", str(capacity),
                              "--policy", policy, "--vs-lru", "--json"], check=True, capture_output=True,
                             text=True).stdout
        j = json.loads(out)
        print(shape, capacity, policy, j["hit_blocks"], j["lru_hit_blocks"], round(j["vs_lru"], 3))
        assert j["vs_lru"] >= 0.95, (shape, capacity, policy, j["vs_lru"])
        assert j["hit_blocks"] <= j["belady_hit_blocks"]
