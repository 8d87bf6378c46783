"""Batch-invariant mode: a row's answer is bit-identical whatever it is batched with and however large the batch.

Checked with exact equality (torch.equal, identical bytes), through the runner, the batcher and
HTTP. The default mode promises float tolerance only; its test says so with a tolerance.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from app.config.settings import Settings
from app.engine.batcher import Batcher
from app.engine.runner import ModelRunner
from app.observe.metrics import Metrics
from app.process.supervisor import threads_per_worker
from ffn_core import FFNConfig, build_ffn, demo_ffn, fuse_gate
from tests.reference import demo_reference

D = 512
ROWS = 16  # the fixed row count of these tests' forward passes


def rows(seed: int, n: int, d: int = D) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


def probe_in(batch: torch.Tensor, at: int, probe: torch.Tensor) -> torch.Tensor:
    batch = batch.clone()
    batch[at] = probe[0]
    return batch


@pytest.mark.parametrize("staging", [False, True])
@pytest.mark.parametrize("gated", [False, True])
def test_runner_answers_a_row_bit_for_bit_whatever_its_mates_and_batch_size(staging, gated):
    torch.manual_seed(0)
    model = fuse_gate(build_ffn(FFNConfig(64, 160, "silu", gated=True)).requires_grad_(False)) if gated else demo_ffn()
    d = model.config.d_model
    runner = ModelRunner(model, max_batch_rows=1024, staging=staging, batch_invariant_rows=ROWS)
    probe = rows(1, 1, d)
    alone = runner([probe])
    # Mates before and after it, batch sizes below, at and past the fixed count, split across parts.
    for seed, (size, at) in enumerate(
        [
            (2, 1),
            (ROWS - 1, 7),
            (ROWS, 0),
            (ROWS, ROWS - 1),
            (ROWS + 1, ROWS),
            (3 * ROWS + 5, 2 * ROWS + 3),
            (1000, 517),
        ]
    ):
        batch = probe_in(rows(100 + seed, size, d), at, probe)
        y = runner([batch[:at], batch[at:]] if at else [batch])
        assert torch.equal(y[at], alone[0]), (size, at)
        mates = runner([rows(200 + seed, 5, d), batch[at : at + 1], rows(300 + seed, 9, d)])
        assert torch.equal(mates[5], alone[0]), (size, at)


def test_batch_invariant_mode_runs_one_torch_thread():
    """Several threads split a pass's rows, and some CPUs reduce the parts in different orders.

    Seen on a GPU machine's 16-thread Xeon: rows 8 to 15 of a 16-row pass differed from row 0 in
    their last bits, so the tests above failed there. This CPU may not show it, so the rule is checked.
    """
    assert Settings(batch_invariant=True, torch_threads=4).intra_op_threads() == 1
    assert Settings(torch_threads=3).intra_op_threads() == 3
    assert Settings().intra_op_threads() == 0  # torch's default
    assert threads_per_worker(Settings(workers=2, batch_invariant=True)) == 1
    assert threads_per_worker(Settings(workers=2, torch_threads=3)) == 3
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        ModelRunner(demo_ffn(), max_batch_rows=64)  # the default mode leaves the threads alone
        assert torch.get_num_threads() == 2
        ModelRunner(demo_ffn(), max_batch_rows=64, batch_invariant_rows=ROWS)  # built outside the service
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_runner_pads_every_forward_to_the_fixed_row_count():
    model = demo_ffn()
    runner = ModelRunner(model, max_batch_rows=1024, batch_invariant_rows=ROWS)
    seen: list[int] = []
    hook = model.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[0]))
    try:
        for n in (1, 5, ROWS, ROWS + 1, 70):
            runner([rows(n, n)])
    finally:
        hook.remove()
    assert seen == [ROWS] * (1 + 1 + 1 + 2 + 5)


async def test_batcher_path_is_bit_identical_across_batch_mates_and_sizes():
    """Concurrent requests batched together: the probe's answer equals its answer alone, bit for bit."""
    model = demo_ffn()
    runner = ModelRunner(model, max_batch_rows=256, batch_invariant_rows=ROWS)
    batch_sizes: list[int] = []

    def forward(parts):
        batch_sizes.append(sum(p.shape[0] for p in parts))
        return runner(parts)

    with ThreadPoolExecutor(max_workers=1) as executor:
        batcher = Batcher(forward, max_batch_rows=256, executor=executor, metrics=Metrics())
        await batcher.start()
        try:
            probe = rows(1, 1)
            alone = await batcher.submit(probe)
            for seed, mates in enumerate([[1], [3, 7], [ROWS], [40, 2, 90], [200]]):
                requests = [rows(10 * seed + i, n) for i, n in enumerate(mates)]
                answers = await asyncio.gather(*(batcher.submit(r) for r in [*requests[:1], probe, *requests[1:]]))
                assert torch.equal(answers[1], alone), mates
        finally:
            await batcher.stop()
    assert max(batch_sizes) > 100  # the requests were batched together, not run one by one


async def test_default_mode_agrees_to_float_tolerance_only():
    """What the default promises: a batched row equals its lone answer within float32 rounding (not bit for bit)."""
    runner = ModelRunner(demo_ffn(), max_batch_rows=1024)
    probe = rows(1, 1)
    alone = runner([probe])
    for size, at in [(2, 1), (33, 20), (1000, 517)]:
        y = runner([probe_in(rows(size, size), at, probe)])
        np.testing.assert_allclose(y[at].numpy(), alone[0].numpy(), rtol=0, atol=1e-5 * alone.abs().max().item())


@pytest.mark.parametrize("staging", ["off", "on"])
async def test_http_answers_are_identical_bytes_alone_and_batched(start_app, staging):
    settings = Settings(batch_invariant=True, batch_invariant_rows=ROWS, staging=staging)
    client = (await start_app(settings)).client
    probe = rows(1, 1).numpy()

    async def send(x: np.ndarray) -> bytes:
        r = await client.post(
            "/v1/models/demo/transform",
            content=x.tobytes(),
            headers={
                "content-type": "application/octet-stream",
                "x-shape": f"{len(x)},{D}",
                "accept": "application/octet-stream",
            },
        )
        assert r.status_code == 200, r.text
        return r.content

    alone = await send(probe)
    np.testing.assert_allclose(
        np.frombuffer(alone, np.float32).reshape(1, D), demo_reference(probe), rtol=1e-5, atol=1e-5
    )
    others = [rows(50 + i, n).numpy() for i, n in enumerate([3, 30, 100, 7])]
    answers = await asyncio.gather(*(send(x) for x in [others[0], probe, *others[1:], probe]))
    assert answers[1] == alone and answers[-1] == alone
    big = probe_in(rows(60, 300), 123, torch.from_numpy(probe)).numpy()
    y = np.frombuffer(await send(big), np.float32).reshape(300, D)
    assert y[123].tobytes() == alone
    np.testing.assert_allclose(y, demo_reference(big), rtol=1e-5, atol=1e-5)


def test_bf16_model_is_batch_invariant_too():
    runner = ModelRunner(demo_ffn().to(torch.bfloat16), max_batch_rows=1024, batch_invariant_rows=ROWS)
    probe = rows(1, 1)
    alone = runner([probe])
    assert alone.dtype == torch.float32  # a float32 wire
    for size, at in [(5, 4), (ROWS * 3, 40)]:
        assert torch.equal(runner([probe_in(rows(size, size), at, probe)])[at], alone[0])
    np.testing.assert_allclose(alone.numpy(), demo_reference(probe.numpy()), rtol=3e-2, atol=3e-2)
