"""Operations files against a live daemon (issue 37): `promtool check metrics` passes on the
/metrics of a sparsekvd under some load, the example prometheus.yml passes `promtool check
config`, and the Grafana dashboard queries only metrics the daemon exports (the remote tier's,
exported only with a Redis Cluster configured, are checked against the tier's source)."""

import json
import os
import re
import socket
import subprocess
import sys
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "python"))
from daemon_process import Daemon  # noqa: E402

import sparsekv  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape():
    port = free_port()
    d = Daemon(resp=True, ssd_bytes="64MiB", ssd_durability="none",
               extra_config={"metrics_listen": f"127.0.0.1:{port}"})
    try:
        with sparsekv.Client(d.unix) as c:
            keys = [i.to_bytes(16, "little") for i in range(8)]
            c.put(keys, [os.urandom(4096) for _ in keys])
            c.get(keys)
            c.lookup(keys)
        subprocess.run(["redis-cli", "-p", str(d.resp_port), "SET", "k", "v"], check=True, capture_output=True)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            return r.read().decode()
    finally:
        assert d.stop() == 0


METRICS = None


def metrics():
    global METRICS
    if METRICS is None:
        METRICS = scrape()
    return METRICS


def test_promtool_accepts_the_live_metrics():
    r = subprocess.run(["promtool", "check", "metrics"], input=metrics(), capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "" and r.stderr.strip() == "", r.stdout + r.stderr  # no lint finding either


def test_the_example_prometheus_config_is_valid():
    r = subprocess.run(["promtool", "check", "config", os.path.join(ROOT, "deploy/prometheus/prometheus.yml")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_dashboard_names_only_exported_metrics():
    exported = {line.split("{")[0].split(" ")[0] for line in metrics().splitlines() if line.startswith("sparsekv_")}
    remote_src = open(os.path.join(ROOT, "offload/remote_tier.cc")).read()
    dash = json.load(open(os.path.join(ROOT, "deploy/grafana/sparsekv.json")))
    queried = set()
    for p in dash["panels"]:
        for t in p["targets"]:
            queried |= set(re.findall(r"sparsekv_[a-z0-9_]+", t["expr"]))
    assert len(queried) >= 15
    for m in sorted(queried):
        assert m in exported or f'"{m}"' in remote_src, f"the dashboard queries {m}, which the daemon does not export"
    # And the file is what its generator writes (edit the generator, not the JSON).
    sys.path.insert(0, os.path.join(ROOT, "deploy", "grafana"))
    import make_dashboard
    assert make_dashboard.dashboard() == dash
