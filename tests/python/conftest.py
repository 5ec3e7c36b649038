"""Fixtures for the Python module's tests: a real sparsekvd child (SPARSEKVD_PATH, set by ctest)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "python"))

from daemon_process import Daemon  # noqa: E402


@pytest.fixture(scope="module")
def daemon():
    d = Daemon(namespaces=(("alpha", "alpha-token"), ("beta", "beta-token")))
    yield d
    assert d.stop() == 0, "sparsekvd did not stop cleanly"
