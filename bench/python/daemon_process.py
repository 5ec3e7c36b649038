"""A sparsekvd child for the Python tests and benchmarks: its own data directory, a free TCP
port, a Unix socket, and the namespaces asked for; stopped with SIGTERM."""

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


class Daemon:
    def __init__(self, binary=None, namespaces=(("default", ""),), host_bytes="256MiB"):
        self.binary = binary or os.environ.get("SPARSEKVD_PATH", "build/release/api/sparsekvd")
        self.dir = tempfile.TemporaryDirectory(prefix="sparsekv_py_")
        self.port = _free_port()
        self.tcp = f"127.0.0.1:{self.port}"
        self.unix_path = os.path.join(self.dir.name, "d.sock")
        self.unix = "unix:" + self.unix_path
        config = {
            "listen": self.tcp,
            "unix_socket": self.unix_path,
            "metrics_listen": "",
            "data_dir": self.dir.name,
            "log_level": "warn",
            "namespaces": [{"name": n, "token": t} for n, t in namespaces],
            "offload": {"write_policy": "write-back", "host": {"enabled": True, "capacity_bytes": host_bytes},
                        "ssd": {"enabled": False}},
        }
        path = os.path.join(self.dir.name, "config.json")
        with open(path, "w") as f:
            json.dump(config, f)
        self.proc = subprocess.Popen([self.binary, "--config", path], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        deadline = time.monotonic() + 20
        while not self._ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"sparsekvd exited: {self.proc.stderr.read().decode(errors='replace')}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("sparsekvd did not start within 20 s")
            time.sleep(0.05)

    def _ready(self):
        if not os.path.exists(self.unix_path):
            return False
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return True
        except OSError:
            return False

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
