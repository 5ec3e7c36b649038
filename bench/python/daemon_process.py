"""A sparsekvd child for the Python tests and benchmarks: its own data directory, a free TCP
port, a Unix socket, and the namespaces asked for; stopped with SIGTERM.

With resp=True it also listens for the Redis protocol (RESP) on a second free TCP port
(self.resp_port, self.resp_tcp) and a second Unix socket (self.resp_unix_path); with ssd_bytes
the SSD tier is on, its file under the data directory."""

import json
import os
import signal
import socket
import subprocess
import tempfile
import time


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _unix_open(path):
    # The socket's file appears at bind(), before listen(): only a connection says it is ready.
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(0.2)
            s.connect(path)
            return True
    except OSError:
        return False


def _port_open(port):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


class Daemon:
    def __init__(self, binary=None, namespaces=(("default", ""),), host_bytes="256MiB", resp=False,
                 ssd_bytes=None, write_policy="write-back", max_record_bytes=None, ssd_durability=None,
                 extra_config=None, start_timeout=20):
        """namespaces: (name, token) pairs. host_bytes, ssd_bytes: tier capacities (an int or a
        string such as "64MiB"); ssd_bytes None leaves the SSD tier off. ssd_durability: the SSD
        tier's "durability" (None: the daemon's default, fdatasync; "none" for benchmarks).
        max_record_bytes: the host tier's record limit (None: the daemon's default, the capacity).
        extra_config: keys merged over the top level of the config."""
        self.binary = binary or os.environ.get("SPARSEKVD_PATH", "build/release/api/sparsekvd")
        self.dir = tempfile.TemporaryDirectory(prefix="sparsekv_py_")
        self.port = _free_port()
        self.tcp = f"127.0.0.1:{self.port}"
        self.unix_path = os.path.join(self.dir.name, "d.sock")
        self.unix = "unix:" + self.unix_path
        self.resp = resp
        self.resp_port = None
        self.resp_tcp = None
        self.resp_unix_path = None
        host = {"enabled": True, "capacity_bytes": host_bytes}
        if max_record_bytes is not None:
            host["max_record_bytes"] = max_record_bytes
        ssd = {"enabled": False}
        if ssd_bytes is not None:
            # "path" left out: the daemon puts the tier's file at <data_dir>/ssd.
            ssd = {"enabled": True, "capacity_bytes": ssd_bytes}
            if ssd_durability is not None:
                ssd["durability"] = ssd_durability
        config = {
            "listen": self.tcp,
            "unix_socket": self.unix_path,
            "metrics_listen": "",
            "data_dir": self.dir.name,
            "log_level": "warn",
            "namespaces": [{"name": n, "token": t} for n, t in namespaces],
            "offload": {"write_policy": write_policy, "host": host, "ssd": ssd},
        }
        if resp:
            self.resp_port = _free_port()
            self.resp_tcp = f"127.0.0.1:{self.resp_port}"
            self.resp_unix_path = os.path.join(self.dir.name, "r.sock")
            config["resp_listen"] = self.resp_tcp
            config["resp_unix_socket"] = self.resp_unix_path
        if extra_config:
            config.update(extra_config)
        self.config = config
        path = os.path.join(self.dir.name, "config.json")
        # stderr goes to a file, not a pipe: a daemon that logs much (a test of hostile input)
        # must never block on a pipe nobody reads.
        self.stderr_path = os.path.join(self.dir.name, "stderr.log")
        self.config_path = path
        self.start_timeout = start_timeout
        # A port _free_port found free can be taken by another process (another test, run in
        # parallel) before the daemon binds it: the daemon then exits, and is started again on
        # ports found anew. Ports the caller chose (extra_config) are kept as they are.
        for attempt in range(3):
            with open(path, "w") as f:
                json.dump(config, f)
            try:
                self._launch()
                return
            except RuntimeError as e:
                if attempt == 2 or "Address already in use" not in str(e):
                    raise
            extra = extra_config or {}
            if "listen" not in extra:
                self.port = _free_port()
                self.tcp = config["listen"] = f"127.0.0.1:{self.port}"
            if resp and "resp_listen" not in extra:
                self.resp_port = _free_port()
                self.resp_tcp = config["resp_listen"] = f"127.0.0.1:{self.resp_port}"

    def _launch(self):
        start_timeout = self.start_timeout
        with open(self.stderr_path, "ab") as err:
            self.proc = subprocess.Popen([self.binary, "--config", self.config_path], stdout=subprocess.DEVNULL,
                                         stderr=err)
        deadline = time.monotonic() + start_timeout
        while not self._ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"sparsekvd exited: {self.stderr_text()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"sparsekvd did not start within {start_timeout} s")
            time.sleep(0.05)

    def _ready(self):
        if self.proc.poll() is not None:
            return False  # _launch reports the exit
        if not _unix_open(self.unix_path) or not _port_open(self.port):
            return False
        if self.resp:
            return _unix_open(self.resp_unix_path) and _port_open(self.resp_port)
        return True

    def stderr_text(self, limit=20000):
        """The last `limit` characters the daemon wrote to stderr ("" once stopped)."""
        try:
            with open(self.stderr_path, "rb") as f:
                return f.read().decode(errors="replace")[-limit:]
        except OSError:
            return ""

    def kill_and_restart(self):
        """SIGKILL (no drain, no flush), then start again on the same data directory."""
        self.proc.kill()
        self.proc.wait()
        for p in (self.unix_path, self.resp_unix_path):
            # The sockets' files are left behind by a killed daemon; the next one replaces them
            # (stale), but _ready must not take them for the new daemon's.
            if p and os.path.exists(p):
                os.unlink(p)
        self._launch()

    def alive(self):
        return self.proc.poll() is None

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.dir.cleanup()
        return self.proc.returncode


class RedisServer:
    """A plain redis-server child on a free loopback port and a Unix socket, with no persistence:
    the attributes a Daemon(resp=True) has that RESP tests and benchmarks use (resp_port,
    resp_tcp, resp_unix_path, stop). `config_lines` go into its redis.conf."""

    def __init__(self, binary="redis-server", config_lines=(), maxmemory=None):
        self.dir = tempfile.TemporaryDirectory(prefix="sparsekv_redis_")
        self.resp_port = _free_port()
        self.resp_tcp = f"127.0.0.1:{self.resp_port}"
        self.resp_unix_path = os.path.join(self.dir.name, "r.sock")
        lines = [f"port {self.resp_port}", "bind 127.0.0.1", 'save ""', "appendonly no",
                 f"unixsocket {self.resp_unix_path}", "unixsocketperm 700", f"dir {self.dir.name}",
                 'logfile ""', *config_lines]
        if maxmemory is not None:
            lines += [f"maxmemory {maxmemory}", "maxmemory-policy allkeys-lru"]
        conf = os.path.join(self.dir.name, "redis.conf")
        with open(conf, "w") as f:
            f.write("\n".join(lines) + "\n")
        self.proc = subprocess.Popen([binary, conf], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not _port_open(self.resp_port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)

    def alive(self):
        return self.proc.poll() is None

    def stderr_text(self):
        return ""

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.dir.cleanup()
        return self.proc.returncode
