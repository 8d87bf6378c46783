"""ffn-loadtest sweeps, thresholds, the offered-rate check and the server breakdown, on real servers."""

from __future__ import annotations

import asyncio
import csv
import json
import re
import time

import numpy as np
import pytest

from ffn_client.load import LoadConfig, run_load
from ffn_client.loadtest import main
from ffn_client.report import OfferedLoad, Report, Samples, Thresholds, build_report
from ffn_client.stub_server import StubAnswer, StubServer, echo
from ffn_client.sweep import parse_range

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("text", "integer", "values"),
    [
        ("1:64:x2", True, [1, 2, 4, 8, 16, 32, 64]),
        ("1:50:x2", True, [1, 2, 4, 8, 16, 32]),  # END is a bound, not a step
        ("1:10:3", True, [1, 4, 7, 10]),
        ("1:4", True, [1, 2, 3, 4]),  # perf_analyzer's default step, 1
        ("8", True, [8]),
        ("1:8:x1.5", True, [1, 2, 3, 5, 8]),  # 1.5 and 2.25 round to 2: once
        ("100:500:100", False, [100, 200, 300, 400, 500]),
        ("0.5:2:x2", False, [0.5, 1.0, 2.0]),
        ("0.1:0.3:0.1", False, [0.1, 0.2, 0.30000000000000004]),
    ],
)
def test_parse_range(text, integer, values):
    assert parse_range(text, integer=integer) == pytest.approx(values)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0:4", "0 < START <= END"),
        ("4:1", "0 < START <= END"),
        ("1:4:x1", "FACTOR > 1"),
        ("1:4:0", "STEP must be"),
        ("a:b", "must be an integer"),
        ("1:100000:1", "more than 64 steps"),
        ("1:2:3:4", "START"),
        ("1::2", "START"),
    ],
)
def test_parse_range_refuses_with_the_reason(text, message):
    with pytest.raises(ValueError, match=message):
        parse_range(text, integer=True)


def test_concurrency_sweep_writes_one_row_per_step_and_the_servers_own_counts(demo_server, tmp_path, capsys):
    """Each step's server breakdown counts exactly the step's requests: /metrics is read before and after."""
    paths = {name: tmp_path / name for name in ("sweep.csv", "sweep.png", "sweep.json")}
    code = main(
        [
            "--url",
            demo_server.url,
            "--concurrency-range",
            "1:4:x2",
            "--requests",
            "40",
            "--rows",
            "3",
            "-q",
            "--csv",
            str(paths["sweep.csv"]),
            "--plot",
            str(paths["sweep.png"]),
            "--json",
            str(paths["sweep.json"]),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "ffn-loadtest sweep" in out
    rows = list(csv.DictReader(paths["sweep.csv"].open()))
    assert [(r["mode"], r["concurrency"], r["sent"], r["ok"], r["errors"]) for r in rows] == [
        ("closed", str(c), "40", "40", "0") for c in (1, 2, 4)
    ]
    steps = json.loads(paths["sweep.json"].read_text())["steps"]
    for step in steps:
        server = step["server"]
        # The server saw each request once (queue, total) and 3 rows each, in however many batches.
        assert server["queue"]["count"] == server["total"]["count"] == 40
        assert 1 <= server["compute_per_batch"]["count"] <= 40
        assert server["rows_per_batch"] * server["compute_per_batch"]["count"] == pytest.approx(
            3 * 40, abs=0.01
        )  # JSON rounds to 4 places
        assert server["total"]["mean_ms"] > 0 and step["breaches"] == [] and step["warnings"] == []
        assert float(rows[steps.index(step)]["server_total_mean_ms"]) == pytest.approx(
            server["total"]["mean_ms"], rel=1e-3
        )
    assert paths["sweep.png"].read_bytes()[:8] == PNG_SIGNATURE


def test_thresholds_set_the_exit_status(demo_server, capsys):
    common = ["--url", demo_server.url, "--requests", "30", "--concurrency", "2", "-q", "--json", "-"]
    assert main([*common, "--max-p99-ms", "0.001", "--max-error-rate", "0"]) == 99
    report = json.loads(capsys.readouterr().out)
    [breach] = report["breaches"]
    said = re.fullmatch(r"p99 (\d+\.\d\d) ms > --max-p99-ms 0\.001", breach)
    assert said, breach  # the JSON's p99 is itself rounded: the two roundings may differ in the last place
    assert float(said[1]) == pytest.approx(report["latency_ms"]["p99"], abs=0.011)
    assert main([*common, "--max-p99-ms", "60000", "--max-error-rate", "0%"]) == 0
    assert json.loads(capsys.readouterr().out)["breaches"] == []


def every_fourth_is_429():
    count = 0

    def respond(request):
        nonlocal count
        if request.method != "POST":
            return echo(request)
        count += 1
        return (
            StubAnswer(429, {"retry-after": "1"}, b'{"error": "queue full", "error_type": "overloaded"}')
            if count % 4 == 0
            else echo(request)
        )

    return respond


@pytest.mark.parametrize(("limit", "code"), [("10%", 99), ("0.3", 0)])
def test_error_rate_threshold(limit, code, capsys):
    with StubServer(every_fourth_is_429()).in_thread() as stub:
        assert (
            main(["--url", stub.url, "-n", "40", "-c", "1", "-q", "--max-error-rate", limit, "--metrics-url", ""])
            == code
        )
    out = capsys.readouterr().out
    assert "429 x10: HTTP 429 overloaded: queue full" in out  # the count and the server's own reason
    assert ("threshold broken: error rate 25.00% > --max-error-rate 10.00%" in out) == (code == 99)


def slow(request):
    """A server that answers one POST at a time, each after 50 ms: about 20 requests/s."""
    if request.method == "POST":
        time.sleep(0.05)
    return echo(request)


def test_open_loop_warns_when_the_rate_was_not_offered():
    with StubServer(slow).in_thread() as stub:
        config = LoadConfig(
            url=stub.url, rate=200.0, concurrency=2, duration=0.25, d_model=4, metrics_url="", timeout=60
        )  # 50 requests: 2.5 s at the stub's 20/s
        report = asyncio.run(run_load(config))
    offered = report.offered
    assert offered is not None and not offered.reached
    # 200/s asked of a server that answers at most ~20/s on 2 connections: most requests waited.
    assert offered.offered_rps < 100 and offered.waited_for_connection > offered.scheduled / 2
    assert report.sent == offered.scheduled and report.ok == report.sent  # late, not lost
    [warning] = report.warnings()
    assert warning.startswith("asked for 200 req/s but offered") and "connections busy" in warning


def test_offered_load_counts_what_went_out_in_the_window():
    """The check itself, on samples made by hand: 100 scheduled over 1 s, sent with a lag."""

    def offered(lag_s):
        start = np.linspace(0.0, 0.99, 100)
        samples = Samples(start, np.full(100, 0.01), np.full(100, 200), np.ones(100, int), start + lag_s)
        sent_in_window = int((samples.sent_s <= 1.0 + 0.02).sum())
        return OfferedLoad(100.0, 1.0, 100, sent_in_window, 0, 1000 * float(np.max(lag_s)))

    assert offered(np.zeros(100)).reached
    assert offered(np.where(np.arange(100) >= 96, 0.5, 0.0)).reached  # 4 late of 100: within 5 %
    late = offered(np.where(np.arange(100) >= 90, 0.5, 0.0))
    assert not late.reached and late.offered_rps == pytest.approx(90.0)


def test_threshold_on_no_success_and_nan_p99():
    samples = Samples(np.zeros(3), np.full(3, 0.1), np.array([503, 503, 503]), np.ones(3, int), np.zeros(3))
    report = build_report({}, samples, 1.0)
    assert Thresholds(max_p99_ms=1e9).breaches(report) == ["p99 nan ms > --max-p99-ms 1e+09"]
    assert Thresholds(max_error_rate=1.0).breaches(report) == []
    assert isinstance(report, Report) and report.error_rate == 1.0


def test_metrics_that_cannot_be_read_are_a_note_not_a_failure():
    with StubServer(
        lambda r: (
            StubAnswer(404, {}, b'{"error": "no such page", "error_type": "not_found"}')
            if r.path == "/metrics"
            else echo(r)
        )
    ).in_thread() as stub:
        report = asyncio.run(run_load(LoadConfig(url=stub.url, requests=5, d_model=4)))
    assert report.ok == 5 and report.server is None
    assert report.server_note == f"GET {stub.url}/metrics: HTTP 404 not_found: no such page"


def test_errors_carry_their_causes(demo_server, capsys):
    assert main(["--url", demo_server.url, "--model", "no-such-model", "--d-model", "512", "-n", "5", "-q"]) == 1
    out = capsys.readouterr()
    assert "404 x5: HTTP 404 model_not_found: model 'no-such-model'" in out.out
    assert "no request was answered 200" in out.err


@pytest.mark.parametrize("flag", ["--csv", "--json"])
def test_an_output_file_that_cannot_be_written_is_exit_2_with_the_reason(demo_server, tmp_path, capsys, flag):
    target = tmp_path / "missing-folder" / "out"
    assert main(["--url", demo_server.url, "-n", "5", "-q", flag, str(target)]) == 2
    assert (
        f"cannot write the report: FileNotFoundError: [Errno 2] No such file or directory: '{target}'"
        in capsys.readouterr().err
    )


@pytest.mark.parametrize("url", ["localhost:8000", "ftp://host", "http://"])
def test_a_url_that_is_no_http_url_is_exit_2_with_the_reason(url, capsys):
    assert main(["--url", url, "--d-model", "4", "-n", "1", "-q"]) == 2
    assert f"url must be http(s)://host[:port][/prefix], got {url!r}" in capsys.readouterr().err


def test_sweep_flags_that_contradict_each_other_are_refused(capsys):
    for argv in (
        ["--concurrency-range", "1:4", "--rate", "5"],
        ["--rate", "5", "--rate-range", "1:2"],
        ["--concurrency", "2", "--concurrency-range", "1:4"],
        ["--max-error-rate", "150%"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
    assert "error rate is between 0 and 1" in capsys.readouterr().err
