#!/usr/bin/env python3
"""`sparsekv.Client` against the C++ client, same run: a batch GET of N values of B bytes,
timed from Python (memoryviews handed back) and from C++ (the same client library, no Python in
the loop), alternating, over TCP and over the Unix socket with shared memory; then the same batch
read into caller memory (`get_into`) from Python into a numpy array and into a torch tensor,
against C++ `Client::GetInto` into the same array. Prints JSON with the medians and ratios. Starts its own sparsekvd (SPARSEKVD_PATH, else
build/release/api/sparsekvd) unless --address is given.

    PYTHONPATH=build/release/python python3 bench/python/client_bench.py --values 64 --bytes 65536
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sparsekv  # noqa: E402
from sparsekv import _sparsekv  # noqa: E402


def run(address_tcp, address_unix, namespace="default", token="", values=64, value_bytes=65536, rounds=15,
        iterations=20):
    keys = [i.to_bytes(8, "little") + b"pybench\0" for i in range(values)]
    data = [os.urandom(value_bytes) for _ in range(values)]
    out = {"values": values, "value_bytes": value_bytes, "rounds": rounds, "iterations_per_round": iterations}
    with sparsekv.Client(address_tcp, namespace, token, shared_memory=False) as c:
        assert all(e is None for e in c.put(keys, data))
    for name, address, shm in (("tcp", address_tcp, False), ("unix_shm", address_unix, True)):
        if address is None:
            continue
        py_s, cpp_s = [], []
        baseline = _sparsekv._CppBaseline(address, namespace, token, shm)
        with sparsekv.Client(address, namespace, token, shared_memory=shm) as c:
            got = c.get(keys)
            assert all(bytes(g) == d for g, d in zip(got, data)), "wrong bytes back"
            baseline.get_loop(keys, iterations)  # both connections warmed alike
            for _ in range(rounds):
                t0 = time.perf_counter()
                for _ in range(iterations):
                    got = c.get(keys)
                    del got  # dropped before the next call, as the C++ loop drops its results
                py_s.append((time.perf_counter() - t0) / iterations)
                cpp_s.append(sum(baseline.get_loop(keys, iterations)) / iterations)
            shared = c.shared_memory
            into = measure_into(c, baseline, keys, data, value_bytes, rounds, iterations)
        py_m, cpp_m = statistics.median(py_s), statistics.median(cpp_s)
        ratios = [p / q for p, q in zip(py_s, cpp_s)]
        out[name] = {
            "python_get_seconds": py_m,
            "cpp_get_seconds": cpp_m,
            "python_vs_cpp": py_m / cpp_m,
            "python_vs_cpp_paired_median": statistics.median(ratios),
            "python_get_bytes_per_s": values * value_bytes / py_m,
            "shared_memory": shared,
            **into,
        }
    return out


def measure_into(c, baseline, keys, data, value_bytes, rounds, iterations):
    """get_into from Python into a numpy array and a torch tensor, against the C++ client's
    GetInto into the same numpy array, alternating; every byte checked once before timing."""
    import numpy as np
    arr = np.zeros((len(keys), value_bytes), dtype=np.uint8)
    targets = {"numpy": arr}
    try:
        import torch
        targets["torch"] = torch.zeros((len(keys), value_bytes), dtype=torch.uint8)
    except ImportError:
        pass
    for name, t in targets.items():
        assert c.get_into(keys, t) == [value_bytes] * len(keys)
        got = t.numpy() if name == "torch" else t
        assert all(got[i].tobytes() == d for i, d in enumerate(data)), f"wrong bytes into {name}"
    baseline.get_into_loop(keys, arr, iterations)
    secs = {name: [] for name in targets}
    cpp = []
    for _ in range(rounds):
        for name, t in targets.items():
            t0 = time.perf_counter()
            for _ in range(iterations):
                c.get_into(keys, t)
            secs[name].append((time.perf_counter() - t0) / iterations)
        cpp.append(sum(baseline.get_into_loop(keys, arr, iterations)) / iterations)
    total = len(keys) * value_bytes
    cpp_m = statistics.median(cpp)
    out = {"cpp_into_seconds": cpp_m, "cpp_into_bytes_per_s": total / cpp_m}
    for name, s in secs.items():
        m = statistics.median(s)
        out[f"python_into_{name}_seconds"] = m
        out[f"python_into_{name}_bytes_per_s"] = total / m
        out[f"python_into_{name}_vs_cpp"] = m / cpp_m
        out[f"python_into_{name}_vs_cpp_paired_median"] = statistics.median(p / q for p, q in zip(s, cpp))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--address", help="TCP address of a running sparsekvd (default: start one)")
    ap.add_argument("--unix", help="unix:PATH of the same daemon")
    ap.add_argument("--namespace", default="default")
    ap.add_argument("--token", default="")
    ap.add_argument("--values", type=int, default=64)
    ap.add_argument("--bytes", type=int, default=65536)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--iterations", type=int, default=20)
    a = ap.parse_args()
    daemon = None
    if a.address is None:
        from daemon_process import Daemon
        daemon = Daemon(namespaces=((a.namespace, a.token),))
        a.address, a.unix = daemon.tcp, daemon.unix
    try:
        print(json.dumps(run(a.address, a.unix, a.namespace, a.token, a.values, a.bytes, a.rounds, a.iterations),
                         indent=2))
    finally:
        if daemon:
            daemon.stop()


if __name__ == "__main__":
    main()
