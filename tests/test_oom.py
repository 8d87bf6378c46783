"""Out of memory in the forward pass: the batch is split in halves and retried.

The real ModelRunner over demo_ffn(), wrapped in a forward that raises MemoryError (what CPU
allocations raise; torch.cuda.OutOfMemoryError takes the same path) when a batch is too big.
Every request of a split batch is answered, bit for bit as when run alone; only an entry that
fails alone gets InsufficientMemory (507); the batch size ceiling is lowered and shown in
ffn_max_batch_rows. Then the same over HTTP through create_app.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
import torch

from app.config.settings import Settings
from app.engine.batcher import Batcher
from app.engine.errors import InsufficientMemory
from app.engine.runner import ModelRunner
from app.observe.metrics import Metrics
from app.protocol.errors import kind_of
from ffn_core import demo_ffn
from ffn_testing import metric_value
from tests.in_process import InProcessApp

D_MODEL = 512
CEILING = 64


class InjectedOOM:
    """A forward that raises MemoryError above `max_parts` parts or `max_rows` rows, else runs the runner."""

    def __init__(self, runner: ModelRunner, *, max_parts: int | None = None, max_rows: int | None = None) -> None:
        self.runner = runner
        self.max_parts = max_parts
        self.max_rows = max_rows
        self.calls: list[tuple[list[int], bool]] = []  # (rows of each part, ran)

    def __call__(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        sizes = [p.shape[0] for p in parts]
        too_big = (self.max_parts is not None and len(parts) > self.max_parts) or (
            self.max_rows is not None and sum(sizes) > self.max_rows
        )
        self.calls.append((sizes, not too_big))
        if too_big:
            raise MemoryError(f"injected: {len(parts)} parts, {sum(sizes)} rows")
        return self.runner(parts)


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(demo_ffn(), max_batch_rows=CEILING)


def inputs(*rows: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn((n, D_MODEL), generator=generator) for n in rows]


async def run_batcher(
    forward: InjectedOOM, metrics: Metrics, *requests: torch.Tensor, max_wait_s: float = 0.05
) -> list[torch.Tensor | BaseException]:
    """Submit all requests at once (one batch, thanks to the wait) and collect answers or errors."""
    batcher = Batcher(
        forward, name="demo", max_batch_rows=CEILING, max_wait_s=max_wait_s, max_queue_rows=1024, metrics=metrics
    )
    await batcher.start()
    try:
        return await asyncio.gather(*(batcher.submit(x) for x in requests), return_exceptions=True)
    finally:
        await batcher.stop()


def sample(metrics: Metrics, name: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"model": "demo"})


async def test_split_batch_answers_every_request_bit_for_bit(runner: ModelRunner) -> None:
    metrics = Metrics()
    forward = InjectedOOM(runner, max_parts=1)
    xs = inputs(1, 2, 3, 4, 5, 6)
    results = await run_batcher(forward, metrics, *xs)

    assert forward.calls[0] == ([1, 2, 3, 4, 5, 6], False), "the six requests did not form one batch"
    ran = [sizes for sizes, ok in forward.calls if ok]
    assert sorted(ran) == [[n] for n in range(1, 7)], "each request should have run alone in the end"
    for x, y in zip(xs, results, strict=True):
        assert isinstance(y, torch.Tensor), y
        assert torch.equal(y, runner([x])), "an answer after the split differs from the request run alone"
    assert sample(metrics, "ffn_oom_splits_total") == sum(1 for sizes, ok in forward.calls if not ok)
    ceiling = sample(metrics, "ffn_max_batch_rows")
    assert ceiling is not None and ceiling < CEILING
    # Only passes that ran are counted as batches.
    assert sample(metrics, "ffn_batch_rows_count") == 6
    assert sample(metrics, "ffn_batch_rows_sum") == 21


async def test_entry_that_fails_alone_gets_507_and_the_others_are_answered(runner: ModelRunner) -> None:
    metrics = Metrics()
    forward = InjectedOOM(runner, max_rows=4)
    xs = inputs(1, 2, 5, 1, seed=1)
    results = await run_batcher(forward, metrics, *xs)

    assert isinstance(results[2], InsufficientMemory)
    assert (kind_of(results[2]).status, kind_of(results[2]).error_type) == (507, "insufficient_memory")
    for i in (0, 1, 3):
        y = results[i]
        assert isinstance(y, torch.Tensor), y
        # Computed in a smaller batch than alone: the same up to float rounding.
        torch.testing.assert_close(y, runner([xs[i]]), rtol=1e-6, atol=1e-6)
    assert sample(metrics, "ffn_max_batch_rows") <= 4
    assert sample(metrics, "ffn_batch_rows_sum") == 4  # the 5-row entry never ran


async def test_lowered_ceiling_chunks_later_requests(runner: ModelRunner) -> None:
    """After a 6-row request fails alone, the ceiling is 3: the same request again runs as 3 + 3."""
    metrics = Metrics()
    forward = InjectedOOM(runner, max_rows=4)
    batcher = Batcher(forward, name="demo", max_batch_rows=CEILING, max_queue_rows=1024, metrics=metrics)
    (x,) = inputs(6, seed=2)
    await batcher.start()
    try:
        with pytest.raises(InsufficientMemory):
            await batcher.submit(x)
        assert batcher.batch_ceiling == 3
        assert sample(metrics, "ffn_max_batch_rows") == 3
        y = await batcher.submit(x)
    finally:
        await batcher.stop()
    assert torch.equal(y, torch.cat([runner([x[:3]]), runner([x[3:]])]))
    assert [sizes for sizes, ok in forward.calls if ok] == [[3], [3]]


# ----- over HTTP -----------------------------------------------------------------------------


@pytest.fixture
async def served(start_app) -> InProcessApp:
    return await start_app(Settings(warmup=False, max_wait_ms=50.0, max_batch_rows=CEILING))


def inject(served: InProcessApp, monkeypatch: pytest.MonkeyPatch, **limits: int) -> InjectedOOM:
    model = served.app.state.service.engine.model("demo")
    forward = InjectedOOM(model._runner, **limits)
    monkeypatch.setattr(model._batcher, "_forward", forward)
    return forward


async def test_http_request_too_big_alone_is_507(served: InProcessApp, monkeypatch: pytest.MonkeyPatch) -> None:
    client = served.client
    inject(served, monkeypatch, max_rows=4)
    (x,) = inputs(6, seed=3)
    r = await client.post("/v1/models/demo/transform", json={"inputs": x.tolist()})
    assert r.status_code == 507, r.text
    assert r.json()["error_type"] == "insufficient_memory"
    assert set(r.json()) == {"error", "error_type", "request_id"}

    # The ceiling is now 3 rows: the same 6 rows run as two 3-row chunks and are answered.
    v2_body = {"inputs": [{"name": "input", "shape": [6, D_MODEL], "datatype": "FP32", "data": x.ravel().tolist()}]}
    again = await client.post("/v2/models/demo/infer", json=v2_body)
    assert again.status_code == 200, again.text

    inject(served, monkeypatch, max_rows=1)  # tighter: a 2-row request fails alone over V2 too
    v2_body["inputs"][0].update(shape=[2, D_MODEL], data=x[:2].ravel().tolist())
    v2 = await client.post("/v2/models/demo/infer", json=v2_body)
    assert v2.status_code == 507, v2.text
    assert v2.json()["error_type"] == "insufficient_memory"
    page = (await client.get("/metrics")).text
    assert 'ffn_max_batch_rows{model="demo"} 1.0' in page
    assert 'ffn_requests_total{model="demo",outcome="insufficient_memory",protocol="http"} 2.0' in page


async def test_http_split_batch_all_answered(served: InProcessApp, monkeypatch: pytest.MonkeyPatch) -> None:
    client = served.client
    # Over HTTP a batch's rows reach the forward as one part (the doors' arrays are concatenated once
    # per batch): two rows each, and any batch of two or more requests is out of memory.
    forward = inject(served, monkeypatch, max_rows=2)
    xs = inputs(2, 2, 2, seed=4)
    responses = await asyncio.gather(
        *(
            client.post(
                "/v1/models/demo/transform",
                content=x.numpy().tobytes(),
                headers={
                    "content-type": "application/octet-stream",
                    "accept": "application/octet-stream",
                    "x-shape": f"{x.shape[0]},{D_MODEL}",
                },
            )
            for x in xs
        )
    )
    assert any(not ok for _, ok in forward.calls), "no batch of several requests was formed"
    for x, r in zip(xs, responses, strict=True):
        assert r.status_code == 200, r.text
        y = torch.frombuffer(bytearray(r.content), dtype=torch.float32).view(x.shape)
        assert torch.equal(y, forward.runner([x]))
    page = (await client.get("/metrics")).text
    splits = sum(1 for _, ok in forward.calls if not ok)
    assert metric_value(page, "ffn_oom_splits_total", model="demo") == splits
