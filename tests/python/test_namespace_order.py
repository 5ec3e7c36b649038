"""Namespace ids are positions in the config's `namespaces`, and the tiers file blocks under them:
a daemon restarted on the same data dir with its namespaces reordered or removed must refuse to
start (it would serve one namespace another's blocks); adding one after the others is fine, and
the new one sees none of the old blocks."""

import json
import os
import signal
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "python"))
from daemon_process import Daemon  # noqa: E402

import sparsekv  # noqa: E402

KEY = (7).to_bytes(8, "little") + b"ns-order"


def restart(d, names):
    d.proc.send_signal(signal.SIGTERM)
    d.proc.wait(timeout=20)
    d.config["namespaces"] = [{"name": n, "token": n + "-token"} for n in names]
    with open(d.config_path, "w") as f:
        json.dump(d.config, f)
    d._launch()


def refused(d, names):
    with pytest.raises(RuntimeError) as e:
        restart(d, names)
    return str(e.value)


def test_reordered_or_removed_namespaces_are_refused_and_added_ones_start_empty():
    d = Daemon(namespaces=(("a", "a-token"), ("b", "b-token")), ssd_bytes="64MiB")
    try:
        with sparsekv.Client(d.unix, "a", "a-token") as c:
            assert c.put([KEY], [b"a's block"]) == [None]
        registry = os.path.join(d.dir.name, "namespaces.json")
        assert json.load(open(registry)) == {"namespaces": ["a", "b"]}

        msg = refused(d, ["b", "a"])
        assert "namespace 1 of this data dir is 'a', but the config puts 'b' there" in msg, msg
        msg = refused(d, ["a"])
        assert "namespace 2 of this data dir is 'b', but the config has only 1" in msg, msg
        assert json.load(open(registry)) == {"namespaces": ["a", "b"]}  # a refusal changes nothing

        restart(d, ["a", "b", "c"])
        assert json.load(open(registry)) == {"namespaces": ["a", "b", "c"]}
        with sparsekv.Client(d.unix, "a", "a-token") as c:
            assert c.get([KEY])[0].tobytes() == b"a's block"
        with sparsekv.Client(d.unix, "c", "c-token") as c:
            assert c.get([KEY]) == [None]

        with open(registry, "w") as f:
            f.write("[not a list")
        msg = refused(d, ["a", "b", "c"])
        assert "is not a namespace list" in msg, msg
    finally:
        d.stop()
