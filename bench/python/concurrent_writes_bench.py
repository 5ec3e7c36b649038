"""Many clients storing large values at once, more than the daemon's buffer budget holds: LMCache's
offload pattern over RESP (a redis.asyncio pool, SET <key>kv_bytes, SET <key>metadata, EXISTS,
GET back), or one native PUT per client over TCP (threads on sparsekv.Client). Prints one JSON
line: seconds, errors, values that came back wrong or missing, and the daemon's frame timeouts
and budget passes. A wait on the daemon's own budget must never cost a client its connection.

  PYTHONPATH=build/test/python SPARSEKVD_PATH=build/test/api/sparsekvd \\
    /usr/bin/python3 bench/python/concurrent_writes_bench.py --protocol resp --clients 150 --mib 32

The host tier is sized to hold every value (clients x MiB x 1.1): 150 x 32 MiB needs about 5.3 GiB
of memory for it, as much again for the values in this process."""

import argparse
import asyncio
import json
import os
import re
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from daemon_process import Daemon, _free_port  # noqa: E402


def metrics(port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for name in ("sparsekv_frame_timeouts_total", "sparsekv_resp_timeouts_total", "sparsekv_budget_passes_total"):
        m = re.search(rf"^{name} (\d+)$", text, re.M)
        out[name] = int(m.group(1)) if m else None
    return out


def run_resp(d, values):
    import redis.asyncio
    errors, wrong = [], 0

    async def main():
        nonlocal wrong
        pool = redis.asyncio.ConnectionPool(host="127.0.0.1", port=d.resp_port, max_connections=150)
        client = redis.asyncio.Redis(connection_pool=pool)

        async def one(i):
            nonlocal wrong
            key = f"lmc:{i}@chunk"
            try:
                await client.set(key + "kv_bytes", values[i])
                await client.set(key + "metadata", b"meta")
                await client.exists(key + "metadata")
                wrong += await client.get(key + "kv_bytes") != values[i]
            except Exception as e:  # noqa: BLE001  (counted: the point is how many)
                errors.append(repr(e)[:200])

        await asyncio.gather(*(one(i) for i in range(len(values))))
        await client.close()
        await pool.disconnect()

    asyncio.run(main())
    return errors, wrong


def run_native(d, values):
    import sparsekv
    clients = [sparsekv.Client(d.tcp) for _ in values]
    errors, barrier = [], threading.Barrier(len(values))

    def one(i):
        barrier.wait()
        r = clients[i].put([i.to_bytes(16, "little")], [values[i]])
        if r[0] is not None:
            errors.append(str(r[0])[:200])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(values))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wrong = sum(bytes(c.get([i.to_bytes(16, "little")])[0] or b"") != values[i] for i, c in enumerate(clients))
    return errors, wrong


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--protocol", choices=("resp", "native"), default="resp")
    ap.add_argument("--clients", type=int, default=48)
    ap.add_argument("--mib", type=int, default=32, help="MiB per value")
    ap.add_argument("--budget-mib", type=int, default=None, help="max_buffered_bytes (default: the daemon's)")
    args = ap.parse_args()
    size = args.mib << 20
    mport = _free_port()
    extra = {"metrics_listen": f"127.0.0.1:{mport}", "max_connections": max(256, args.clients + 8)}
    if args.budget_mib:
        extra["max_buffered_bytes"] = args.budget_mib << 20
    d = Daemon(resp=args.protocol == "resp", host_bytes=f"{(args.clients * size * 11 // 10) >> 20}MiB",
               max_record_bytes=size + (1 << 20), extra_config=extra)
    try:
        base = os.urandom(size)
        values = [base[i % 4096:] + base[:i % 4096] for i in range(args.clients)]  # distinct, cheap to make
        t0 = time.monotonic()
        errors, wrong = (run_resp if args.protocol == "resp" else run_native)(d, values)
        took = time.monotonic() - t0
        print(json.dumps({"protocol": args.protocol, "clients": args.clients, "mib": args.mib, "seconds": round(took, 2),
                          "errors": len(errors), "wrong_or_missing": wrong, "first_errors": errors[:3],
                          **metrics(mport)}))
    finally:
        d.stop()


if __name__ == "__main__":
    main()
