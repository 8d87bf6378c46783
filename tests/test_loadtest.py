"""ffn-loadtest: short bounded runs against a real ffn-serve process, and its pieces on fakes."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json

import httpx
import numpy as np
import pytest

from ffn_client.loadtest import LoadConfig, main, run_load
from ffn_client.report import Samples, build_report, window_stats
from ffn_client.stub_server import StubAnswer, StubServer
from ffn_testing import free_port, start_server

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def adds_up(counts: dict) -> bool:
    return counts["sent"] == counts["ok"] + sum(counts["errors"].values())


def test_closed_loop_cli_writes_json_and_plot(demo_server, tmp_path):
    report_path, plot_path = tmp_path / "report.json", tmp_path / "latency.png"
    code = main(
        [
            "--url",
            demo_server.url,
            "--requests",
            "200",
            "--concurrency",
            "8",
            "--quiet",
            "--json",
            str(report_path),
            "--plot",
            str(plot_path),
        ]
    )
    assert code == 0
    report = json.loads(report_path.read_text())
    counts = report["counts"]
    assert adds_up(counts) and counts["sent"] == 200 and counts["ok"] > 0
    assert report["config"]["concurrency"] == 8 and "api_key" not in report["config"]
    latency = report["latency_ms"]
    assert 0 < latency["p50"] <= latency["p90"] <= latency["p99"] <= latency["p99.9"] <= latency["max"]
    assert report["rows_ok"] == 16 * counts["ok"]
    assert plot_path.read_bytes()[:8] == PNG_SIGNATURE


def test_open_loop_stops_at_its_duration(demo_server):
    config = LoadConfig(url=demo_server.url, rate=50.0, duration=1.5, requests=100_000, rows=(1, 64), encoding="json")
    report = asyncio.run(run_load(config))
    counts = report.to_dict()["counts"]
    assert adds_up(counts) and report.ok > 0
    assert report.sent < 100_000  # the duration, not the request budget, ended it
    assert report.config["rate"] == 50.0 and report.config["rows"] == "1-64"
    assert report.samples is not None and set(np.unique(report.samples.rows)) <= set(range(1, 65))


@pytest.mark.parametrize("engine", ["raw", "httpx"])
@pytest.mark.parametrize(("encoding", "dtype"), [("v2-binary", "bfloat16"), ("npy", "float16"), ("v2-json", "float32")])
def test_every_encoding_and_engine(demo_server, engine, encoding, dtype):
    config = LoadConfig(url=demo_server.url, requests=20, concurrency=4, encoding=encoding, dtype=dtype, engine=engine)
    report = asyncio.run(run_load(config))
    assert (report.sent, report.ok, report.errors) == (20, 20, {})


def test_warmup_requests_are_not_counted(demo_server):
    report = asyncio.run(run_load(LoadConfig(url=demo_server.url, requests=30, concurrency=2, warmup=0.3)))
    assert report.sent == 30 and adds_up(report.to_dict()["counts"])
    assert report.warmup_requests > 0
    assert report.samples is not None and (report.samples.start_s >= 0).all()


def test_errors_are_counted_by_status(demo_server, capsys):
    code = main(
        ["--url", demo_server.url, "--model", "no-such-model", "--d-model", "512", "-n", "25", "-q", "--json", "-"]
    )
    report = json.loads(capsys.readouterr().out)  # the table went to stderr: stdout is pure JSON
    assert code == 1  # nothing succeeded
    assert report["counts"] == {"sent": 25, "ok": 0, "errors": {"404": 25}}


def test_no_server_counts_connect_errors():
    config = LoadConfig(url=f"http://127.0.0.1:{free_port()}", requests=5, concurrency=2, d_model=8)
    report = asyncio.run(run_load(config))
    assert (report.sent, report.ok, report.errors) == (5, 0, {"connect": 5})


def test_unknown_model_without_d_model_fails_cleanly(demo_server, capsys):
    assert main(["--url", demo_server.url, "--model", "no-such-model", "-n", "5", "-q"]) == 1
    assert "cannot find d_model" in capsys.readouterr().err


def server_answer(url: str, path: str, key: str | None = None) -> str:
    """'HTTP <status> <error_type>: <error>', read here from the server's own JSON answer."""
    response = httpx.get(url + path, headers={"Authorization": f"Bearer {key}"} if key else {})
    body = response.json()
    return f"HTTP {response.status_code} {body['error_type']}: {body['error']}"


@pytest.fixture(scope="module")
def keyed_server():
    with start_server(env={"FFN_API_KEY": "the-key", "FFN_WARMUP": "false", "FFN_LOG_LEVEL": "warning"}) as server:
        yield server


@pytest.mark.parametrize("key", [None, "a-wrong-key"])
def test_a_refused_key_says_what_the_server_answered(keyed_server, capsys, key):
    args = ["--url", keyed_server.url, "-n", "5", "-q"] + (["--api-key", key] if key else [])
    assert main(args) == 1
    answered = server_answer(keyed_server.url, "/v1/models", key)
    assert answered.startswith("HTTP 401 unauthorized: ")
    assert capsys.readouterr().err == (
        f"ffn-loadtest: error: cannot find d_model of model 'demo' at {keyed_server.url}: the server answered "
        f"{answered}; pass its key with --api-key (or FFN_API_KEY)\n"
    )


def test_a_misspelt_model_says_what_the_server_answered_and_what_it_serves(keyed_server, capsys):
    assert main(["--url", keyed_server.url, "--api-key", "the-key", "--model", "dmeo", "-n", "5", "-q"]) == 1
    answered = server_answer(keyed_server.url, "/v2/models/dmeo", "the-key")
    assert answered.startswith("HTTP 404 model_not_found: ")
    err = capsys.readouterr().err
    assert err == (
        f"ffn-loadtest: error: cannot find d_model of model 'dmeo' at {keyed_server.url}: the server answered "
        f"{answered}; it serves 'demo': pass one with --model\n"
    )
    assert "--d-model" not in err


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"ffn-loadtest {importlib.metadata.version('ffn-serve')}\n"


def test_bad_arguments():
    assert main(["--rows", "5", "--concurrency", "0"]) == 2
    with pytest.raises(SystemExit):
        main(["--rows", "9-3"])
    with pytest.raises(ValueError, match="carries"):
        LoadConfig(encoding="json", dtype="float16")
    assert LoadConfig().duration == 10.0  # neither bound given: a default duration


def test_retry_after_is_not_retried_but_counted():
    """The tester measures the server as it is: a 429 is one failed request, not a retry."""

    def respond(request):
        return StubAnswer(429, {"retry-after": "1"}, b'{"error": "full", "error_type": "overloaded"}')

    with StubServer(respond).in_thread() as stub:
        report = asyncio.run(run_load(LoadConfig(url=stub.url, requests=12, concurrency=3, d_model=8)))
    assert (report.sent, report.ok, report.errors) == (12, 0, {"429": 12})


def test_raw_sender_replaces_connections_the_server_closed():
    """A server may close a kept-alive connection unannounced (idle timeout): not a failed request."""

    def respond(request):
        return StubAnswer(200, {"content-type": "application/octet-stream"}, b"ok", close=True)

    with StubServer(respond).in_thread() as stub:
        report = asyncio.run(run_load(LoadConfig(url=stub.url, requests=40, concurrency=4, d_model=8)))
    assert (report.sent, report.ok, report.errors) == (40, 40, {})


def test_report_statistics():
    samples = Samples(
        start_s=np.array([0.1, 0.5, 1.2, 1.9, 2.5]),
        latency_s=np.array([0.010, 0.020, 0.030, 0.040, 0.5]),
        status=np.array([200, 200, 200, 429, -1]),
        rows=np.array([1, 2, 3, 4, 5]),
        sent_s=np.array([0.1, 0.5, 1.2, 1.9, 2.5]),
    )
    report = build_report({"rate": None}, samples, duration_s=3.0)
    assert (report.sent, report.ok, report.rows_ok) == (5, 3, 6)
    assert report.errors == {"timeout": 1, "429": 1}
    assert report.latency_ms["max"] == pytest.approx(30.0) and report.latency_ms["p50"] == pytest.approx(20.0)
    assert report.requests_per_s == pytest.approx(1.0)
    windows = window_stats(samples)
    np.testing.assert_array_equal(windows["t"], [0.0, 1.0, 2.0])
    np.testing.assert_array_equal(windows["rps"], [2.0, 1.0, 0.0])
