"""bench.handoff: its --quick run (so the command cannot rot) measures both ways in every cell."""

from __future__ import annotations

import re

import pytest

from bench import handoff

pytestmark = pytest.mark.server


def test_a_quick_run_measures_the_engine_in_process_and_behind_the_hand_off(capsys: pytest.CaptureFixture[str]) -> None:
    assert handoff.main(["--quick", "--d-ff", "8"]) == 0
    rows = re.findall(r"^\| (\d+) \| (\d+) \|(.*)\|$", capsys.readouterr().out, flags=re.MULTILINE)
    assert [(r, c) for r, c, _ in rows] == [("1", "1"), ("1", "4")]
    for _, _, rest in rows:
        in_rps, off_rps, in_cpu, engine_cpu, difference, front_cpu = (
            float(cell.replace(",", "")) for cell in rest.split("|")
        )
        assert in_rps > 0 and off_rps > 0 and in_cpu > 0 and engine_cpu > 0 and front_cpu > 0
        assert difference == pytest.approx(engine_cpu - in_cpu, abs=0.15)  # the column is their difference
