"""bench.transport: its --quick run (so the command cannot rot), its goals, and the stage classifier of its profile."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest

from bench import stages, transport, transport_plot
from bench.transport import Cell


@pytest.mark.server
def test_quick_run_measures_the_service_beside_both_echoes(tmp_path, capsys):
    out = tmp_path / "transport.json"
    assert transport.main(["--quick", "--models", "near-free", "--generator", "ffn-loadtest", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    cells = {(c["server"], c["rows"], c["concurrency"]): c for c in result["cells"]}
    assert set(cells) == {(s, r, c) for s in ("echo", "echo+protocol", "near-free") for r in (1, 16) for c in (1, 4)}
    for cell in cells.values():
        assert cell["errors"] == 0 and cell["rows_per_s"] > 0 and cell["cpu_ms_per_request"] >= 0, cell
        # Request and answer bodies of r rows of 768 float32 each.
        assert cell["bytes_per_s"] == pytest.approx(cell["rows_per_s"] * 2 * 768 * 4)
    # CPU time is read from /proc in clock ticks (10 ms): a quick cell of 0.25 s on a loaded machine may
    # see none (a CI run: echo+protocol at 41 rows/s read 0.0), but every server's cells together do.
    for server in ("echo", "echo+protocol", "near-free"):
        assert sum(c["cpu_ms_per_request"] for (s, _, _), c in cells.items() if s == server) > 0, server
    served = cells["near-free", 16, 4]
    assert 16 <= served["mean_batch_rows"] <= 64 and served["model_ms_per_request"] > 0
    assert math.isnan(cells["echo", 16, 4]["mean_batch_rows"])
    assert [g["goal"].split(":")[0] for g in result["goals"]] == [
        "r=256, C=16",
        "r=16, C=16",
        "r=1, C=1",
        "r=1, C=1",
        "r=1, C=4",
    ]
    text = capsys.readouterr().out
    assert "| 16 | 4 | near-free |" in text and "predicted rows/s per worker" in text


def _cell(server: str, rows: int, concurrency: int, rows_per_s: float, p50: float, cpu: float) -> Cell:
    return Cell(server, rows, concurrency, 3, rows_per_s, rows_per_s * 2 * 768 * 4, p50, 2 * p50, cpu, 0, 1.0, 0.01)


def test_goals_compare_the_near_free_service_with_the_plain_echo():
    cells = [
        _cell("echo", 256, 16, 10_000, 5.0, 1.0),
        _cell("near-free", 256, 16, 7_000, 6.0, 1.4),  # 70 %: met at the bound
        _cell("echo", 16, 16, 10_000, 2.0, 0.2),
        _cell("near-free", 16, 16, 4_999, 4.0, 0.4),  # just under 50 %
        _cell("echo", 1, 1, 2_000, 0.40, 0.10),
        _cell("near-free", 1, 1, 1_500, 0.95, 0.31),  # +0.55 ms; 3.1x
    ]
    found = {g.goal: (g.measured, g.met) for g in transport.goals(cells)}
    assert found == {
        "r=256, C=16: ≥ 70% of echo's bytes/s": ("70%", True),
        "r=16, C=16: ≥ 50% of echo's rows/s": ("50%", False),
        "r=1, C=1: p50 within 0.5 ms of echo's": ("0.95 vs 0.40 ms (+0.55)", False),
        "r=1, C=1: server CPU per request ≤ 3× echo's": ("0.310 vs 0.100 ms (3.1×)", False),
    }


def test_the_prediction_takes_the_models_own_share_out():
    # 0.5 ms of CPU per 16-row request, 0.1 of it the model's: 16 rows per 0.4 ms = 40,000 rows/s.
    cells = [Cell("near-free", 16, 64, 3, 30_000, 0.0, 1.0, 2.0, 0.5, 0, 64.0, 0.1)]
    assert transport.prediction(cells)[-1] == "| 16 | 64 | 30,000 | 0.500 | 0.100 | 40,000 |"


def test_each_sample_goes_to_the_stage_of_its_innermost_named_frame():
    loop = "Runner.run (asyncio/runners.py:118);RequestResponseCycle.run_asgi (uvicorn/protocols/http/httptools_impl.py:409)"
    handler = f"{loop};FastPath._handle (app/http/endpoints.py:99);transform (app/http/native/routes.py:40)"
    raw = "\n".join(
        [
            f"thread (1): MainThread;{handler};_decode (app/http/native/routes.py:70);view_rows (app/protocol/tensors.py:72);"
            "check_finite (app/protocol/tensors.py:55);all_finite (app/protocol/tensors.py:47) 5",
            f"thread (1): MainThread;{handler};encode (app/protocol/native.py:240);"
            "check_finite_output (app/protocol/tensors.py:60);all_finite (app/protocol/tensors.py:47) 3",
            f"thread (1): MainThread;{loop};Batcher._collect (app/engine/batcher.py:290);Batcher._run (app/engine/batcher.py:370);"
            "ModelRunner.launch (app/engine/runner.py:130);FeedForward.forward (ffn_core/model.py:41);"
            "Linear.forward (torch/nn/modules/linear.py:134) 7",
            f"thread (1): MainThread;{loop};Batcher._collect (app/engine/batcher.py:290);"
            "Batcher._split (app/engine/batcher.py:385) 2",
            "thread (2): ffn-cpu_0;Thread.run (threading.py:982);_worker (concurrent/futures/thread.py:81) 4",
            f"thread (1): MainThread;{handler};Response.__call__ (starlette/responses.py:169);"
            "RequestResponseCycle.send (uvicorn/protocols/http/httptools_impl.py:524) 6",
            f"thread (1): MainThread;{handler};Counting.__exit__ (app/protocol/admission.py:140);"
            "Counter.inc (prometheus_client/metrics.py:300) 1",
            f"thread (1): MainThread;{handler} 2",
            "thread (1): MainThread;Runner.run (asyncio/runners.py:118) 9",
            "thread (1): MainThread;something (elsewhere.py:1) 1",
            # A front of an engine process, and the engine (shared_engine): the hand-off's own frames.
            f"thread (1): MainThread;{handler};RemoteModel.infer (app/handoff/remote.py:110);"
            "_Link.ask (app/handoff/front.py:240);FrameWriter.send (app/handoff/frames.py:50) 4",
            f"thread (1): MainThread;{loop};EngineServer._submit (app/handoff/engine.py:300);"
            "ServedModel.infer_soon (app/engine/registry.py:290);Batcher.submit_soon (app/engine/batcher.py:210) 3",
        ]
    )
    samples = stages.classify(raw)
    assert samples == Counter(
        {
            "decode": 5,
            "encode": 3,
            "compute": 7,
            "split": 2,
            "device-thread handoff": 4,
            "write": 6,
            "metrics": 1,
            "edge: guard, fast path, handler": 2,
            "event loop": 9,
            "other": 1,
            "hand-off": 4,
            "admission": 3,  # the engine's submit of a handed-off request is the batcher's admission
        }
    )
    spread = stages.breakdown(samples, cpu_ms_per_request=0.4)
    assert list(spread) == [stage for stage in stages.ORDER if samples[stage]]
    assert spread["compute"] == pytest.approx((7 / 47, 400.0 * 7 / 47))
    assert sum(micros for _, micros in spread.values()) == pytest.approx(400.0)


def test_tls_rows_are_compared_with_the_echo_over_https_and_their_cost_is_the_difference():
    cells = [
        _cell("echo", 1, 16, 20_000, 0.5, 0.050),
        _cell("echo+tls", 1, 16, 15_000, 0.6, 0.070),
        _cell("near-free", 1, 16, 5_000, 1.0, 0.200),
        _cell("near-free+tls", 1, 16, 4_000, 1.2, 0.250),
    ]
    servers = [
        transport.Server("echo"),
        transport.Server("echo+tls", tls=True),
        transport.Server("near-free", "near-free"),
        transport.Server("near-free+tls", "near-free", tls=True),
    ]
    rows = {line.split(" | ")[2]: line for line in transport.table(cells, servers).splitlines()[2:]}
    assert "| 27% |" in rows["near-free+tls"] and "| 3.6 |" in rows["near-free+tls"]  # of echo+tls: 4,000 / 15,000
    assert "| 25% |" in rows["near-free"]  # of the plain echo
    cost = transport.tls_cost(cells)[2:]
    assert cost == [
        "| 1 | 16 | echo | 0.050 | 0.070 | +0.020 | 0.50 | 0.60 | 75% |",
        "| 1 | 16 | near-free | 0.200 | 0.250 | +0.050 | 1.00 | 1.20 | 80% |",
    ]


def test_the_plot_reads_each_cell_against_the_echo_of_the_same_rows_and_clients(tmp_path, capsys):
    def cell(server: str, rows: int, clients: int, rows_per_s: float, cpu_ms: float) -> dict[str, object]:
        return {
            "server": server,
            "rows": rows,
            "concurrency": clients,
            "rows_per_s": rows_per_s,
            "cpu_ms_per_request": cpu_ms,
        }

    cells = [
        cell("echo", 1, 16, 30_000.0, 0.040),
        cell("near-free", 1, 16, 12_000.0, 0.100),
        cell("near-free+engine", 1, 16, 6_000.0, 0.180),
        cell("echo", 256, 16, 400_000.0, 0.600),
        cell("near-free", 256, 16, 240_000.0, 1.050),
        cell("near-free", 16, 16, 100_000.0, 0.150),  # no echo of its rows and clients: left out
    ]
    found = {(r.server, r.rows, r.concurrency): r for r in transport_plot.ratios(cells)}
    assert set(found) == {("near-free", 1, 16), ("near-free+engine", 1, 16), ("near-free", 256, 16)}
    assert found["near-free", 1, 16].share_of_echo == pytest.approx(0.4)
    assert found["near-free", 1, 16].cpu_in_echoes == pytest.approx(2.5)
    assert found["near-free+engine", 1, 16].cpu_in_echoes == pytest.approx(4.5)
    assert found["near-free", 256, 16].share_of_echo == pytest.approx(0.6)
    assert found["near-free", 256, 16].cpu_in_echoes == pytest.approx(1.75)
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"header": "a run", "cells": cells}))
    png = tmp_path / "img" / "run.png"
    assert transport_plot.main([str(run), str(png)]) == 0
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and png.stat().st_size > 10_000
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].split() == [
        "r=1",
        "C=16",
        "near-free",
        "40%",
        "of",
        "the",
        "echo's",
        "rows/s,",
        "2.5x",
        "its",
        "CPU",
        "a",
        "request",
    ]
