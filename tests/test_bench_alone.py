"""bench.alone: a short run (so the command cannot rot) prints both tables, with the server's
timings nested as the request's stages are."""

from __future__ import annotations

import re
import shutil

import pytest

from bench import alone

pytestmark = [pytest.mark.server, pytest.mark.skipif(not shutil.which("wrk"), reason="needs wrk")]


def test_a_short_run_prints_the_model_and_both_servers(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--d-model", "64", "--d-ff", "256", "--rounds", "1", "--seconds", "1", "--calls", "20"]
    assert alone.main(args) == 0
    text = capsys.readouterr().out
    cells = {
        label: [float(ms) for ms in re.findall(r"(\d+\.\d+) \(", rest)]
        for label, rest in re.findall(r"^\| ([a-z0-9 :]+) \|(.*)$", text, flags=re.MULTILINE)
        if re.search(r"\d\.\d", rest)  # not a header
    }
    assert set(cells) == {
        "weights in cache",
        "weights evicted",
        "client p50",
        "server: whole request",
        "server: queued and computed",
        "server: compute",
    }
    assert all(len(values) == (1 if label.startswith("weights") else 2) for label, values in cells.items())
    assert all(ms > 0 for values in cells.values() for ms in values)
    for server in range(2):  # model thread, inline: each stage within the one around it
        compute, queued, whole = (
            cells[label][server]
            for label in ("server: compute", "server: queued and computed", "server: whole request")
        )
        assert compute <= queued <= whole, (compute, queued, whole)
