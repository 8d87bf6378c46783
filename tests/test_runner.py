"""ModelRunner: the device thread's forward, including the staged (GPU) path run on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app.engine.runner import ModelRunner, resolve_device
from ffn_core import demo_ffn
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


def test_staged_path_grows_for_a_larger_batch(model):
    runner = ModelRunner(model, max_batch_rows=2, staging=True)
    parts = parts_of(3, [3, 4])
    np.testing.assert_allclose(runner(parts).numpy(), ModelRunner(model, max_batch_rows=8)(parts).numpy(),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("staging", [False, True])
def test_mixed_input_dtypes_are_converted_to_the_model_dtype(model, staging):
    runner = ModelRunner(model, max_batch_rows=16, staging=staging)
    half = parts_of(4, [2], torch.float16)[0]
    single = parts_of(5, [3])[0]
    y = runner([half, single])
    x = torch.cat([half.float(), single]).numpy()
    np.testing.assert_allclose(y.numpy(), numpy_ffn(x, numpy_weights(model)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("max_rows", "buckets"), [(100, [1, 2, 4, 8, 16, 32, 64, 100]), (64, [1, 2, 4, 8, 16, 32, 64]),
                                                   (1, [1])])
def test_warm_up_runs_every_bucket(model, max_rows, buckets):
    """What the model itself was called with, not what warm_up says it did."""
    runner = ModelRunner(model, max_batch_rows=max_rows)
    ran: list[tuple[int, ...]] = []
    hook = model.register_forward_pre_hook(lambda module, args: ran.append(tuple(args[0].shape)))
    try:
        reported = runner.warm_up(max_rows)
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
    assert runner._staging is not None and runner._staging.is_pinned()
    parts = parts_of(6, [1, 7, 30])
    y = runner(parts)
    assert y.device.type == "cpu" and y.dtype == dtype
    x = torch.cat(parts).numpy()
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    np.testing.assert_allclose(y.float().numpy(), numpy_ffn(x, numpy_weights(model)), rtol=tolerance, atol=tolerance)
