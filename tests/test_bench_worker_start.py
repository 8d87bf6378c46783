"""bench/worker_start.py: a quick run prints its reference and one row of readings that make sense."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.server  # the bench starts ffn-serve processes

REPO = Path(__file__).resolve().parents[1]


def test_a_quick_run_prints_the_fresh_import_and_a_row_for_two_workers() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.worker_start", "--workers", "2", "--repeats", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    fresh = re.search(r"`import app\.process\.server, app\.engine\.service`: ([\d.]+) CPU s", run.stdout)
    assert fresh is not None and float(fresh.group(1)) > 0, run.stdout
    (row,) = [line for line in run.stdout.splitlines() if line.startswith("| 2 |")]
    ready, cpu, replacement, ratio, pss, dirty = (float(cell) for cell in row.strip("| ").split(" | ")[1:])
    assert ready > 0 and cpu > 0 and replacement > 0 and pss > 0 and dirty > 0
    assert ratio == pytest.approx(replacement / float(fresh.group(1)), abs=0.01)
    # Both workers and their fork server are in the tree, and no worker holds a tree's worth alone.
    assert dirty < pss
