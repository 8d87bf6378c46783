"""The logging extension (GET/POST /v2/logging): Triton's shape, checked input, and every worker applying it.

In-process: the answers and refusals, and that a change reaches this process's loggers. Against a
real server with two workers: a change answers from every worker (each answering connection's
worker is read from the JSON access log), and a worker killed and replaced logs the same way,
because the change is replayed to it. That server's first scrape also shows every per-model
series at 0 in multiprocess mode.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from collections.abc import Iterator

import httpx
import pytest

from app.config.settings import Settings
from app.observe.logs import LogSettings, apply_log_settings, configure_logging, current_log_settings
from app.protocol.errors import ERRORS
from ffn_testing import ServerProcess, start_server
from tests.worker_logs import pids_that_served, records, replaced, worker_pids

DEFAULT = {
    "log_file": "",
    "log_info": True,
    "log_warning": True,
    "log_error": True,
    "log_verbose_level": 0,
    "log_format": "text",
}


@pytest.fixture
def restored_logging() -> Iterator[None]:
    """The in-process app changes this process's logging: put it back afterwards."""
    root = logging.getLogger()
    saved = root.handlers, root.level, current_log_settings()
    yield
    apply_log_settings(saved[2])
    root.handlers, root.level = saved[0], saved[1]


async def test_get_and_post_in_tritons_shape(start_app, restored_logging: None) -> None:
    apply_log_settings(LogSettings())
    client = (await start_app(Settings(warmup=False))).client
    assert (await client.get("/v2/logging")).json() == DEFAULT
    r = await client.post("/v2/logging", json={"log_verbose_level": 1, "log_warning": False, "log_info": None})
    changed = {**DEFAULT, "log_verbose_level": 1, "log_warning": False}
    assert (r.status_code, r.json()) == (200, changed)  # every setting answered, only the named ones changed
    assert logging.getLogger().level == logging.DEBUG  # verbose: debug records reach the handler
    assert (await client.get("/v2/logging")).json() == changed
    assert (await client.post("/v2/logging", content=b"")).json() == changed  # an empty POST reads
    r = await client.post("/v2/logging", json={"log_verbose_level": 0, "log_info": False, "log_format": "json"})
    assert r.json() == {**changed, "log_verbose_level": 0, "log_info": False, "log_format": "json"}
    assert logging.getLogger().level == logging.ERROR  # info and warning off: the lowest is error
    assert "logging" in (await client.get("/v2")).json()["extensions"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"log_file": "/tmp/ffn.log"}, "log_file cannot be changed"),
        ({"log_info": "true"}, "'log_info' must be a boolean"),
        ({"log_error": 1}, "'log_error' must be a boolean"),
        ({"log_verbose_level": -1}, "'log_verbose_level' must be an integer in [0,"),
        ({"log_verbose_level": 1.5}, "'log_verbose_level' must be an integer"),
        ({"log_verbose_level": 2**32}, "'log_verbose_level' must be an integer in [0,"),
        ({"log_format": "ISO8601"}, "log_format must be one of ['text', 'json']"),
        ({"log_warnings": True}, "unknown log setting 'log_warnings'"),
        ([1, 2], "must be a JSON object, got an array"),
    ],
)
async def test_a_bad_setting_is_400_and_changes_nothing(start_app, restored_logging, body, message) -> None:
    apply_log_settings(LogSettings())
    client = (await start_app(Settings(warmup=False))).client
    r = await client.post("/v2/logging", json=body)
    assert r.status_code == 400 and r.json()["error_type"] == "invalid_input"
    assert message in r.json()["error"]
    assert (await client.get("/v2/logging")).json() == DEFAULT


async def test_a_large_or_malformed_body_is_refused(start_app, restored_logging) -> None:
    client = (await start_app(Settings(warmup=False))).client
    r = await client.post("/v2/logging", content=b"{" + b" " * 8192 + b"}")
    assert (r.status_code, r.json()["error_type"]) == (413, "payload_too_large")
    r = await client.post("/v2/logging", content=b'{"log_info": tru')
    assert (r.status_code, r.json()["error_type"]) == (400, "invalid_input")


def test_each_severity_switches_on_and_off_alone(restored_logging: None, capsys: pytest.CaptureFixture) -> None:
    configure_logging("info", "text")
    logger = logging.getLogger("ffn_serve.test")
    apply_log_settings(LogSettings(info=False, warning=True, error=False, verbose_level=1))
    for level in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL):
        logger.log(level, "record at %s", logging.getLevelName(level))
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" ")[2] for line in lines] == ["DEBUG", "WARNING", "CRITICAL"]
    apply_log_settings(LogSettings(format="json"))
    logger.info("as json")
    assert json.loads(capsys.readouterr().err)["message"] == "as json"


# ----- two workers ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_workers() -> Iterator[ServerProcess]:
    env = {"FFN_WORKERS": "2", "FFN_LOG_FORMAT": "json", "FFN_ACCESS_LOG": "true", "FFN_TORCH_THREADS": "1"}
    with start_server(env=env, ready_timeout=180) as server:
        yield server


def settings_from_every_worker(server: ServerProcess, workers: set[int], expected: dict) -> None:
    """GET /v2/logging on new connections until each of `workers` (pids) has answered; every answer is `expected`."""
    since = len(server.logs())
    for _ in range(400):
        r = httpx.get(f"{server.url}/v2/logging", headers={"Connection": "close"})
        assert (r.status_code, r.json()) == (200, expected)
        if workers <= pids_that_served(server, "/v2/logging", since):
            return
    pytest.fail(f"workers {workers} did not all answer; served by {pids_that_served(server, '/v2/logging', since)}")


@pytest.mark.server
def test_a_fresh_two_worker_server_has_every_outcome_at_zero(two_workers: ServerProcess) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    page = httpx.get(f"{two_workers.url}/metrics").text  # before any request but the readiness probes
    outcomes = {
        sample.labels["outcome"]: sample.value
        for family in text_string_to_metric_families(page)
        for sample in family.samples
        if sample.name == "ffn_requests_total" and sample.labels["model"] == "demo"
    }
    assert outcomes == dict.fromkeys({"ok", "internal"} | {kind.error_type for kind in ERRORS.values()}, 0.0)


@pytest.mark.server
def test_a_change_reaches_every_worker_and_a_replacement(two_workers: ServerProcess) -> None:
    server = two_workers
    pids = worker_pids(server)
    assert len(pids) == 2
    change = {"log_verbose_level": 1, "log_warning": False}
    r = httpx.post(f"{server.url}/v2/logging", json=change)
    expected = {**DEFAULT, **change, "log_format": "json"}  # the server started with FFN_LOG_FORMAT=json
    assert (r.status_code, r.json()) == (200, expected)
    settings_from_every_worker(server, set(pids.values()), expected)

    since = len(server.logs())
    os.kill(pids[1], signal.SIGKILL)
    replacement = replaced(server, 1, pids[1], since)
    # The change was replayed to it before it took traffic: it logged the new settings, and answers them.
    applied = [
        r for r in records(server, since) if r.get("pid") == replacement and r["message"].startswith("log settings now")
    ]
    assert len(applied) == 1 and "'log_verbose_level': 1" in applied[0]["message"]
    settings_from_every_worker(server, {replacement, pids[2]}, expected)
