"""The README's five-minute tour, command by command, as a newcomer types it (issue 37).

The commands between ``<!-- tour:begin -->`` and ``<!-- tour:end -->`` are run as written with
bash, in a scratch directory laid out as the repository root after ``./run.sh``:
``build/release`` is this build (SPARSEKVD_PATH's tree), ``var/sparsekvd.sock`` is the socket of a
daemon this test starts. The one thing rewritten is the Redis port (``-p 6380``, the embedded
configuration's), to the daemon's own. Each block must exit 0 and print what it promises."""

import os
import re
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "python"))
from daemon_process import Daemon  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def tour_blocks():
    text = open(os.path.join(ROOT, "README.md")).read()
    m = re.search(r"<!-- tour:begin -->(.*?)<!-- tour:end -->", text, re.S)
    assert m, "README.md has no tour"
    return re.findall(r"```sh\n(.*?)```", m.group(1), re.S)


def test_the_tour_has_the_promised_steps():
    blocks = tour_blocks()
    joined = "\n".join(blocks)
    for needle in ("sparsekv plan", "redis-cli", "import sparsekv", "sparsekv.sglang", "stress suspend"):
        assert needle in joined, needle


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    d = Daemon(resp=True)
    scratch = tmp_path_factory.mktemp("tour")
    build = os.path.dirname(os.path.dirname(os.path.abspath(os.environ.get("SPARSEKVD_PATH", "build/release/api/sparsekvd"))))
    os.makedirs(scratch / "build")
    os.symlink(build, scratch / "build" / "release")
    os.makedirs(scratch / "var")
    os.symlink(d.unix_path, scratch / "var" / "sparsekvd.sock")
    yield scratch, d
    assert d.stop() == 0


def run(block, root, daemon):
    block = block.replace("-p 6380", f"-p {daemon.resp_port}")
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the tour sets its own
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=root, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, f"{block}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return r.stdout


def test_every_tour_command_works_as_written(root):
    scratch, daemon = root
    outputs = [run(b, scratch, daemon) for b in tour_blocks()]
    out = "\n".join(outputs)
    assert "bytes" in out or "GiB" in out  # the planner's answer
    assert "hello from redis-cli" in out
    assert "hello from python" in out
    assert "SparseKVStorage" in out
    assert "OK" in out.splitlines()[-1] or "\nOK" in out


def test_every_link_of_the_readme_resolves():
    text = open(os.path.join(ROOT, "README.md")).read()
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert links, "the README links into the manual"
    for link in links:
        if "://" in link:
            continue
        assert os.path.exists(os.path.join(ROOT, link)), link


def test_the_readme_stays_short():
    assert len(open(os.path.join(ROOT, "README.md")).read().splitlines()) <= 200
