"""The shipped alerting rules (deploy/prometheus/alerts.yml) fire on the first failure, checked by promtool.

A real ffn-serve is scraped three times, a minute apart in promtool's time: fresh, still quiet,
then after one failure of each kind the rules watch. `promtool test rules` evaluates the rules on
exactly those samples. The control case feeds the same samples as they would look had each series
appeared only at its first failure (as ffn_model_loads_total{outcome="failed"} used to): then
increase() has one sample and nothing fires, which is why every series exists at 0 from the start.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from ffn_testing import start_server
from tests.model_files import write_ffn
from tests.promtool import ALERT_RULES, PROMTOOL, born_at_first_increase, input_series, run_rule_tests

pytestmark = [pytest.mark.server, pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed")]

WATCHED = ("ffn_model_loads_total", "nv_inference_request_failure")
D = 16


@pytest.fixture(scope="module")
def scrapes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """/metrics of a real server: fresh, quiet, then after one failed load of `m`, one of a made-up name
    and one failed request (more rows than the queue holds)."""
    folder = tmp_path_factory.mktemp("repository")
    write_ffn(folder / "m.safetensors", 1, d_model=D)
    (folder / "ffn.toml").write_text('[[models]]\nname = "m"\nweights = "m.safetensors"\n')
    env = {
        "FFN_LOG_LEVEL": "warning",
        "FFN_MODEL_CONTROL": "explicit",
        "FFN_MAX_BATCH_ROWS": "16",
        "FFN_MAX_QUEUE_ROWS": "64",
    }
    with start_server(env=env, config=folder / "ffn.toml") as server:
        pages = [httpx.get(f"{server.url}/metrics").text for _ in range(2)]
        missing = {"parameters": {"config": json.dumps({"weights": "gone.safetensors"})}}
        assert httpx.post(f"{server.url}/v2/repository/models/m/load", json=missing).status_code == 400
        assert httpx.post(f"{server.url}/v2/repository/models/made-up/load").status_code == 400
        too_many = np.zeros((65, D), np.float32)
        refused = httpx.post(
            f"{server.url}/v1/models/m/transform",
            content=too_many.tobytes(),
            headers={"content-type": "application/octet-stream", "x-shape": f"65,{D}"},
        )
        assert refused.status_code == 413, refused.text
        pages.append(httpx.get(f"{server.url}/metrics").text)
    yield pages


def alert(name: str, eval_time: str, *firing: dict[str, str]) -> dict[str, object]:
    """promtool's alert_rule_test: `name` fires at `eval_time` with each of `firing`'s labels (none: silent)."""
    (rule,) = [
        r
        for group in yaml.safe_load(ALERT_RULES.read_text())["groups"]
        for r in group["rules"]
        if r.get("alert") == name
    ]

    def annotations(labels: dict[str, str]) -> dict[str, str]:  # the rule's templates, filled in as Prometheus would
        text = dict(rule["annotations"])
        for label, value in labels.items():
            text = {key: v.replace(f"{{{{ $labels.{label} }}}}", value) for key, v in text.items()}
        return text

    return {
        "eval_time": eval_time,
        "alertname": name,
        "exp_alerts": [{"exp_labels": labels, "exp_annotations": annotations(labels)} for labels in firing],
    }


def test_the_rules_file_is_valid() -> None:
    assert PROMTOOL is not None
    checked = subprocess.run([PROMTOOL, "check", "rules", str(ALERT_RULES)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_a_failed_load_fires_at_its_first_failure(scrapes: list[str], tmp_path: Path) -> None:
    series = input_series(scrapes, WATCHED)
    failed_m = 'ffn_model_loads_total{model="m",outcome="failed"}'
    failed_other = 'ffn_model_loads_total{model="(other)",outcome="failed"}'
    assert {s["series"]: s["values"] for s in series if "failed" in s["series"]} == {
        failed_m: "0.0 0.0 1.0",
        failed_other: "0.0 0.0 1.0",
    }
    warning = {"severity": "warning", "outcome": "failed"}
    as_served = {
        "interval": "1m",
        "input_series": series,
        "alert_rule_test": [
            alert("FfnModelLoadFailed", "1m"),  # nothing failed yet
            alert("FfnModelLoadFailed", "2m", {**warning, "model": "m"}, {**warning, "model": "(other)"}),
        ],
    }
    born_late = {  # the control: the same failures, had their series appeared only with them
        "interval": "1m",
        "input_series": born_at_first_increase(series),
        "alert_rule_test": [alert("FfnModelLoadFailed", "2m")],
    }
    result = run_rule_tests(tmp_path, [as_served, born_late])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_a_failed_request_fires_at_its_first_failure(scrapes: list[str], tmp_path: Path) -> None:
    series = input_series(scrapes, WATCHED)
    failures = {s["series"]: s["values"] for s in series if s["series"].startswith("nv_inference_request_failure")}
    assert failures == {'nv_inference_request_failure{model="m",version="1"}': "0.0 0.0 1.0"}
    firing = {"severity": "warning", "model": "m", "version": "1"}
    as_served = {
        "interval": "1m",
        "input_series": series,
        "alert_rule_test": [alert("FfnInferenceFailed", "1m"), alert("FfnInferenceFailed", "2m", firing)],
    }
    born_late = {
        "interval": "1m",
        "input_series": born_at_first_increase(series),
        "alert_rule_test": [alert("FfnInferenceFailed", "2m")],
    }
    result = run_rule_tests(tmp_path, [as_served, born_late])
    assert result.returncode == 0, result.stdout + result.stderr
