"""docs/reference/configuration.md against the code (issue 37), so the reference cannot drift:
the daemon keys documented are exactly the keys of the effective options a daemon logs at
start, the namespace keys too, and the offload keys documented are exactly those the offload
parser writes back (every key), each with the documented default."""

import json
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "python"))
from daemon_process import Daemon  # noqa: E402

import sparsekv  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def tables():
    """{section heading: {key: default cell}} of the reference's tables."""
    out, section = {}, None
    for line in open(os.path.join(ROOT, "docs/reference/configuration.md")):
        if line.startswith("#"):
            section = line.strip("# \n")
        m = re.match(r"\| `([a-z_.]+)` \| (.*?) \|", line)
        if m:
            out.setdefault(section, {})[m.group(1)] = m.group(2)
    return out


def flatten(obj, prefix=""):
    for k, v in obj.items():
        if isinstance(v, dict):
            yield from flatten(v, prefix + k + ".")
        else:
            yield prefix + k, v


def test_offload_keys_and_defaults():
    documented = tables()["The `offload` section"]
    actual = dict(flatten(json.loads(sparsekv._sparsekv._offload_options_json("{}"))))
    assert set(documented) == set(actual), (set(documented) ^ set(actual))
    for key, cell in documented.items():
        literal = re.match(r"`([^`]*)`", cell).group(1)
        assert json.loads(literal) == actual[key], f"{key}: documented {literal}, the code says {actual[key]!r}"


def test_daemon_and_namespace_keys():
    d = Daemon(extra_config={"log_level": "info"})
    try:
        log = d.stderr_text()
    finally:
        assert d.stop() == 0
    m = re.search(r"effective options: (\{.*\})", log)
    assert m, log[-2000:]
    effective = json.loads(m.group(1))
    t = tables()
    assert set(t["Daemon keys"]) == set(effective), set(t["Daemon keys"]) ^ set(effective)
    assert set(t["Namespaces"]) == set(effective["namespaces"][0]), set(t["Namespaces"]) ^ set(effective["namespaces"][0])


def test_a_namespaces_lease_quota_is_taken_from_the_config():
    """`max_leased_bytes` of a namespace entry bounds its write leases: a batch past it is
    refused its lease (counted in /metrics) and stored over the staging area instead; a value
    that is not a byte count refuses the start, naming the entry."""
    import urllib.request
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        metrics = f"127.0.0.1:{s.getsockname()[1]}"
    d = Daemon(extra_config={"write_leases": True, "metrics_listen": metrics,
                             "namespaces": [{"name": "default", "token": "", "max_leased_bytes": 65536}]})
    try:
        with sparsekv.Client(d.unix, "default", "") as c:
            keys = [i.to_bytes(16, "little") for i in range(4)]
            values = [os.urandom(1 << 20) for _ in keys]
            assert c.put(keys, values) == [None] * 4
            assert c.get(keys) == values
        text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5).read().decode()
        refused = re.search(r"^sparsekv_write_lease_refused_total (\S+)$", text, re.M)
        assert refused and float(refused.group(1)) >= 1, text[-3000:]
    finally:
        assert d.stop() == 0
    try:
        Daemon(extra_config={"namespaces": [{"name": "default", "max_leased_bytes": "lots"}]}, start_timeout=5)
    except RuntimeError as e:
        assert "namespaces[0]" in str(e) and "max_leased_bytes" in str(e), str(e)
    else:
        raise AssertionError("a namespace with max_leased_bytes \"lots\" started")
