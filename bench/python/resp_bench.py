#!/usr/bin/python3
"""redis-benchmark against a redis-server and a sparsekvd (its RESP listener), both started here,
the same client binary and options for both, in the same run.

Cells: SET and GET at each value size (--sizes) and pipeline depth (--pipelines), -c clients.
Each cell runs --repeats rounds, interleaved (redis, sparsekvd, redis, sparsekvd, ...), and
reports the median requests/s of each. -n is chosen per cell so that a run takes about --seconds
on the slower of the two servers (a short probe run of each measures it), and the same -n is
used for both. SET and GET use redis-benchmark's one key "key:__rand_int__" (no -r); before a GET
cell that key is written with a value of the cell's size, so every GET returns a value.

--working-set: a second phase. Each server gets H bytes of memory (redis-server: --maxmemory H
--maxmemory-policy allkeys-lru; sparsekvd: a host tier of H bytes and an SSD tier of
--ws-ssd-factor x the working set), then a working set of --ws-factor x H bytes of 64 KiB values
is written under redis-benchmark's key names (key:000000000000, ...) by a pipelined Python
driver, and read back once in a random order: --ws-order uniform (a random permutation, each key
read once; the default) or zipf (draws from a Zipf law of exponent --ws-zipf-s over the keys in a
random rank order). The SSD tier runs with durability "none" (--ws-ssd-durability), as
redis-server here persists nothing either. Reported for each server: the hit ratio (GETs that returned the key's own
value / GETs), the driver's GET rate (one connection, pipelined 64 deep: Python-bound) and
redis-benchmark's GET rate over the same keyspace (-r N, uniform random keys, -c clients -P 1).

Children are bounded: every redis-benchmark run has --timeout seconds, and every server is
stopped at exit (SIGTERM, then SIGKILL), on an error or a signal too.

  resp_bench.py --sparsekvd build/release/api/sparsekvd [--json] [--working-set]
  resp_bench.py --redis-only --quick      # no sparsekvd at all
"""

import argparse
import atexit
import csv
import io
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from daemon_process import Daemon, RedisServer, _free_port  # noqa: E402

_CHILDREN = []  # servers to stop at exit


def _stop_all():
    while _CHILDREN:
        try:
            _CHILDREN.pop().stop()
        except Exception as e:  # noqa: BLE001 - best effort at exit
            print(f"resp_bench: stopping a server: {e}", file=sys.stderr)


def _on_signal(signum, _frame):
    raise SystemExit(128 + signum)


def parse_size(text):
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B?|B)?\s*", text, re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}")
    unit = (m.group(2) or "B").upper().replace("IB", "").replace("B", "")
    return int(float(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[unit])


def show_size(n):
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return f"{n}B"


def machine():
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu": cpu or "unknown", "cores": os.cpu_count() or 1}


def tool_version(argv):
    try:
        return subprocess.run(argv, capture_output=True, timeout=10).stdout.decode().strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


# --- servers ------------------------------------------------------------------------------------


def redis_child(binary, maxmemory=None):
    r = RedisServer(binary, maxmemory=maxmemory)
    _CHILDREN.append(r)
    return r


def start_sparsekvd(binary, host_bytes, ssd_bytes=None, ssd_durability=None):
    d = Daemon(binary=binary, resp=True, host_bytes=host_bytes, ssd_bytes=ssd_bytes, ssd_durability=ssd_durability)
    _CHILDREN.append(d)
    return d


def stop(server):
    if server in _CHILDREN:
        _CHILDREN.remove(server)
    server.stop()


# --- a small pipelined RESP client (no redis-py needed) -----------------------------------------


class Resp:
    def __init__(self, port, timeout=60):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray()

    @staticmethod
    def encode(*args):
        out = [b"*%d\r\n" % len(args)]
        for a in args:
            a = a if isinstance(a, (bytes, bytearray, memoryview)) else str(a).encode()
            out += [b"$%d\r\n" % len(a), a, b"\r\n"]
        return b"".join(out)

    def _line(self):
        while True:
            i = self.buf.find(b"\r\n")
            if i >= 0:
                line = bytes(self.buf[:i])
                del self.buf[:i + 2]
                return line
            self._fill()

    def _fill(self):
        chunk = self.sock.recv(1 << 20)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        self.buf += chunk

    def reply(self):
        line = self._line()
        t = line[:1]
        if t == b"+":
            return line[1:].decode()
        if t == b"-":
            raise RuntimeError(line[1:].decode())
        if t == b":":
            return int(line[1:])
        if t == b"$":
            n = int(line[1:])
            if n < 0:
                return None
            while len(self.buf) < n + 2:
                self._fill()
            out = bytes(self.buf[:n])
            del self.buf[:n + 2]
            return out
        if t == b"_":
            return None
        if t == b"*":
            n = int(line[1:])
            return None if n < 0 else [self.reply() for _ in range(n)]
        raise RuntimeError(f"unexpected reply {line[:60]!r}")

    def call(self, *args):
        self.sock.sendall(self.encode(*args))
        return self.reply()

    def pipeline(self, commands):
        self.sock.sendall(b"".join(self.encode(*c) for c in commands))
        return [self.reply() for _ in commands]

    def close(self):
        self.sock.close()


# --- redis-benchmark ----------------------------------------------------------------------------


def redis_benchmark(tool, port, op, size, pipeline, clients, n, timeout, keyspace=None):
    argv = [tool, "-h", "127.0.0.1", "-p", str(port), "-t", op.lower(), "-n", str(n), "-c", str(clients),
            "-d", str(size), "-P", str(pipeline), "--csv"]
    if keyspace:
        argv += ["-r", str(keyspace)]
    out = subprocess.run(argv, capture_output=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {out.returncode}: {out.stderr.decode()[-2000:]}")
    rows = list(csv.reader(io.StringIO(out.stdout.decode())))
    if not rows or rows[0][:2] != ["test", "rps"]:
        raise RuntimeError(f"redis-benchmark --csv printed no table: {out.stdout.decode()[-2000:]}")
    for row in rows[1:]:
        if row and row[0] == op.upper():
            return float(row[1])
    raise RuntimeError(f"redis-benchmark --csv has no {op} row: {out.stdout.decode()[-2000:]}")


def prepare_get(port, size):
    c = Resp(port)
    c.call("SET", "key:__rand_int__", os.urandom(size))
    c.close()


def check_get_key(port, size):
    c = Resp(port)
    n = c.call("STRLEN", "key:__rand_int__")
    c.close()
    return n == size


def run_cells(args, servers):
    """servers: [(name, port)], redis first. Returns the cells."""
    cells = []
    specs = [(op, size, p) for size in args.sizes for p in args.pipelines for op in ("SET", "GET")]
    for op, size, p in specs:
        def once(port, n):
            if op == "GET":
                prepare_get(port, size)
            rps = redis_benchmark(args.redis_benchmark, port, op, size, p, args.clients, n, args.timeout)
            if op == "GET" and not check_get_key(port, size):
                print(f"resp_bench: warning: key:__rand_int__ is not {size} bytes after the GET run",
                      file=sys.stderr)
            return rps

        if args.quick:
            n = args.quick_n
        else:
            # Probe: a short run on each server; -n for ~args.seconds on the slower one.
            probe_n = min(20000, max(args.clients * p, (32 << 20) // size))
            slowest = min(once(port, probe_n) for _, port in servers)
            n = max(args.clients * p, int(slowest * args.seconds))
        runs = {name: [] for name, _ in servers}
        for _ in range(args.repeats):
            for name, port in servers:
                runs[name].append(once(port, n))
        redis_rps = statistics.median(runs["redis"])
        skv = statistics.median(runs["sparsekvd"]) if "sparsekvd" in runs else None
        cell = {"op": op, "size": size, "pipeline": p, "clients": args.clients, "n": n,
                "redis_rps": redis_rps, "sparsekvd_rps": skv,
                "ratio": (skv / redis_rps) if skv is not None and redis_rps > 0 else None,
                "redis_runs": runs["redis"], "sparsekvd_runs": runs.get("sparsekvd")}
        cells.append(cell)
        if not args.json:
            print(format_row(cell), flush=True)
    return cells


def format_header():
    return f"{'op':<4} {'size':>7} {'P':>3} {'n':>8} {'redis rps':>12} {'sparsekvd rps':>14} {'ratio':>6}  " \
           f"{'redis MB/s':>10} {'skv MB/s':>9}"


def format_row(c):
    mb = lambda rps: f"{rps * c['size'] / 1e6:.0f}" if rps else "-"  # noqa: E731
    skv = f"{c['sparsekvd_rps']:.0f}" if c["sparsekvd_rps"] is not None else "-"
    ratio = f"{c['ratio']:.2f}" if c["ratio"] is not None else "-"
    return (f"{c['op']:<4} {show_size(c['size']):>7} {c['pipeline']:>3} {c['n']:>8} {c['redis_rps']:>12.0f} "
            f"{skv:>14} {ratio:>6}  {mb(c['redis_rps']):>10} {mb(c['sparsekvd_rps']):>9}")


# --- the working-set phase ----------------------------------------------------------------------


def ws_value(base, i):
    return struct.pack("<Q", i) + base[8:]


def working_set_on(args, port, keys, order, base):
    """Writes every key, reads them back in `order`; the hit ratio and rates."""
    c = Resp(port)
    batch = 64
    t0 = time.monotonic()
    for lo in range(0, keys, batch):
        replies = c.pipeline([("SET", f"key:{i:012d}", ws_value(base, i)) for i in range(lo, min(keys, lo + batch))])
        if any(r != "OK" for r in replies):
            raise RuntimeError(f"a working-set SET failed: {replies[:3]}")
    set_seconds = time.monotonic() - t0
    hits = wrong = 0
    t0 = time.monotonic()
    for lo in range(0, len(order), batch):
        part = order[lo:lo + batch]
        for i, v in zip(part, c.pipeline([("GET", f"key:{i:012d}") for i in part])):
            if v is None:
                continue
            if v == ws_value(base, i):
                hits += 1
            else:
                wrong += 1
    get_seconds = time.monotonic() - t0
    c.close()
    n = args.quick_n if args.quick else max(args.clients, int(args.ws_bench_requests))
    bench_rps = redis_benchmark(args.redis_benchmark, port, "GET", len(base), 1, args.clients, n, args.timeout,
                                keyspace=keys)
    return {"gets": len(order), "hits": hits, "wrong_values": wrong, "hit_ratio": hits / len(order),
            "set_rps": keys / set_seconds, "get_rps": len(order) / get_seconds,
            "redis_benchmark_get_rps": bench_rps}


def working_set(args):
    h = args.ws_host_bytes
    value = args.ws_value_bytes
    keys = int(math.ceil(args.ws_factor * h / value))
    rnd = random.Random(args.seed)
    base = rnd.randbytes(value)
    if args.ws_order == "uniform":
        order = list(range(keys))
        rnd.shuffle(order)
    else:
        ranks = list(range(keys))
        rnd.shuffle(ranks)  # which key is the most popular
        weights = [1.0 / (r + 1) ** args.ws_zipf_s for r in range(keys)]
        order = [ranks[r] for r in rnd.choices(range(keys), weights=weights, k=keys)]
    ssd = int(args.ws_ssd_factor * keys * value)
    ssd = (ssd + 4095) // 4096 * 4096
    out = {"host_bytes": h, "value_bytes": value, "keys": keys, "working_set_bytes": keys * value,
           "order": args.ws_order, "zipf_s": args.ws_zipf_s if args.ws_order == "zipf" else None,
           "ssd_bytes": None if args.redis_only else ssd,
           "ssd_durability": None if args.redis_only else args.ws_ssd_durability,
           "driver": "python, one connection, pipelined 64 deep",
           "redis_benchmark": f"GET -r {keys} -c {args.clients} -P 1 (uniform random keys)"}
    r = redis_child(args.redis_server, maxmemory=h)
    try:
        out["redis"] = working_set_on(args, r.resp_port, keys, order, base)
    finally:
        stop(r)
    if not args.redis_only:
        d = start_sparsekvd(args.sparsekvd, host_bytes=h, ssd_bytes=ssd, ssd_durability=args.ws_ssd_durability)
        try:
            out["sparsekvd"] = working_set_on(args, d.resp_port, keys, order, base)
        finally:
            stop(d)
    return out


def print_working_set(ws):
    print(f"\nworking set: {ws['keys']} x {show_size(ws['value_bytes'])} = {ws['working_set_bytes'] / 2**20:.0f} MiB, "
          f"memory H = {show_size(ws['host_bytes'])}, read order {ws['order']}"
          + (f" (s={ws['zipf_s']})" if ws["zipf_s"] else "")
          + (f", sparsekvd SSD tier {ws['ssd_bytes'] / 2**20:.0f} MiB" if ws["ssd_bytes"] else ""))
    print(f"{'server':<10} {'hit ratio':>9} {'wrong':>5} {'driver GET/s':>12} {'redis-benchmark GET/s':>22}")
    for name in ("redis", "sparsekvd"):
        if name in ws:
            w = ws[name]
            print(f"{name:<10} {w['hit_ratio']:>9.3f} {w['wrong_values']:>5} {w['get_rps']:>12.0f} "
                  f"{w['redis_benchmark_get_rps']:>22.0f}")


# --- main ---------------------------------------------------------------------------------------


def native_get(args, daemon):
    """The native protocol's TCP GET of 64 KiB values against the same sparsekvd, through
    `sparsekv bench daemon` (the CLI beside the daemon binary), for comparison with the cells."""
    cli = os.path.join(os.path.dirname(os.path.abspath(args.sparsekvd)), "sparsekv")
    size = 64 << 10
    cmd = [cli, "bench", "daemon", "--addr", daemon.tcp, "--value-bytes", str(size), "--clients",
           str(args.clients), "--seconds", str(0.3 if args.quick else max(1.0, args.seconds)), "--json"]
    if args.quick:
        cmd += ["--keys-per-client", "4"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr.strip()}")
    j = json.loads(out.stdout)
    return {"value_bytes": size, "clients": args.clients, "get_ops_per_s": j["get_ops_per_s"],
            "get_p99_us": j["get_p99_us"], "command": " ".join(cmd)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sparsekvd", default=os.environ.get("SPARSEKVD_PATH", "build/release/api/sparsekvd"),
                    help="the daemon binary (default: $SPARSEKVD_PATH)")
    ap.add_argument("--redis-server", default=shutil.which("redis-server") or "redis-server")
    ap.add_argument("--redis-benchmark", default=shutil.which("redis-benchmark") or "redis-benchmark")
    ap.add_argument("--redis-only", action="store_true", help="no sparsekvd: only redis-server's numbers")
    ap.add_argument("--sizes", default="4KiB,64KiB,1MiB,6MiB", help="value sizes, comma-separated")
    ap.add_argument("--pipelines", default="1,16", help="-P depths, comma-separated")
    ap.add_argument("--clients", type=int, default=8, help="-c")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds per cell; the median is reported")
    ap.add_argument("--seconds", type=float, default=1.0, help="aimed duration of one run on the slower server")
    ap.add_argument("--host-bytes", default="2GiB", help="sparsekvd's host tier for the cells")
    ap.add_argument("--timeout", type=float, default=120, help="seconds allowed to one redis-benchmark run")
    ap.add_argument("--quick", action="store_true",
                    help="a tiny run for the test suite: 4 KiB only, one round, -n --quick-n, a small working set")
    ap.add_argument("--quick-n", type=int, default=400)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    ap.add_argument("--working-set", action="store_true", help="also run the working-set phase")
    ap.add_argument("--ws-host-bytes", default="256MiB", help="H: redis-server's maxmemory and sparsekvd's host tier")
    ap.add_argument("--ws-factor", type=float, default=3.0, help="the working set, in multiples of H")
    ap.add_argument("--ws-value-bytes", default="64KiB")
    ap.add_argument("--ws-ssd-factor", type=float, default=2.0, help="sparsekvd's SSD tier, in working sets")
    ap.add_argument("--ws-ssd-durability", default="none",
                    help="the SSD tier's durability (none: like redis-server here, which saves nothing)")
    ap.add_argument("--ws-order", choices=["uniform", "zipf"], default="uniform")
    ap.add_argument("--ws-zipf-s", type=float, default=1.1)
    ap.add_argument("--ws-bench-requests", type=int, default=20000, help="-n of the working-set redis-benchmark GET")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-native", action="store_true",
                    help="skip the native protocol's TCP GET at 64 KiB (sparsekv bench daemon) measured beside")
    args = ap.parse_args(argv)

    args.sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    args.pipelines = [int(p) for p in args.pipelines.split(",") if p.strip()]
    args.ws_host_bytes = parse_size(args.ws_host_bytes)
    args.ws_value_bytes = parse_size(args.ws_value_bytes)
    args.host_bytes = parse_size(args.host_bytes)
    if args.quick:
        args.sizes, args.pipelines, args.repeats = [4096], [1, 16], 1
        args.ws_host_bytes = 8 << 20
        args.host_bytes = min(args.host_bytes, 256 << 20)
    for tool in (args.redis_server, args.redis_benchmark):
        if shutil.which(tool) is None:
            ap.error(f"{tool} not found (Debian: redis-server, redis-tools)")
    if not args.redis_only and not os.access(args.sparsekvd, os.X_OK):
        ap.error(f"no sparsekvd at {args.sparsekvd!r}: --sparsekvd PATH, SPARSEKVD_PATH, or --redis-only")
    if max(args.sizes) > args.host_bytes // 4:
        ap.error("--host-bytes must be at least 4x the largest size")

    atexit.register(_stop_all)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)

    result = {"machine": machine(),
              "tools": {"redis-server": tool_version([args.redis_server, "--version"]),
                        "redis-benchmark": tool_version([args.redis_benchmark, "--version"])},
              "config": {"clients": args.clients, "repeats": args.repeats, "seconds": args.seconds,
                         "quick": args.quick, "redis_only": args.redis_only,
                         "sparsekvd": None if args.redis_only else os.path.abspath(args.sparsekvd),
                         "sparsekvd_host_bytes": None if args.redis_only else args.host_bytes,
                         "interleaving": "per cell: redis, sparsekvd, redis, sparsekvd, ...; median of repeats"}}
    if not args.json:
        m = result["machine"]
        print(f"{m['cpu']}, {m['cores']} cores; {result['tools']['redis-benchmark']}; -c {args.clients}, "
              f"median of {args.repeats} interleaved runs")
        print(format_header(), flush=True)

    redis_server = redis_child(args.redis_server)
    servers = [("redis", redis_server.resp_port)]
    daemon = None
    if not args.redis_only:
        daemon = start_sparsekvd(args.sparsekvd, host_bytes=args.host_bytes)
        servers.append(("sparsekvd", daemon.resp_port))
    try:
        result["cells"] = run_cells(args, servers)
        if daemon is not None and not args.no_native:
            result["native_get"] = native_get(args, daemon)
            if not args.json:
                ng = result["native_get"]
                print(f"native protocol, TCP, GET {show_size(ng['value_bytes'])}, {ng['clients']} clients "
                      f"(sparsekv bench daemon, same sparsekvd): {ng['get_ops_per_s']:.0f} GET/s", flush=True)
    finally:
        stop(redis_server)
        if daemon is not None:
            stop(daemon)
    if args.working_set:
        result["working_set"] = working_set(args)
        if not args.json:
            print_working_set(result["working_set"])
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
