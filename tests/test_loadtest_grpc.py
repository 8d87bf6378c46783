"""ffn-loadtest --protocol grpc and grpc-stream against a real ffn-serve: the same reports, statuses read as HTTP's."""

from __future__ import annotations

import asyncio
import json

import pytest

from ffn_client.loadtest import LoadConfig, main, run_load
from ffn_testing import ServerProcess, free_port, start_server
from tests.slow_model import slow_model_config


def adds_up(counts: dict) -> bool:
    return counts["sent"] == counts["ok"] + sum(counts["errors"].values())


@pytest.mark.parametrize("protocol", ["grpc", "grpc-stream"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_every_dtype_on_both_grpc_protocols(demo_server: ServerProcess, protocol: str, dtype: str) -> None:
    config = LoadConfig(
        url=f"grpc://{demo_server.grpc_target}",
        protocol=protocol,
        requests=40,
        concurrency=8,
        dtype=dtype,
        metrics_url=demo_server.url + "/metrics",
    )
    report = asyncio.run(run_load(config))
    assert (report.sent, report.ok, report.errors) == (40, 40, {})
    assert report.config["d_model"] == 512 and report.config["engine"] == protocol  # d_model from ModelMetadata
    assert report.server is not None  # the breakdown, from the HTTP port's /metrics


def test_the_cli_sweeps_over_grpc_and_writes_csv(demo_server: ServerProcess, tmp_path, capsys) -> None:
    csv = tmp_path / "sweep.csv"
    args = ["--protocol", "grpc", "--url", f"grpc://{demo_server.grpc_target}", "--metrics-url", ""]
    code = main([*args, "--concurrency-range", "1:4:x2", "-n", "30", "-q", "--csv", str(csv), "--max-p99-ms", "60000"])
    assert code == 0
    lines = csv.read_text().splitlines()
    assert len(lines) == 1 + 3  # a header and c=1, 2, 4


@pytest.mark.parametrize("protocol", ["grpc", "grpc-stream"])
def test_grpc_errors_are_counted_as_their_http_statuses(demo_server: ServerProcess, protocol: str, capsys) -> None:
    args = ["--protocol", protocol, "--url", f"grpc://{demo_server.grpc_target}", "--metrics-url", ""]
    code = main([*args, "--model", "no-such-model", "--d-model", "512", "-n", "12", "-q", "--json", "-"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1
    assert report["counts"] == {"sent": 12, "ok": 0, "errors": {"404": 12}}
    assert report["error_causes"]["404"].startswith(("NOT_FOUND: model 'no-such-model'", "model 'no-such-model'"))


@pytest.mark.server
def test_overload_over_grpc_is_429_and_the_thresholds_apply(tmp_path, capsys) -> None:
    config = slow_model_config(tmp_path, "max_queue_rows = 64\nmax_batch_rows = 64\nwarmup = false")
    with start_server(config=config, env={"FFN_LOG_LEVEL": "warning"}) as server:
        args = ["--protocol", "grpc", "--url", f"grpc://{server.grpc_target}", "--model", "slow", "--metrics-url", ""]
        code = main([*args, "-c", "32", "--rows", "32", "-n", "200", "-q", "--json", "-", "--max-error-rate", "0"])
    report = json.loads(capsys.readouterr().out)
    assert adds_up(report["counts"]) and report["counts"]["ok"] > 0
    assert set(report["counts"]["errors"]) == {"429"}
    assert report["error_causes"]["429"].startswith("RESOURCE_EXHAUSTED: queue full for model 'slow'")
    assert code == 99  # the error-rate threshold broke


@pytest.mark.server
def test_a_refused_key_and_a_missing_server_say_what_happened(capsys) -> None:
    with start_server(env={"FFN_API_KEY": "k", "FFN_LOG_LEVEL": "warning"}) as server:
        assert main(["--protocol", "grpc", "--url", f"grpc://{server.grpc_target}", "-n", "3", "-q"]) == 1
        err = capsys.readouterr().err
        assert "UNAUTHENTICATED: missing API key" in err and "--api-key" in err
        assert (
            main(["--protocol", "grpc", "--url", f"grpc://{server.grpc_target}", "--api-key", "k", "-n", "3", "-q"])
            == 0
        )
    nobody = f"grpc://127.0.0.1:{free_port()}"
    assert main(["--protocol", "grpc", "--url", nobody, "-n", "3", "-q", "--timeout", "5"]) == 1
    assert "cannot reach" in capsys.readouterr().err


def test_a_grpc_url_must_be_grpc_host_port(capsys) -> None:
    assert main(["--protocol", "grpc", "--url", "http://127.0.0.1:8001", "-n", "1", "-q"]) == 2
    assert "url must be grpc://host:port" in capsys.readouterr().err
