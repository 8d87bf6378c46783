"""ModelRunner: the device thread's forward, including the staged (GPU) path run on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app.config.settings import ModelSpec, Settings
from app.engine.registry import Registry, build_runner
from app.engine.runner import ModelRunner, resolve_device, set_tf32
from app.observe.metrics import Metrics
from ffn_core import FFNConfig, build_ffn, demo_ffn, fuse_gate
from tests.reference import numpy_ffn, numpy_weights

D = 512


@pytest.fixture(scope="module")
def model():
    return demo_ffn()


def parts_of(seed: int, sizes: list[int], dtype=torch.float32) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(n, D, generator=generator).to(dtype) for n in sizes]


@pytest.mark.parametrize("staging", [False, True])
def test_concatenates_parts_and_matches_numpy(model, staging):
    runner = ModelRunner(model, max_batch_rows=16, staging=staging)
    parts = parts_of(0, [1, 5, 3])
    y = runner(parts)
    x = torch.cat(parts).numpy()
    np.testing.assert_allclose(y.numpy(), numpy_ffn(x, numpy_weights(model)), rtol=1e-5, atol=1e-5)


def test_staged_path_reuses_its_buffer_without_corrupting_earlier_answers(model):
    runner = ModelRunner(model, max_batch_rows=8, staging=True)
    first_parts = parts_of(1, [4])
    first = runner(first_parts)
    kept = first.clone()
    runner(parts_of(2, [8]))  # overwrites the staging buffer
    assert torch.equal(first, kept)


def test_staged_path_cuts_a_batch_larger_than_its_slots_into_chunks(model):
    runner = ModelRunner(model, max_batch_rows=2, staging=True)
    parts = parts_of(3, [3, 4])
    np.testing.assert_allclose(
        runner(parts).numpy(), ModelRunner(model, max_batch_rows=8)(parts).numpy(), rtol=1e-6, atol=1e-6
    )
    assert runner._staging is not None and runner._staging.staged_chunks == 4  # 7 rows, 2 a slot


@pytest.mark.parametrize("sizes", [[1], [5, 3], [16], [2, 30, 1], [40, 40, 7]], ids=str)
def test_staged_double_buffered_path_gives_the_plain_paths_answers(model, sizes):
    """Forced on the CPU: slot rotation, chunking at 16 rows and the answer's assembly, bit for bit."""
    staged = ModelRunner(model, max_batch_rows=16, staging=True)
    plain = ModelRunner(model, max_batch_rows=16, staging=False)
    for seed in range(3):  # several batches in a row: each slot is reused
        parts = parts_of(10 + seed, sizes)
        ours, theirs = staged(parts), plain(parts)
        assert ours.dtype == theirs.dtype == torch.float32
        assert torch.equal(ours, theirs)
        np.testing.assert_allclose(
            ours.numpy(), numpy_ffn(torch.cat(parts).numpy(), numpy_weights(model)), rtol=1e-5, atol=1e-5
        )


def test_staged_launch_returns_an_answer_that_the_next_batch_does_not_overwrite(model):
    runner = ModelRunner(model, max_batch_rows=8, staging=True)
    first, second, third = (runner.launch(parts_of(20 + i, [8])) for i in range(3))  # three batches, two slots
    answers = [p.wait() for p in (first, second, third)]
    for i, answer in enumerate(answers):
        x = parts_of(20 + i, [8])[0].numpy()
        np.testing.assert_allclose(answer.numpy(), numpy_ffn(x, numpy_weights(model)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("staging", [False, True])
def test_bucket_padding_equals_eager_for_every_row_count(staging, np_ffn, close):
    """Padded up to its bucket (1, 2, 4, ..., 64, 100) and sliced, every batch from 1 to 100 rows."""
    torch.manual_seed(0)
    model = build_ffn(FFNConfig(48, 96, "gelu", gated=True)).requires_grad_(False)
    padded = ModelRunner(model, max_batch_rows=100, staging=staging, pad=True)
    eager = ModelRunner(model, max_batch_rows=100, staging=False, pad=False)
    assert padded.bucketed.padded == [1, 2, 4, 8, 16, 32, 64, 100]
    generator = torch.Generator().manual_seed(1)
    for rows in range(1, 101):
        x = torch.randn(rows, 48, generator=generator)
        y = padded([x])
        assert y.shape == (rows, 48)
        torch.testing.assert_close(y, eager([x]), rtol=1e-5, atol=1e-6)
        close(y.numpy(), np_ffn(x.double().numpy(), numpy_weights(model), "gelu"))


def test_warm_up_check_takes_a_broken_bucket_off_with_a_warning(model, caplog):
    runner = ModelRunner(model, max_batch_rows=16, pad=True)
    runner.bucketed._calls[8] = lambda: torch.zeros(8, D)  # a "graph" that computes nothing
    with caplog.at_level("WARNING", logger="ffn_serve.runner"):
        runner.warm_up()
    assert "batch bucket 8 differs from the eager model" in caplog.text
    assert runner.bucketed.padded == [1, 2, 4, 16]
    for rows in (5, 8):  # bucket 8's batches now run eager, and are right
        x = parts_of(30 + rows, [rows])
        np.testing.assert_allclose(
            runner(x).numpy(), numpy_ffn(x[0].numpy(), numpy_weights(model)), rtol=1e-5, atol=1e-5
        )


def test_warm_up_check_passes_sound_buckets_without_a_warning(model, caplog):
    runner = ModelRunner(model, max_batch_rows=16, pad=True)
    with caplog.at_level("WARNING", logger="ffn_serve.runner"):
        assert runner.warm_up() == [1, 2, 4, 8, 16]
    assert "differs" not in caplog.text
    assert runner.bucketed.padded == [1, 2, 4, 8, 16]


def test_warm_up_check_runs_a_broken_fused_gate_unfused(caplog, np_ffn, close):
    torch.manual_seed(2)
    source = build_ffn(FFNConfig(32, 64, "silu", gated=True)).requires_grad_(False)
    fused = fuse_gate(source)
    fused._w1v = fused._w1v * 1.5  # the fused copy drifts from the halves the state dict holds
    runner = ModelRunner(fused, max_batch_rows=8)
    with caplog.at_level("WARNING", logger="ffn_serve.runner"):
        runner.warm_up()
    assert "the fused gate differs from the unfused one" in caplog.text
    x = torch.randn(5, 32)
    close(runner([x]).numpy(), np_ffn(x.double().numpy(), numpy_weights(source), "silu"))


@pytest.mark.parametrize(
    ("model_dtype", "wire", "answer", "rtol"),
    [
        (torch.bfloat16, torch.float32, torch.float32, 2e-2),
        (torch.float16, torch.float32, torch.float32, 3e-3),
        (torch.float32, torch.bfloat16, torch.float32, 1e-5),
        (torch.bfloat16, torch.bfloat16, torch.bfloat16, 2e-2),
    ],
)
@pytest.mark.parametrize("staging", [False, True])
def test_answer_dtype_is_the_wider_of_wire_and_compute(model, model_dtype, wire, answer, rtol, staging, close):
    """A float32 client of a half-precision model gets float32; nothing is rounded below the compute dtype."""
    runner = ModelRunner(demo_ffn().to(model_dtype), max_batch_rows=16, staging=staging)
    x = parts_of(40, [3, 4], wire)
    y = runner(x)
    assert y.dtype == answer and y.shape == (7, D)
    expected = numpy_ffn(torch.cat(x).double().numpy(), numpy_weights(model))
    close(y.double().numpy(), expected, rtol=rtol)


def test_set_tf32_flips_torchs_matmul_and_cudnn_switches():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        set_tf32(True)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        set_tf32(False)
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.parametrize("tf32", [True, False])
def test_the_tf32_setting_reaches_torch_when_the_models_load(tf32):
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        Registry(Settings(tf32=tf32), Metrics()).load()
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (tf32, tf32)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_settings_build_the_runner():
    """Each GPU-path setting reaches the runner; on the CPU, graphs and staging stay off unless forced."""
    default = build_runner(demo_ffn(), Settings())
    assert not default.staged and not default.cuda_graphs and not default.batch_invariant
    assert default.chunk_rows == 1024 and default.bucketed.padded == []
    forced = build_runner(demo_ffn(), Settings(staging="on", batch_invariant=True, batch_invariant_rows=32))
    assert forced.staged and forced.batch_invariant and forced.chunk_rows == 32 and forced.bucketed.padded == [32]


@pytest.mark.parametrize("staging", [False, True])
def test_mixed_input_dtypes_are_converted_to_the_model_dtype(model, staging):
    runner = ModelRunner(model, max_batch_rows=16, staging=staging)
    half = parts_of(4, [2], torch.float16)[0]
    single = parts_of(5, [3])[0]
    y = runner([half, single])
    x = torch.cat([half.float(), single]).numpy()
    np.testing.assert_allclose(y.numpy(), numpy_ffn(x, numpy_weights(model)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("max_rows", "buckets"), [(100, [1, 2, 4, 8, 16, 32, 64, 100]), (64, [1, 2, 4, 8, 16, 32, 64]), (1, [1])]
)
def test_warm_up_runs_every_bucket(model, max_rows, buckets):
    """What the model itself was called with, not what warm_up says it did."""
    runner = ModelRunner(model, max_batch_rows=max_rows)
    ran: list[tuple[int, ...]] = []
    hook = model.register_forward_pre_hook(lambda module, args: ran.append(tuple(args[0].shape)))
    try:
        reported = runner.warm_up()
    finally:
        hook.remove()
    assert ran == [(rows, D) for rows in buckets]
    assert reported == buckets


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda:0")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_runner_matches_cpu(model, dtype):
    cuda_model = demo_ffn().to("cuda", dtype)
    runner = ModelRunner(cuda_model, max_batch_rows=64)
    assert runner.staged
    parts = parts_of(6, [1, 7, 30])
    y = runner(parts)
    assert y.device.type == "cpu" and y.dtype == torch.float32  # the wire's float32, wider than bfloat16
    x = torch.cat(parts).numpy()
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    np.testing.assert_allclose(y.float().numpy(), numpy_ffn(x, numpy_weights(model)), rtol=tolerance, atol=tolerance)


def test_inline_rows_is_the_largest_bucket_within_the_budget(model, monkeypatch):
    """Timed with a clock the test controls: each forward pass of n rows 'takes' n x 100 µs."""
    import app.engine.runner as runner_module

    runner = ModelRunner(model, max_batch_rows=64)
    last_rows = [0]
    forward = runner._forward_plain

    def counted(parts):
        last_rows[0] = sum(p.shape[0] for p in parts)
        return forward(parts)

    monkeypatch.setattr(runner, "_forward_plain", counted)
    monkeypatch.setattr(runner_module, "_seconds", lambda fn, parts: (fn(parts), last_rows[0] * 100e-6)[1])
    assert runner.inline_rows(0.0) == 0, "0 turns it off"
    assert runner.inline_rows(50e-6) == 0, "not even one row fits"
    assert runner.inline_rows(100e-6) == 1
    assert runner.inline_rows(500e-6) == 4, "8 rows take 800 µs"
    assert runner.inline_rows(10.0) == 64, "every bucket fits"


def test_inline_rows_times_real_passes_and_stays_off_where_buffers_are_shared(model):
    assert ModelRunner(model, max_batch_rows=64).inline_rows(10.0) == 64, "a second per pass: every bucket"
    assert ModelRunner(model, max_batch_rows=64, staging=True).inline_rows(10.0) == 0
    assert ModelRunner(model, max_batch_rows=64, batch_invariant_rows=16).inline_rows(10.0) == 0


@pytest.mark.parametrize(("budget_us", "inline"), [(100_000, 8), (0, 0)])
async def test_a_served_model_times_its_short_passes_before_it_turns_ready(start_app, budget_us, inline):
    """The registry's setting reaches the batcher by the time the model is ready; answers are the same.

    On the CPU, where inline passes exist (a GPU machine would serve on CUDA by default).
    """
    on_cpu = [ModelSpec(name="demo", device="cpu")]
    served = await start_app(Settings(models=on_cpu, max_batch_rows=8, inline_forward_us=budget_us, warmup=False))
    engine = served.app.state.service.engine
    assert engine.model("demo")._batcher.inline_rows == inline
    x = parts_of(7, [3])[0]
    response = await served.client.post("/v1/models/demo/transform", json={"inputs": x.tolist()})
    assert response.status_code == 200, response.text
    expected = numpy_ffn(x.numpy(), numpy_weights(demo_ffn()))
    np.testing.assert_allclose(np.asarray(response.json()["outputs"]), expected, rtol=1e-5, atol=1e-5)
