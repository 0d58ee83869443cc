"""benchmarks/step_ab.py end to end on the tiny preset: a real `git archive` of HEAD, both trees
built in one process, the same logits; and a ref that is not one refused by name."""

from __future__ import annotations

import subprocess
import sys

from tests.engines import ROOT

SCRIPT = str(ROOT / "benchmarks" / "step_ab.py")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_head_against_this_checkout_gives_the_same_logits_at_each_row_count() -> None:
    done = run("--against", "HEAD", "--model", "tiny", "--rows", "1,3", "--rounds", "3", "--context", "8")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("rows")]
    assert [line.split(":")[0].split() for line in lines] == [["rows", "1"], ["rows", "3"]]
    assert all("logits bit-identical" in line and "B / A median" in line for line in lines), done.stdout
    assert "A (HEAD): tiny in " in done.stdout and "B (this checkout): tiny in " in done.stdout


def test_a_ref_that_is_not_one_is_refused_by_name() -> None:
    done = run("--against", "no-such-ref-xyz", "--model", "tiny")
    assert done.returncode == 1
    assert "git archive of --against 'no-such-ref-xyz' failed" in done.stderr


def test_bad_counts_are_refused_by_name() -> None:
    done = run("--against", "HEAD", "--rows", "1,33")
    assert done.returncode == 2 and "--rows '1,33': each count must be 1..32" in done.stderr
    done = run("--against", "HEAD", "--context", "0")
    assert done.returncode == 2 and "--context 0: must be 1..2048" in done.stderr
