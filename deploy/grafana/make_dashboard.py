"""Writes deploy/grafana/sparsekv.json, the Grafana dashboard over sparsekvd's /metrics.

Run it after changing the panels (python3 deploy/grafana/make_dashboard.py); the suite checks
that every metric the dashboard queries is one the daemon exports
(tests/python/test_operations.py)."""

import json
import os

PANELS = [
    # (title, unit, [(expr, legend)])
    ("Block hit ratio (LOOKUP)", "percentunit",
     [("sum(rate(sparsekv_hits_total[5m])) / clamp_min(sum(rate(sparsekv_hits_total[5m])) + "
       "sum(rate(sparsekv_misses_total[5m])), 1e-9)", "hit ratio")]),
    ("Tier hit ratio", "percentunit",
     [("sum by (tier) (rate(sparsekv_tier_hits_total[5m])) / clamp_min(sum by (tier) (rate(sparsekv_tier_hits_total[5m])) "
       "+ sum by (tier) (rate(sparsekv_tier_misses_total[5m])), 1e-9)", "{{tier}}")]),
    ("Tier occupancy", "percentunit",
     [("sparsekv_tier_bytes / clamp_min(sparsekv_tier_capacity_bytes, 1)", "{{tier}}")]),
    ("Tier evictions", "ops",
     [("rate(sparsekv_tier_evictions_total[5m])", "{{tier}}")]),
    ("Requests by operation", "reqps",
     [("sum by (op) (rate(sparsekv_requests_total[5m]))", "{{op}}"),
      ("sum(rate(sparsekv_resp_commands_total[5m]))", "RESP commands")]),
    ("Request latency p50 / p99", "s",
     [("histogram_quantile(0.5, sum by (op, le) (rate(sparsekv_request_seconds_bucket[5m])))", "p50 {{op}}"),
      ("histogram_quantile(0.99, sum by (op, le) (rate(sparsekv_request_seconds_bucket[5m])))", "p99 {{op}}")]),
    ("Errors", "ops",
     [("sum(rate(sparsekv_request_errors_total[5m]))", "request errors"),
      ("rate(sparsekv_bad_frames_total[5m])", "bad frames"),
      ("rate(sparsekv_auth_failures_total[5m])", "auth failures"),
      ("rate(sparsekv_connections_rejected_total[5m])", "connections rejected")]),
    ("Integrity: damaged bytes caught", "short",
     [("sum by (tier) (increase(sparsekv_tier_corrupt_total[1h]))", "corrupt records {{tier}}"),
      ("sum by (tier) (increase(sparsekv_tier_io_errors_total[1h]))", "I/O errors {{tier}}"),
      ("increase(sparsekv_chain_stale_skipped_total[1h])", "stale copies skipped")]),
    ("Remote tier (Redis Cluster) health", "short",
     [("sparsekv_remote_healthy", "healthy"),
      ("sparsekv_remote_nodes_down", "nodes down"),
      ("sparsekv_remote_slots_uncovered", "slots uncovered"),
      ("rate(sparsekv_remote_timeouts_total[5m])", "timeouts/s")]),
    ("Connections and buffers", "short",
     [("sparsekv_authenticated_connections", "sessions"),
      ("sparsekv_resp_connections", "RESP connections"),
      ("sparsekv_buffered_bytes / clamp_min(sparsekv_buffered_bytes_limit, 1)", "buffer budget used")]),
]


def dashboard():
    panels = []
    for i, (title, unit, targets) in enumerate(PANELS):
        panels.append({
            "id": i + 1,
            "type": "timeseries",
            "title": title,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": (i % 2) * 12, "y": (i // 2) * 8},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"refId": chr(ord("A") + j), "expr": e, "legendFormat": legend}
                        for j, (e, legend) in enumerate(targets)],
        })
    return {
        "title": "sparsekv",
        "uid": "sparsekv",
        "schemaVersion": 38,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus"}]},
        "panels": panels,
    }


if __name__ == "__main__":
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sparsekv.json")
    with open(out, "w") as f:
        json.dump(dashboard(), f, indent=2)
        f.write("\n")
    print(out)
