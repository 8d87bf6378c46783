"""bench.gpu, the GPU benchmark: its --quick run on the CPU (so the command cannot rot), its targets, its echo server."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import httpx
import pytest

from bench.gpu import __main__ as bench_gpu
from bench.gpu import echo, repeats, report, service
from bench.gpu.inprocess import Cell, flops_per_row
from bench.gpu.service import ServiceCell
from ffn_core import FFNConfig, build_ffn, save_ffn


@pytest.mark.server
def test_quick_run_measures_every_part_and_writes_the_report(tmp_path, capsys):
    args = ["--quick", "--out", str(tmp_path), "--generator", "ffn-loadtest", "--device", "cpu", "--shared-engine"]
    assert bench_gpu.main(args) == 0
    names = {p.name for p in tmp_path.iterdir()}
    assert {"inprocess.json", "invariance.json", "service.json", "targets.json", "report.md", "gpu.png"} <= names

    cells = json.loads((tmp_path / "inprocess.json").read_text())
    assert {(c["mode"], c["path"]) for c in cells} == {
        (m, p) for m in ("float32", "bfloat16") for p in ("eager", "graphs", "runner")
    }
    assert {c["rows"] for c in cells} == {1, 2, 4} and all(c["rows_per_s"] > 0 for c in cells)

    drift = {(d["mode"], d["dtype"]): d for d in json.loads((tmp_path / "invariance.json").read_text())}
    assert drift["batch_invariant", "float32"]["max_abs_diff"] == 0.0
    assert drift["batch_invariant", "bfloat16"]["max_abs_diff"] == 0.0
    assert drift["default", "float32"]["max_rel_diff"] < 1e-5

    served = json.loads((tmp_path / "service.json").read_text())
    kinds = {(c["server"], c["rows"], c["concurrency"]) for c in served}
    assert kinds == {(server, r, c) for server in ("ffn", "ffn+engine", "echo") for r, c in ((1, 1), (16, 4))}
    for cell in served:
        assert cell["errors"] == 0 and cell["requests_per_s"] > 0, cell
        assert cell["bytes_per_s"] == pytest.approx(cell["requests_per_s"] * 2 * (cell["rows"] * 64 * 4 + 0), rel=0.1)
    for server in ("ffn", "ffn+engine"):  # one front and its engine batch as one process does
        ffn = next(c for c in served if (c["server"], c["rows"]) == (server, 16))
        assert 1 <= ffn["mean_batch_rows"] <= 64  # 4 connections of 16 rows

    targets = json.loads((tmp_path / "targets.json").read_text())
    assert [t["goal"] for t in targets] == ["≥ 6×", "≥ 70 %", "≤ 1 ms", "≥ 6×", "≤ 0.5 ms", "≥ 40 % of dense bf16 peak"]
    assert targets[3]["met"] is None  # one front only: 8 against 1 not measured
    text = capsys.readouterr().out
    for heading in ("### In-process rows/s", "### A row batched against", "### The service against", "### Targets"):
        assert heading in text and heading in (tmp_path / "report.md").read_text()


def test_the_shared_engines_targets_are_issue_30s():
    cells = [
        _service("ffn+engine", 1, 1, 2000, concurrency=1, p50=0.45),
        _service("ffn+engine", 1, 16, 200_000),
        _service("ffn+engine", 8, 16, 1_300_000),
        _service("ffn+engine", 8, 1, 60_000),
        _service("ffn+engine", 8, 256, 1, nbytes=650),
        _service("echo", 8, 256, 1, nbytes=1000),
    ]
    found = {t.name: t for t in report.shared_engine_targets(cells, 64)}
    assert found["fronts: 8 vs 1, r=16"].met and "6.50×" in found["fronts: 8 vs 1, r=16"].measured
    assert found["fronts: 8, r=16"].met  # 1.3 M rows/s
    assert found["fronts: 8, r=1"].met  # 60,000 req/s
    assert (
        found["fronts: binary r=256 vs echo bytes/s"].met is False
        and "8 f: 65%" in found["fronts: binary r=256 vs echo bytes/s"].measured
    )
    assert found["fronts: r=1, one client, p50"].met  # 0.45 ms
    assert [t.met for t in report.targets([], cells, "cpu", None, 64)][:3] == [None, None, None]  # no copies' cells


def _service(
    server: str, workers: int, rows: int, rows_per_s: float, concurrency: int = 64, p50: float = 0.5, nbytes: int = 0
) -> ServiceCell:
    return ServiceCell(
        server,
        workers,
        rows,
        concurrency,
        rows_per_s / rows,
        rows_per_s,
        float(nbytes),
        p50,
        2 * p50,
        0,
        0.1,
        math.nan,
        "wrk",
    )


def test_targets_are_computed_from_the_cells():
    service_cells = [
        _service("ffn", 1, 1, 900, concurrency=1, p50=0.8),
        _service("ffn", 1, 16, 100_000),
        _service("ffn", 8, 16, 650_000),
        _service("ffn", 8, 256, 1, nbytes=700),
        _service("echo", 8, 256, 1, nbytes=1000),
        _service("ffn", 1, 256, 1, nbytes=600),
        _service("echo", 1, 256, 1, nbytes=1000),
    ]
    per_row = 2 * 768 * 3072 * 2
    inprocess_cells = [
        Cell("bfloat16", "graphs", 8192, 1.0, 1.0, 450.0),
        Cell("bfloat16", "graphs", 4096, 1.0, 1.0, 1e3),
        Cell("bfloat16", "eager", 8192, 1.0, 1.0, 900.0),
    ]
    assert per_row == flops_per_row(build_ffn(FFNConfig(768, 3072)))
    found = report.targets(inprocess_cells, service_cells, "NVIDIA H100 80GB HBM3", 989.4, 64)
    assert [t.met for t in found] == [True, False, True, True]  # 6.5x; 60 % at 1 worker; 0.8 ms; 45 %
    assert "6.50×" in found[0].measured and "1 w: 60%" in found[1].measured and "8 w: 70%" in found[1].measured
    assert "450.0 of 989.4" in found[3].measured

    slow = report.targets(
        [Cell("bfloat16", "graphs", 8192, 1.0, 1.0, 295.0)],
        [_service("ffn", 1, 1, 1, 1, p50=1.2)],
        "NVIDIA H100 PCIe",
        756.0,
        64,
    )
    assert [t.met for t in slow] == [None, None, False, False]  # 295 of 756 = 39 %

    unknown = report.targets(inprocess_cells, [], "CPU (x86_64)", None, 64)
    assert [t.met for t in unknown] == [None, None, None, None]


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.4),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("CPU (x86_64)", None),
    ],
)
def test_dense_bf16_peak_by_device_name(name, peak):
    assert report.bf16_peak_tflops(name) == peak


async def test_echo_answers_each_body_with_itself():
    body = bytes(range(256)) * 300
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=echo.app), base_url="http://echo") as client:
        r = await client.post(
            "/v1/models/ffn/transform",
            content=body,
            headers={"content-type": "application/octet-stream", "x-shape": "300,64"},
        )
        assert r.status_code == 200 and r.content == body
        assert r.headers["content-type"] == "application/octet-stream" and r.headers["x-shape"] == "300,64"
        assert (await client.get("/v2/health/ready")).status_code == 200


@pytest.mark.server
@pytest.mark.skipif(not shutil.which("wrk"), reason="needs wrk (apt-get install wrk)")
def test_wrk_drives_the_echo_server(tmp_path):
    server_cores, client_cores = service.split_cores()
    with service.serving("echo", 1, server_cores, tmp_path / "unused.toml", 1) as process:
        body, headers, _ = service.prepared_body(4, 64, tmp_path)
        result = service.load("wrk", process.url, body, headers, 4, 64, 2, 1.0, client_cores)
    assert result.generator == "wrk" and result.requests > 0 and result.errors == 0
    assert 0 < result.p50_ms <= result.p99_ms


@pytest.mark.parametrize(
    ("available", "count", "server", "client"),
    [
        (list(range(16)), None, list(range(8)), list(range(8, 16))),
        (list(range(16)), 4, [0, 1], [2, 3]),
        ([3, 5, 7], None, [3], [5, 7]),
        ([0], None, [0], [0]),  # one core: they must share it
    ],
)
def test_split_cores_gives_the_load_generator_other_cores(available, count, server, client):
    assert service.split_cores(count, available) == (server, client)


def _write_run(folder, cells):
    folder.mkdir()
    (folder / "service.json").write_text(json.dumps([dataclasses.asdict(c) for c in cells]))


def test_repeats_takes_each_cells_median_over_the_runs_that_have_it(tmp_path, capsys):
    # Three runs; the third was stopped before its 8-worker cell, so that cell has two draws.
    rows_1w = [100_000, 120_000, 90_000]
    rows_8w = [600_000, 700_000]
    p50s = [0.9, 1.2, 0.8]
    for index in range(3):
        cells = [_service("ffn", 1, 16, rows_1w[index], p50=p50s[index])]
        if index < 2:
            cells.append(_service("ffn", 8, 16, rows_8w[index]))
        _write_run(tmp_path / f"r{index}", cells)
    out = tmp_path / "medians.json"
    assert repeats.main([str(tmp_path / f"r{i}") for i in range(3)] + ["--json", str(out)]) == 0

    medians = {(c["workers"], c["rows"]): c for c in json.loads(out.read_text())}
    assert medians[1, 16]["rows_per_s"] == 100_000  # the middle of 90,000, 100,000 and 120,000
    assert medians[1, 16]["p50_ms"] == pytest.approx(0.9)
    assert medians[8, 16]["rows_per_s"] == 650_000  # the mean of the two draws it has
    text = capsys.readouterr().out
    assert "| ffn | 1 | 16 | 64 | 3 | 100,000 (90,000–120,000) | 0.900 (0.800–1.200) |" in text
    assert "| ffn | 8 | 16 | 64 | 2 | 650,000 (600,000–700,000) |" in text
    assert "6.50× (650,000 vs 100,000 rows/s) | met |" in text


def test_repeats_says_which_folder_has_no_service_results(tmp_path, capsys):
    (tmp_path / "skipped").mkdir()
    assert repeats.main([str(tmp_path / "skipped")]) == 2
    assert "skipped/service.json: no service.json" in capsys.readouterr().err


@pytest.mark.server
def test_a_run_leaves_its_service_cells_after_each_one(tmp_path):
    # The GPU machine's calls have hard time limits: what was measured must be on disk before the end.
    saved: list[int] = []
    path = tmp_path / "service.json"
    base = build_ffn(FFNConfig(16, 32, "gelu")).requires_grad_(False)
    weights = tmp_path / "ffn.safetensors"
    save_ffn(base, weights)
    cells = service.measure(
        weights,
        "float32",
        16,
        [1],
        [4],
        2,
        0.2,
        None,
        "ffn-loadtest",
        progress=lambda line: None,
        measured=lambda so_far: (bench_gpu.save_cells(so_far, path), saved.append(len(json.loads(path.read_text())))),
    )
    assert saved == [1, 2, 3, 4]  # ffn r=1 C=1, ffn r=4, echo r=1 C=1, echo r=4: one write after each
    assert [c["server"] for c in json.loads(path.read_text())] == [c.server for c in cells]
    assert not path.with_suffix(".json.part").exists()
