"""Long commands show progress on a terminal and nothing otherwise (issue 37): `sparsekv stress
suspend` run under a pseudo-terminal (util-linux's `script`) draws its progress line, notes
included, and clears it before its results; with stderr a pipe there is no progress text."""

import os
import subprocess
import tempfile

CLI = os.path.join(os.path.dirname(os.path.abspath(os.environ.get("SPARSEKVD_PATH", "build/release/api/sparsekvd"))),
                   "sparsekv")
ARGS = "stress suspend --seconds 1 --kill-cycles 2 --requests 2 --max-request-tokens 50"


def test_progress_on_a_terminal_only():
    with tempfile.TemporaryDirectory() as d:
        # Bytes, not text: universal newlines would turn the redraws' \r into \n.
        tty = subprocess.run(["script", "-qec", f"{CLI} {ARGS} --dir {d}", "/dev/null"], capture_output=True,
                             timeout=120)
        assert tty.returncode == 0, tty.stdout + tty.stderr
        out = tty.stdout
        assert b"\r\x1b[Ksparsekv stress suspend: kill cycle 1 of 2" in out, out[-2000:]
        # Cleared before the results: the summary starts a fresh line.
        assert b"\r\x1b[Kacknowledged tokens" in out, out[-2000:]
        plain = subprocess.run([CLI] + ARGS.split() + ["--dir", d], capture_output=True, text=True, timeout=120)
        assert plain.returncode == 0, plain.stderr
        assert "kill cycle" not in plain.stderr and "\x1b[K" not in plain.stderr + plain.stdout
