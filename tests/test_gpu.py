"""The GPU path on a real GPU: CUDA graphs per bucket, the warm-up check, staged streams, TF32, invariance.

Skipped without CUDA. On a GPU machine: `python -m pytest -q -m gpu` (bench/gpu/run.sh runs it first).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app.config.settings import ModelSpec, Settings
from app.engine.graphs import relative_error
from app.engine.runner import ModelRunner, set_tf32
from app.engine.staging import InFlight
from ffn_core import FFNConfig, build_ffn, demo_ffn, fuse_gate
from tests.reference import numpy_ffn, numpy_weights

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

D = 512
# Relative error (norm) against the float64 reference of the model's own weights.
BOUND = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


def rows(seed: int, n: int) -> torch.Tensor:
    return torch.randn(n, D, generator=torch.Generator().manual_seed(seed))


def reference(model, x: torch.Tensor) -> torch.Tensor:
    weights = numpy_weights(model)
    return torch.from_numpy(numpy_ffn(x.double().numpy(), weights, model.config.activation))


def warm_runner(dtype: torch.dtype, **options) -> ModelRunner:
    runner = ModelRunner(demo_ffn().to("cuda", dtype), max_batch_rows=options.pop("max_batch_rows", 64), **options)
    runner.warm_up()
    return runner


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_graphs_capture_every_bucket_and_answer_every_row_count(dtype):
    runner = warm_runner(dtype)
    assert sorted(runner.bucketed.graphed) == [1, 2, 4, 8, 16, 32, 64]
    for n in range(1, 65):
        x = rows(n, n)
        y = runner([x])
        assert y.shape == (n, D) and y.device.type == "cpu"
        assert relative_error(y, reference(runner.model, x)) <= BOUND[dtype], n


def test_graphs_off_runs_eager_and_unpadded():
    runner = warm_runner(torch.float32, cuda_graphs=False)
    assert runner.bucketed.graphed == [] and runner.bucketed.padded == []
    x = rows(1, 5)
    assert relative_error(runner([x]), reference(runner.model, x)) <= BOUND[torch.float32]


def test_warm_up_check_takes_a_wrong_graph_bucket_off_with_a_warning(caplog):
    runner = ModelRunner(demo_ffn().to("cuda"), max_batch_rows=16)
    with torch.inference_mode(), caplog.at_level("WARNING", logger="ffn_serve.runner"):
        runner._capture_graphs()
        replay = runner.bucketed._calls[8]
        runner.bucketed._calls[8] = lambda: replay() * 2  # a graph whose answer is wrong
        runner.bucketed.check(runner.bucketed.forward, 1e-5, torch.Generator().manual_seed(0))
    assert "batch bucket 8 differs from the eager model" in caplog.text
    assert sorted(runner.bucketed.graphed) == [1, 2, 4, 16]
    x = rows(2, 6)
    assert relative_error(runner([x]), reference(runner.model, x)) <= BOUND[torch.float32]


def test_staged_batches_overlap_with_events_not_a_device_wide_synchronize(monkeypatch):
    runner = warm_runner(torch.bfloat16)
    staging = runner._staging
    assert staging is not None and staging.copy_stream != staging.compute_stream
    assert staging.copy_stream != torch.cuda.current_stream()

    def refuse(*args, **kwargs):
        raise AssertionError("the request path must not synchronise the whole device")

    monkeypatch.setattr(torch.cuda, "synchronize", refuse)
    batches = [[rows(10 + i, 40), rows(20 + i, 24)] for i in range(5)]  # 5 batches through 2 slots
    pending = [runner.launch(parts) for parts in batches]  # all launched before any is waited for
    assert all(isinstance(p, InFlight) and p.output.is_pinned() for p in pending)
    for parts, p in zip(batches, pending, strict=True):
        y = p.wait()
        assert y.dtype == torch.float32  # float32 in, float32 out of a bfloat16 model
        assert relative_error(y, reference(runner.model, torch.cat(parts))) <= BOUND[torch.bfloat16]


def test_staged_and_plain_paths_agree_on_cuda():
    staged = warm_runner(torch.float32)
    plain = warm_runner(torch.float32, staging=False)
    parts = [rows(3, 7), rows(4, 50).half(), rows(5, 1)]
    torch.testing.assert_close(staged(parts), plain(parts), rtol=1e-6, atol=1e-6)


def test_staging_puts_back_the_stream_it_found_also_when_nested():
    """stage() runs inside computing(): leaving the copy stream must go back to the compute stream.

    A version that went back to the default stream there ran the graph unordered after the
    copy of its rows, and a batch-invariant answer differed now and then.
    """
    runner = warm_runner(torch.float32)
    staging = runner._staging
    default = torch.cuda.current_stream()
    assert default == torch.cuda.default_stream()
    with staging.computing():
        assert torch.cuda.current_stream() == staging.compute_stream
        staging.stage([rows(1, 3)], 0, 3, torch.float32)
        assert torch.cuda.current_stream() == staging.compute_stream
        staging.consumed()
    assert torch.cuda.current_stream() == default
    for n in (1, 64, 700):  # staged in chunks of 64, the two slots in turn, against the float64 reference
        x = rows(n, n)
        assert relative_error(runner([x]), reference(runner.model, x)) <= BOUND[torch.float32], n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_batch_invariant_mode_is_bit_identical_on_cuda(dtype):
    runner = warm_runner(dtype, max_batch_rows=1024, batch_invariant_rows=64)
    assert runner.bucketed.graphed == [64]
    probe = rows(1, 1)
    alone = runner([probe])
    for seed, (size, at) in enumerate([(2, 1), (63, 30), (64, 63), (65, 64), (700, 389)]):
        batch = rows(100 + seed, size)
        batch[at] = probe[0]
        assert torch.equal(runner([batch])[at], alone[0]), (size, at)


def test_tf32_float32_is_within_its_bound():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        set_tf32(True)
        runner = warm_runner(torch.float32, tf32=True)
        x = rows(7, 256)
        error = relative_error(runner([x]), reference(runner.model, x))
        assert 0 < error <= 5e-3  # TF32's 10-bit mantissa: above float32's ~1e-7, below the warm-up bound
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_gate_on_cuda_equals_unfused(dtype):
    torch.manual_seed(0)
    model = build_ffn(FFNConfig(768, 2048, "silu", gated=True)).requires_grad_(False)
    fused = fuse_gate(model.to("cuda", dtype))
    x = torch.randn(300, 768, generator=torch.Generator().manual_seed(8)).to("cuda", dtype)
    with torch.inference_mode():
        assert relative_error(fused(x), model(x)) <= BOUND[dtype]
    runner = ModelRunner(fused, max_batch_rows=256)
    runner.warm_up()
    assert runner.bucketed.forward is fused  # the warm-up check kept it fused


async def test_the_service_serves_from_cuda(start_app):
    app = await start_app(Settings(models=[ModelSpec(name="demo", dtype="bfloat16")]))
    listed = (await app.client.get("/v1/models")).json()
    assert str(listed).count("cuda") >= 1
    x = np.random.default_rng(0).standard_normal((5, D)).astype(np.float32)
    r = await app.client.post(
        "/v1/models/demo/transform",
        content=x.tobytes(),
        headers={"content-type": "application/octet-stream", "x-shape": f"5,{D}", "accept": "application/octet-stream"},
    )
    assert r.status_code == 200 and r.headers["x-dtype"] == "float32"
    y = torch.from_numpy(np.frombuffer(r.content, "<f4").reshape(5, D).copy())
    assert relative_error(y, reference(demo_ffn().to(torch.bfloat16), torch.from_numpy(x))) <= BOUND[torch.bfloat16]
