#!/usr/bin/python3
"""Plots for the manual, rendered with matplotlib from the benchmarks' own --json output.

    python3 bench/plots/plot.py --cli build/release/api/sparsekv --out docs/images \
        [--trace ../shared/data/mooncake_conversation_trace.jsonl] [--suspend-json FILE] [--no-run]

- hit_ratio.png: block hit ratio against cache capacity on the Mooncake conversation trace for
  LRU, ARC and ARC with scheduler hints (lookahead 64), with Belady's offline optimum as the
  bound. Runs `sparsekv replay --json` at each capacity (a second each).
- restore.png: restoring a V3.2 prefix into L1 from the host tier against memcpy, and from the
  SSD tier against O_DIRECT pread and fio (depth 1 and 16) over the same bytes, from
  `sparsekv bench restore --json` (a small run each: --restore-blocks blocks, 2 rounds).
- resp.png: redis-benchmark's SET and GET rates against redis-server and sparsekvd's Redis
  listener by value size, with the native protocol's GET rate at 64 KiB, from
  `bench/python/resp_bench.py --json` (the script behind `sparsekv bench resp`).
- sparse_decode.png: a decode step with the sparse cache in the host tier and a working set in
  L1, over the step with the whole cache resident, against the overlap of consecutive
  selections, for several L1 fractions (V3.2 fp8, 64K context), from
  `sparsekv bench sparse-decode --json` (outputs checked bit-identical by the bench).
- suspend.png: suspend and resume rates against memcpy (host) and fio (SSD), and request-log
  appends per second against fio's fdatasync rate, from `sparsekv bench suspend --json`
  (--suspend-json; without it, a small run is made).
Every JSON the plots come from is written beside the images (<name>.json), with the machine's
CPU model and the command, so a plot can be traced to its run."""

import argparse
import json
import os
import platform
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

CAPACITIES = [250, 500, 1000, 2000, 4000, 8000, 16000]
RUNS = [("LRU", ["--policy", "lru"]), ("ARC", ["--policy", "arc"]),
        ("ARC + hints (lookahead 64)", ["--policy", "arc", "--lookahead", "64"])]


def cpu_model():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def run_json(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        sys.exit(f"plot: {' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout)


def hit_ratio(cli, trace, out, capacities):
    runs = {name: [] for name, _ in RUNS}
    belady = []
    commands = []
    for cap in capacities:
        for name, extra in RUNS:
            cmd = [cli, "replay", "--trace", trace, "--capacity-blocks", str(cap), "--json"] + extra
            commands.append(" ".join(cmd[1:]))
            j = run_json(cmd)
            runs[name].append(j["hit_blocks"] / j["blocks"])
            if name == "LRU":
                belady.append(j["belady_hit_blocks"] / j["blocks"])
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, ys in runs.items():
        ax.plot(capacities, ys, marker="o", label=name)
    ax.plot(capacities, belady, linestyle="--", color="black", label="Belady (offline optimum)")
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (blocks of 512 tokens)")
    ax.set_ylabel("block hit ratio")
    ax.set_title("Mooncake conversation trace: hits kept by each policy")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.text(0.01, 0.01, f"sparsekv replay, {cpu_model()}", fontsize=7, alpha=0.7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "hit_ratio.png"), dpi=110)
    plt.close(fig)
    data = {"capacities": capacities, "hit_ratio": runs, "belady": belady, "cpu": cpu_model(), "commands": commands}
    json.dump(data, open(os.path.join(out, "hit_ratio.json"), "w"), indent=1)


def restore(cli, out, blocks):
    runs = {}
    commands = []
    for tier in ("host", "ssd"):
        cmd = [cli, "bench", "restore", "--tier", tier, "--blocks", str(blocks), "--rounds", "2", "--json"]
        if tier == "ssd":
            d = os.path.join(out, ".restore-run")
            os.makedirs(d, exist_ok=True)
            cmd += ["--dir", d, "--with-fio"]
        commands.append(" ".join(cmd[1:]).replace(os.path.join(out, ".restore-run"), "DIR"))
        runs[tier] = run_json(cmd)
        if tier == "ssd":
            os.rmdir(d)
    h, s = runs["host"], runs["ssd"]
    bars = [("host: restore", h["restore_bytes_per_s"], "sparsekv"), ("host: store", h["store_bytes_per_s"], "sparsekv"),
            ("host: memcpy", h["memcpy_bytes_per_s"], "baseline"),
            ("SSD: restore", s["restore_bytes_per_s"], "sparsekv"), ("SSD: store", s["store_bytes_per_s"], "sparsekv")]
    if s.get("pread_bytes_per_s"):
        bars.append(("SSD: pread", s["pread_bytes_per_s"], "baseline"))
    for k, name in (("fio_qd1_read_bytes_per_s", "SSD: fio depth 1"), ("fio_qd16_read_bytes_per_s", "SSD: fio depth 16")):
        if s.get(k):
            bars.append((name, s[k], "baseline"))
    fig, ax = plt.subplots(figsize=(8, 4))
    colors = {"sparsekv": "tab:blue", "baseline": "tab:orange"}
    ax.bar(range(len(bars)), [b[1] / 1e9 for b in bars], color=[colors[b[2]] for b in bars])
    ax.set_xticks(range(len(bars)))
    ax.set_xticklabels([b[0] for b in bars], fontsize=7, rotation=20)
    from matplotlib.patches import Patch
    ax.legend(handles=[Patch(color=colors["sparsekv"], label="sparsekv"),
                       Patch(color=colors["baseline"], label="baseline, same bytes")], fontsize=8)
    ax.set_ylabel("GB/s")
    ax.set_title(f"Restore a V3.2 prefix ({blocks} blocks of {h['block_bytes'] / 1e6:.1f} MB) into L1; "
                 "baselines over the same bytes", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    fig.text(0.01, 0.01, f"sparsekv bench restore, {cpu_model()}", fontsize=7, alpha=0.7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "restore.png"), dpi=110)
    plt.close(fig)
    json.dump({"cpu": cpu_model(), "commands": commands, "results": runs}, open(os.path.join(out, "restore.json"), "w"),
              indent=1)


def resp(cli, out, sizes):
    here = os.path.dirname(os.path.abspath(__file__))
    daemon = os.path.join(os.path.dirname(os.path.abspath(cli)), "sparsekvd")
    cmd = ["/usr/bin/python3", os.path.join(here, "..", "python", "resp_bench.py"), "--sparsekvd", daemon,
           "--sizes", sizes, "--pipelines", "1", "--repeats", "3", "--seconds", "1", "--json"]
    j = run_json(cmd)
    fig, ax = plt.subplots(figsize=(8, 4))
    for op, marker in (("SET", "o"), ("GET", "s")):
        cells = [c for c in j["cells"] if c["op"] == op and c["pipeline"] == 1]
        xs = [c["size"] for c in cells]
        ax.plot(xs, [c["redis_rps"] for c in cells], marker=marker, linestyle="--", label=f"redis-server {op}")
        ax.plot(xs, [c["sparsekvd_rps"] for c in cells], marker=marker, label=f"sparsekvd (RESP) {op}")
    ng = j.get("native_get")
    if ng:
        ax.scatter([ng["value_bytes"]], [ng["get_ops_per_s"]], marker="*", s=160, color="black", zorder=5,
                   label="sparsekvd native GET (sparsekv bench daemon)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("value bytes")
    ax.set_ylabel("requests/s (8 clients, no pipelining)")
    ax.set_title("redis-benchmark against redis-server and sparsekvd, same run", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.text(0.01, 0.01, f"resp_bench.py --sizes {sizes} --repeats 3, {cpu_model()}", fontsize=7, alpha=0.7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "resp.png"), dpi=110)
    plt.close(fig)
    json.dump({"cpu": cpu_model(), "command": " ".join(cmd[1:]), "result": j}, open(os.path.join(out, "resp.json"), "w"),
              indent=1)


def sparse_decode(cli, out, overlaps, fractions):
    results = {}
    commands = []
    for f in fractions:
        for ov in overlaps:
            cmd = [cli, "bench", "sparse-decode", "--l1-fraction", str(f), "--overlap", str(ov), "--json"]
            commands.append(" ".join(cmd[1:]))
            j = run_json(cmd)
            if not j["outputs_identical"]:
                sys.exit(f"plot: {' '.join(cmd)}: outputs differ from the resident cache")
            results.setdefault(str(f), []).append(
                {"overlap": j["measured_overlap"], "step_vs_resident": j["step_vs_resident"],
                 "l1_vs_resident": j["l1_vs_resident"]})
    fig, ax = plt.subplots(figsize=(7, 4))
    for f, pts in results.items():
        ax.plot([p["overlap"] for p in pts], [p["step_vs_resident"] for p in pts], marker="o",
                label=f"L1 holds {float(f):.0%} of the entries ({pts[0]['l1_vs_resident']:.2f}x the resident bytes)")
    ax.axhline(1.0, color="black", linestyle="--", label="the whole cache resident")
    ax.set_xlabel("measured overlap of consecutive top-k selections")
    ax.set_ylabel("decode step / resident step")
    ax.set_title("Sparse decode from the host tier (V3.2 fp8, 64K context, 2 layers)", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.text(0.01, 0.01, f"sparsekv bench sparse-decode, {cpu_model()}", fontsize=7, alpha=0.7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "sparse_decode.png"), dpi=110)
    plt.close(fig)
    json.dump({"cpu": cpu_model(), "commands": commands, "results": results},
              open(os.path.join(out, "sparse_decode.json"), "w"), indent=1)


def suspend(cli, out, suspend_json):
    if suspend_json:
        j = json.load(open(suspend_json))
        command = f"sparsekv bench suspend --json (from {os.path.basename(suspend_json)})"
    else:
        d = os.path.join(out, ".suspend-run")
        os.makedirs(d, exist_ok=True)
        cmd = [cli, "bench", "suspend", "--dir", d, "--v32-tokens", "8192", "--v4-tokens", "2048", "--turns", "4",
               "--turn-tokens", "256", "--log-seconds", "0.5", "--json"]
        j = run_json(cmd)
        os.rmdir(d)
        command = " ".join(cmd[1:])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    labels, ours, base = [], [], []
    for s in j["sequences"]:
        tag = f"{'V3.2' if 'v3.2' in s['model'] else 'V4'} {s['tier']}"
        if s["tier"] == "host":
            b = max(s["memcpy_bytes_per_s"])
            pairs = [("suspend", s["suspend_bytes_per_s"], b), ("resume", s["resume_bytes_per_s"], b)]
        elif "fio_write_bytes_per_s" in s:
            pairs = [("suspend", s["suspend_bytes_per_s"], s["fio_write_bytes_per_s"]),
                     ("resume", s["resume_bytes_per_s"], s["fio_read_bytes_per_s"])]
        else:
            continue
        for what, o, b in pairs:
            labels.append(f"{tag}\n{what}")
            ours.append(o / 1e9)
            base.append(b / 1e9)
    x = range(len(labels))
    a1.bar([i - 0.2 for i in x], ours, width=0.4, label="sparsekv")
    a1.bar([i + 0.2 for i in x], base, width=0.4, label="memcpy (host) / fio (SSD)")
    a1.set_xticks(list(x))
    a1.set_xticklabels(labels, fontsize=7)
    a1.set_ylabel("GB/s")
    sizes = ", ".join(sorted({f"{'V3.2' if 'v3.2' in s['model'] else 'V4'} {s['tokens']:,} tokens" for s in j["sequences"]}))
    a1.set_title(f"Suspend and resume against the same bytes\n({sizes})", fontsize=10)
    a1.legend(fontsize=8)
    logs = j["log"]
    a2.plot([l["concurrency"] for l in logs], [l["appends_per_s"] for l in logs], marker="o",
            label="request log appends/s")
    if "fio_fdatasync_writes_per_s" in j:
        a2.axhline(j["fio_fdatasync_writes_per_s"], color="black", linestyle="--", label="fio --fdatasync=1 writes/s")
    a2.set_xscale("log")
    a2.set_yscale("log")
    a2.set_xlabel("requests appending at once")
    a2.set_title("Token log under fdatasync (group commit)")
    a2.grid(True, which="both", alpha=0.3)
    a2.legend(fontsize=8)
    fig.text(0.01, 0.01, f"{command}, {cpu_model()}", fontsize=7, alpha=0.7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "suspend.png"), dpi=110)
    plt.close(fig)
    json.dump({"cpu": cpu_model(), "command": command, "result": j}, open(os.path.join(out, "suspend.json"), "w"),
              indent=1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cli", default="build/release/api/sparsekv")
    p.add_argument("--out", default="docs/images")
    p.add_argument("--trace", default=os.path.join("..", "shared", "data", "mooncake_conversation_trace.jsonl"))
    p.add_argument("--capacities", default=",".join(map(str, CAPACITIES)))
    p.add_argument("--suspend-json", default="")
    p.add_argument("--restore-blocks", type=int, default=64)
    p.add_argument("--resp-sizes", default="1024,4096,16384,65536,262144,1048576")
    p.add_argument("--overlaps", default="0.5,0.8,0.9,0.95")
    p.add_argument("--l1-fractions", default="0.05,0.1")
    p.add_argument("--only", default="hit_ratio,restore,resp,sparse_decode,suspend")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    only = a.only.split(",")
    if "hit_ratio" in only:
        hit_ratio(a.cli, a.trace, a.out, [int(c) for c in a.capacities.split(",")])
    if "restore" in only:
        restore(a.cli, a.out, a.restore_blocks)
    if "resp" in only:
        resp(a.cli, a.out, a.resp_sizes)
    if "sparse_decode" in only:
        sparse_decode(a.cli, a.out, [float(x) for x in a.overlaps.split(",")],
                      [float(x) for x in a.l1_fractions.split(",")])
    if "suspend" in only:
        suspend(a.cli, a.out, a.suspend_json)
    print(a.out)


if __name__ == "__main__":
    main()
