"""promtool, Prometheus's own checker: alerting rules unit-tested on series scraped from a real server.

`input_series(pages, names)` turns consecutive scrapes (one per `interval`) into promtool's
`input_series`: a series missing from a scrape is `_` there, as Prometheus would have no sample
for it. `run_rule_tests` writes promtool's test file and runs `promtool test rules` on it. Both need
the `promtool` binary (Debian's `prometheus` package); tests skip without it (`PROMTOOL`).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from tests.exposition import samples_as_written

PROMTOOL = shutil.which("promtool")
ROOT = Path(__file__).resolve().parent.parent
ALERT_RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"


def _selector(name: str, labels: Mapping[str, str]) -> str:
    inside = ",".join(f'{key}="{_escape(value)}"' for key, value in sorted(labels.items()))
    return f"{name}{{{inside}}}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def input_series(pages: list[str], names: Iterable[str]) -> list[dict[str, str]]:
    """Every sample named in `names`, across the scrapes `pages` in order, as promtool's input_series."""
    wanted = set(names)
    values: dict[str, list[str]] = {}
    for index, page in enumerate(pages):
        for name, labels, value in samples_as_written(page):
            if name in wanted:
                series = values.setdefault(_selector(name, labels), ["_"] * len(pages))
                series[index] = repr(value)
    return [{"series": series, "values": " ".join(v)} for series, v in sorted(values.items())]


def born_at_first_increase(series: list[dict[str, str]]) -> list[dict[str, str]]:
    """The same series as they would be scraped had they appeared only at their first non-zero value."""
    changed = []
    for entry in series:
        values = entry["values"].split()
        first = next((i for i, v in enumerate(values) if v not in ("_", "0.0")), len(values))
        changed.append({**entry, "values": " ".join(["_"] * first + values[first:])})
    return changed


def run_rule_tests(
    folder: Path, tests: list[dict[str, Any]], rule_file: Path = ALERT_RULES
) -> subprocess.CompletedProcess[str]:
    """Run `promtool test rules` on `tests` (promtool's test groups) against `rule_file`."""
    assert PROMTOOL is not None, "promtool is not installed (apt-get install prometheus)"
    path = folder / "rules_test.yml"
    path.write_text(yaml.safe_dump({"rule_files": [str(rule_file)], "evaluation_interval": "1m", "tests": tests}))
    return subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, timeout=120)
