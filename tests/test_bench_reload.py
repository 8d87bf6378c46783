"""bench.reload, the reload-under-load benchmark: a short run of its command (so it cannot rot), and its guarantees."""

from __future__ import annotations

import re

import pytest

from bench import reload

pytestmark = pytest.mark.server  # every test here starts a real ffn-serve


def test_a_short_run_prints_both_tables_with_no_failed_request_or_reload(capsys: pytest.CaptureFixture[str]) -> None:
    small = ["--d-model", "16", "--d-ff", "32", "--max-batch-rows", "16", "--concurrency", "4", "--rows", "4"]
    assert reload.main(["--workers", "1", "--seconds", "2", "--interval", "0.5", "--repeats", "1", *small]) == 0
    out = capsys.readouterr().out
    phases = re.findall(r"^\| 1, (no reloads|reloading: all) \| (\d+) \| (\d+) \|", out, re.MULTILINE)
    assert [(phase, int(failed)) for phase, _, failed in phases] == [("no reloads", 0), ("reloading: all", 0)]
    assert all(int(sent) > 0 for _, sent, _ in phases)
    assert "| 1, reloading: during a load |" in out
    (reloads,) = re.findall(r"^\| 1 \| (\d+) \| (\d+) \|", out, re.MULTILINE)
    assert int(reloads[0]) >= 1 and reloads[1] == "0"
