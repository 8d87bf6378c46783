"""Triton's metric names on /metrics: nv_inference_* per model and version, nv_gpu_* per GPU.

The counts are checked against what each test sent (requests, rows, one refused request), the
times against the ffn_* samples they are read from and against the V2 statistics extension; the
GPU series from readings injected into the real renderer (no GPU here), read back by perf_analyzer's
own `--collect-metrics` parser; promtool lints the page. Exact across workers: tests/test_workers.py.
"""

from __future__ import annotations

import http.server
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from app.config.settings import ModelSpec, Settings, load_settings
from app.observe.collectors import GpuReading, _from_nvml, read_gpus
from app.observe.triton_metrics import INFERENCE_SERIES, TritonNames
from ffn_testing import free_port, metric_value, start_server
from tests.exposition import samples_as_written, value_as_written
from tests.in_process import InProcessApp
from tests.model_files import write_ffn
from tests.promtool import PROMTOOL
from tests.wire import raw_headers

D_MODEL = 512
NAMES = [series.name for series in INFERENCE_SERIES]
REPO = Path(__file__).resolve().parent.parent


async def transform(app: InProcessApp, rows: int, model: str = "demo", d_model: int = D_MODEL) -> int:
    x = np.full((rows, d_model), 0.25, np.float32)
    response = await app.client.post(f"/v1/models/{model}/transform", content=x.tobytes(), headers=raw_headers(x.shape))
    return response.status_code


def triton(page: str, name: str, model: str = "demo", version: str = "1") -> float:
    return value_as_written(page, name, model=model, version=version)


async def test_each_series_counts_what_was_sent_and_agrees_with_the_statistics(start_app) -> None:
    app = await start_app(Settings(warmup=False, max_batch_rows=32, max_queue_rows=64))
    sent = [1, 3, 17]  # one after the other: each its own forward pass
    assert [await transform(app, rows) for rows in sent] == [200, 200, 200]
    assert await transform(app, 65) == 413  # more rows than the queue holds: refused at the batcher
    page = (await app.client.get("/metrics")).text

    assert triton(page, "nv_inference_request_success") == len(sent)
    assert triton(page, "nv_inference_request_failure") == 1
    assert triton(page, "nv_inference_count") == sum(sent)  # rows computed: a row is one inference
    assert triton(page, "nv_inference_exec_count") == len(sent)
    assert triton(page, "nv_inference_compute_input_duration_us") == 0
    assert triton(page, "nv_inference_compute_output_duration_us") == 0
    for name, sample in (
        ("nv_inference_request_duration_us", "ffn_request_seconds_sum"),
        ("nv_inference_queue_duration_us", "ffn_queue_seconds_sum"),
        ("nv_inference_compute_infer_duration_us", "ffn_request_compute_seconds_total"),
    ):
        seconds = metric_value(page, sample, model="demo")
        assert seconds > 0 and triton(page, name) == round(seconds * 1e6), name

    # The statistics extension (perf_analyzer's server side) reads the same samples.
    (stats,) = (await app.client.get("/v2/models/demo/stats")).json()["model_stats"]
    inference = stats["inference_stats"]
    assert triton(page, "nv_inference_request_success") == inference["success"]["count"]
    assert triton(page, "nv_inference_request_failure") == inference["fail"]["count"]
    assert triton(page, "nv_inference_count") == stats["inference_count"]
    assert triton(page, "nv_inference_exec_count") == stats["execution_count"]
    assert abs(triton(page, "nv_inference_queue_duration_us") - inference["queue"]["ns"] / 1000) <= 1
    assert abs(triton(page, "nv_inference_compute_infer_duration_us") - inference["compute_infer"]["ns"] / 1000) <= 1

    # Triton's exposition: counters named without _total, labelled model and version only.
    written = [(name, labels) for name, labels, _ in samples_as_written(page) if name.startswith("nv_")]
    assert written == [(name, {"model": "demo", "version": "1"}) for name in NAMES]  # no GPU here: no nv_gpu_*
    for name in NAMES:
        assert f"# TYPE {name} counter\n" in page


async def test_every_model_is_listed_at_zero_from_the_start(start_app) -> None:
    app = await start_app(Settings(warmup=False, models=[ModelSpec(name="a"), ModelSpec(name="b")]))
    page = (await app.client.get("/metrics")).text
    for model in ("a", "b"):
        assert [value_as_written(page, name, model=model, version="1") for name in NAMES] == [0.0] * len(NAMES)
        assert all(f'{name}{{model="{model}",version="1"}} 0\n' in page for name in NAMES)


async def test_the_version_label_follows_a_load_and_the_totals_go_on(start_app, tmp_path: Path) -> None:
    write_ffn(tmp_path / "m.safetensors", 1, d_model=16)
    (tmp_path / "ffn.toml").write_text('[[models]]\nname = "m"\nweights = "m.safetensors"\n')
    app = await start_app(load_settings(config=tmp_path / "ffn.toml", model_control="explicit", warmup=False))
    assert await transform(app, 2, "m", 16) == 200
    page = (await app.client.get("/metrics")).text
    assert triton(page, "nv_inference_request_success", "m", "1") == 1
    assert (await app.client.post("/v2/repository/models/m/load")).status_code == 200
    assert await transform(app, 3, "m", 16) == 200
    page = (await app.client.get("/metrics")).text
    assert triton(page, "nv_inference_request_success", "m", "2") == 2  # both requests, under the version now served
    assert triton(page, "nv_inference_count", "m", "2") == 5
    assert {labels["version"] for name, labels, _ in samples_as_written(page) if name in NAMES} == {"2"}


async def test_the_setting_turns_them_off(start_app) -> None:
    app = await start_app(Settings(warmup=False, triton_metrics=False))
    page = (await app.client.get("/metrics")).text
    assert "ffn_requests_total" in page and "nv_" not in page


# ----- GPUs, by injection ---------------------------------------------------------------------------

GPUS = [
    GpuReading("GPU-5f1f6c1e-90b8-2d4c-8d3a-0c2e3d4b5a61", 0.42, 3 * 2**30, 80 * 2**30, 123.5, "cuda:0"),
    GpuReading("GPU-a0b1c2d3-e4f5-0617-2839-4a5b6c7d8e9f", None, 2**30 + 7, 141 * 10**9, None, "cuda:1"),
]


def test_gpu_readings_are_written_as_triton_names_them() -> None:
    page = TritonNames(versions=lambda: {}, gpus=lambda: GPUS).render([])
    first, second = (gpu.uuid for gpu in GPUS)
    assert [line for line in page.splitlines() if "nv_gpu" in line] == [
        "# HELP nv_gpu_utilization GPU utilization, 0.0 to 1.0 (NVML's last sample period).",
        "# TYPE nv_gpu_utilization gauge",
        f'nv_gpu_utilization{{gpu_uuid="{first}"}} 0.42',  # the second GPU's NVML said nothing: no sample
        "# HELP nv_gpu_memory_total_bytes GPU memory of the device, in bytes.",
        "# TYPE nv_gpu_memory_total_bytes gauge",
        f'nv_gpu_memory_total_bytes{{gpu_uuid="{first}"}} 85899345920',  # digits, never 8.589934592e+10
        f'nv_gpu_memory_total_bytes{{gpu_uuid="{second}"}} 141000000000',
        "# HELP nv_gpu_memory_used_bytes GPU memory in use on the device by every process, in bytes.",
        "# TYPE nv_gpu_memory_used_bytes gauge",
        f'nv_gpu_memory_used_bytes{{gpu_uuid="{first}"}} 3221225472',
        f'nv_gpu_memory_used_bytes{{gpu_uuid="{second}"}} 1073741831',
        "# HELP nv_gpu_power_usage GPU power draw, in watts.",
        "# TYPE nv_gpu_power_usage gauge",
        f'nv_gpu_power_usage{{gpu_uuid="{first}"}} 123.5',
    ]
    assert "nv_gpu" not in TritonNames(versions=lambda: {}, gpus=lambda: []).render([])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only check")
def test_without_a_gpu_there_are_no_readings_and_nvml_gives_nothing() -> None:
    assert read_gpus() == []
    # torch reads NVML through nvidia-ml-py; with no driver it raises NVMLError, and the figure is left out.
    assert _from_nvml(torch.cuda.utilization, 0, 100.0) is None
    assert _from_nvml(lambda index: 4200.0, 0, 100.0) == 42.0


# ----- Prometheus's and Triton's own tools ---------------------------------------------------------


def promtool_problems(page: str) -> set[str]:
    """`promtool check metrics`'s complaints about `page`, one per line; it fails if the page does not parse."""
    assert PROMTOOL is not None
    checked = subprocess.run([PROMTOOL, "check", "metrics"], input=page, capture_output=True, text=True, timeout=60)
    assert checked.returncode in (0, 3), checked.stdout + checked.stderr  # 3: lint problems, the page parsed
    assert "error" not in (checked.stdout + checked.stderr).lower()
    return {line.strip() for line in (checked.stdout + checked.stderr).splitlines() if line.strip()}


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed")
async def test_promtool_finds_nothing_but_tritons_own_names(start_app) -> None:
    """promtool's lint wants counters to end in _total and no unit abbreviations: Triton's names break
    both, and must stay as Triton spells them (dashboards match them exactly). Nothing else is found:
    the ffn_* series are clean, and the page parses."""
    app = await start_app(Settings(warmup=False))
    assert await transform(app, 2) == 200
    page = (await app.client.get("/metrics")).text + TritonNames(versions=dict, gpus=lambda: GPUS).gpu_text()
    expected = {f'{name} counter metrics should have "_total" suffix' for name in NAMES}
    expected |= {f"{name} metric names should not contain abbreviated units" for name in NAMES if name.endswith("_us")}
    expected |= {
        f'{name} non-histogram and non-summary metrics should not have "_count" suffix'
        for name in ("nv_inference_count", "nv_inference_exec_count")
    }
    assert promtool_problems(page) == expected
    off = await start_app(Settings(warmup=False, triton_metrics=False))
    assert promtool_problems((await off.client.get("/metrics")).text) == set()  # the ffn_* series alone: clean


def perf_analyzer() -> list[str] | None:
    """perf_analyzer as bench.perf_analyzer runs it, if it is here already (the script fetches it otherwise)."""
    if shutil.which("perf_analyzer"):
        return ["perf_analyzer"]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "perf-analyzer"
    home = Path(os.environ.get("PERF_ANALYZER_HOME") or cache)
    ready = (home / "pa/perf_analyzer/bin/perf_analyzer").is_file()
    ready = ready and (home / "tx/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2").exists()
    return ["bash", str(REPO / "scripts" / "perf-analyzer.sh")] if ready else None


@pytest.fixture
def gpu_metrics_url() -> Iterator[tuple[str, list[str]]]:
    """A metrics URL answering what TritonNames writes for the GPUS readings, and what each request asked."""
    text = TritonNames(versions=dict, gpus=lambda: GPUS).gpu_text().encode()
    asked: list[str] = []

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(text)))
            self.end_headers()
            self.wfile.write(text)

        def log_message(self, *args: object) -> None:
            pass

    port = free_port()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}/metrics", asked
    finally:
        server.shutdown()
        thread.join()


def run_perf_analyzer(port: int, metrics_url: str, csv: Path) -> subprocess.CompletedProcess[str]:
    command = perf_analyzer()
    assert command is not None
    return subprocess.run(
        [
            *command,
            *("-m", "demo", "-u", f"127.0.0.1:{port}", "-i", "http"),
            *("--input-data", "zero", "--shape", f"input:1,{D_MODEL}", "--measurement-interval", "500"),
            *("--stability-percentage", "1000"),  # a shared, noisy host: any window is stable enough
            *("--collect-metrics", "--metrics-url", metrics_url, "--metrics-interval", "200"),
            *("-f", str(csv), "--verbose-csv"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.server
@pytest.mark.skipif(
    perf_analyzer() is None, reason="perf_analyzer is not here (bash scripts/perf-analyzer.sh fetches it)"
)
def test_perf_analyzer_collect_metrics_reads_the_gpu_series(
    gpu_metrics_url: tuple[str, list[str]], tmp_path: Path
) -> None:
    """perf_analyzer infers against a real server and reads nv_gpu_* (as this server writes them, for
    injected readings: there is no GPU here) with its own --collect-metrics parser; against the
    server's own /metrics (no GPU: no nv_gpu_*) it warns about each, and finishes."""
    url, asked = gpu_metrics_url
    with start_server(env={"FFN_LOG_LEVEL": "warning"}) as server:
        run = run_perf_analyzer(server.port, url, tmp_path / "pa.csv")
        served = value_as_written(httpx.get(server.url + "/metrics").text, "nv_inference_request_success")
        cpu_only = run_perf_analyzer(server.port, f"{server.url}/metrics", tmp_path / "cpu.csv")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Unable to parse" not in run.stderr, run.stderr
    assert asked and set(asked) == {"/metrics"}
    first, second = (gpu.uuid for gpu in GPUS)
    assert f"{first} : 42%" in run.stdout
    assert f"{first} : 123.5 watts" in run.stdout
    assert f"{first} : 3221225472 bytes" in run.stdout and f"{second} : 1073741831 bytes" in run.stdout
    assert f"{first} : 85899345920 bytes" in run.stdout and f"{second} : 141000000000 bytes" in run.stdout
    # Its CSV row holds the same figures, and the server counted at least the requests it measured.
    header, row = (tmp_path / "pa.csv").read_text().splitlines()[:2]
    columns = dict(zip(header.split(","), row.split(","), strict=True))
    assert columns["Total GPU Memory"] == f"{first}:85899345920;{second}:141000000000;"
    assert served >= float(run.stdout.split("Successful request count: ")[1].split()[0])

    assert cpu_only.returncode == 0, cpu_only.stdout + cpu_only.stderr
    warnings = [line for line in cpu_only.stderr.splitlines() if line.startswith("WARNING")]
    assert warnings == [
        f"WARNING: Unable to parse '{name}' metric."
        for name in (
            "nv_gpu_utilization",
            "nv_gpu_power_usage",
            "nv_gpu_memory_used_bytes",
            "nv_gpu_memory_total_bytes",
        )
    ]
