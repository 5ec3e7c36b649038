"""The manual's plots come from one command (issue 37): bench/plots/plot.py runs `sparsekv replay
--json` at a few capacities and renders the hit-ratio plot with its numbers beside it; the hit
ratios it plots are the replays' own, Belady's bound is above every policy, and the image is a
PNG."""

import json
import os
import subprocess
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
CLI = os.path.join(os.path.dirname(os.path.abspath(os.environ.get("SPARSEKVD_PATH", "build/release/api/sparsekvd"))),
                   "sparsekv")
TRACE = os.path.join(ROOT, "..", "shared", "data", "mooncake_conversation_trace.jsonl")


def test_hit_ratio_plot_from_replays():
    with tempfile.TemporaryDirectory() as out:
        r = subprocess.run(["/usr/bin/python3", os.path.join(ROOT, "bench/plots/plot.py"), "--cli", CLI, "--out", out,
                            "--trace", TRACE, "--only", "hit_ratio", "--capacities", "500,2000"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        with open(os.path.join(out, "hit_ratio.png"), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        data = json.load(open(os.path.join(out, "hit_ratio.json")))
        assert data["capacities"] == [500, 2000]
        for name, ys in data["hit_ratio"].items():
            for y, bound in zip(ys, data["belady"]):
                assert 0 < y <= bound, (name, y, bound)
        # What it plots is what replay says.
        j = json.loads(subprocess.run([CLI, "replay", "--trace", TRACE, "--capacity-blocks", "500", "--policy", "lru",
                                       "--json"], capture_output=True, text=True, check=True).stdout)
        assert data["hit_ratio"]["LRU"][0] == j["hit_blocks"] / j["blocks"]
