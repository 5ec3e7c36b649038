"""bench/python/trace_shapes.py: the generated traces are valid Mooncake-format traces, and the
offline model's LRU (`sparsekv replay --sim-policy lru`) keeps exactly the cache manager's hits
on every shape, as it does on the conversation trace: the model is fit to judge policies there."""

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
                              "--sim-policy", "lru", "--json"], check=True, capture_output=True, text=True).stdout
        j = json.loads(out)
        assert j["sim_hit_blocks"] == j["hit_blocks"], (shape, capacity)
        assert j["belady_hit_blocks"] >= j["hit_blocks"]
        assert j["hit_blocks"] > 0
