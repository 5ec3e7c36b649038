"""docs/reference/cli.md is the programs' own --help (issue 37): regenerated from the binaries
under test and compared, so a new option or subcommand without a regenerated page fails."""

import os
import subprocess

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
SCRIPT = os.path.join(ROOT, "scripts", "cli_reference.py")


def bin_dir():
    return os.path.dirname(os.environ["SPARSEKVD_PATH"])


def test_cli_reference_matches_the_programs_help():
    r = subprocess.run(["/usr/bin/python3", SCRIPT, "--check", "--bin-dir", bin_dir()], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_every_subcommand_has_a_section():
    text = open(os.path.join(ROOT, "docs", "reference", "cli.md")).read()
    top = subprocess.run([os.path.join(bin_dir(), "sparsekv"), "--help"], capture_output=True, text=True, check=True).stdout
    listed = [line.split()[0] for line in top.split("Subcommands:")[1].splitlines() if line.startswith("  ")]
    assert len(listed) >= 10
    for name in listed:
        assert "## `sparsekv " + name + "`" in text, name
