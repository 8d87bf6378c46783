"""`ffn-serve --check`: the deployment's smoke test, in this process, serving nothing.

Every configured model is loaded and warmed up as the server would (the same registry and engine;
with `devices`, on each of them in turn), then asked one request through the engine's facade,
`ServedModel.infer`, as the doors ask it; the answer must have the request's rows and the model's
width, and be finite. For a user after an
install, a CI job after a build, or an image (`docker run --rm IMAGE --check`): exit 0 with one
line per model on stdout, or one line on stderr saying what failed and exit 2. No port is bound.
"""

from __future__ import annotations

import asyncio
import sys

import numpy as np

from app.config.settings import Settings
from app.engine.registry import ModelLoadError, Registry
from app.engine.service import Engine, ServedModel
from app.observe.metrics import Metrics
from app.process.exits import EXIT_BAD_SETTINGS, EXIT_OK
from ffn_core.dtypes import DTYPES

CHECK_ROWS = 4  # the rows of each model's request: more than one, so that a row mix-up would show
PREFIX = "ffn-serve --check"


class CheckFailed(Exception):
    """What failed, in one line."""


def check(settings: Settings) -> int:
    """Run the check; 0 with a line per model on stdout, or one line on stderr and 2."""
    try:
        lines = asyncio.run(_check(settings.model_copy(update={"warmup": True})))
    except CheckFailed as failed:
        print(f"{PREFIX}: {failed}", file=sys.stderr)
        return EXIT_BAD_SETTINGS
    for line in lines:
        print(f"{PREFIX}: {line}")
    return EXIT_OK


async def _check(settings: Settings) -> list[str]:
    """Every model on each engine's device (`devices`, one after the other), or where its table says."""
    lines = []
    for device in dict.fromkeys(settings.devices) or [None]:  # a device named twice is checked once
        lines += await _check_on(settings, device)
    return lines


async def _check_on(settings: Settings, device: str | None) -> list[str]:
    registry = Registry(settings, Metrics(), device=device)
    try:
        await asyncio.to_thread(registry.load)
    except ModelLoadError as exc:
        raise CheckFailed(str(exc)) from None
    engine = Engine(settings, registry)
    await engine.start()
    try:
        try:
            await engine.until_warm()
        except Exception as exc:  # a warm-up that raised: the server would not turn ready either
            raise CheckFailed(f"warming up failed: {type(exc).__name__}: {exc}") from None
        return [await _ask(served) for served in engine.models()]
    finally:
        await engine.stop()


async def _ask(served: ServedModel) -> str:
    """One request of CHECK_ROWS rows through the facade; its answer checked. The line that says so."""
    if not served.status.ready:
        raise CheckFailed(f"model {served.name!r} is not ready after its warm-up: {served.status.reason}")
    rows = np.random.default_rng(0).standard_normal((CHECK_ROWS, served.d_model), dtype=np.float32)
    try:
        answer = await served.infer(rows, DTYPES["float32"], deadline=None)
    except Exception as exc:
        raise CheckFailed(f"model {served.name!r} failed a request of {CHECK_ROWS} rows: {exc}") from None
    expected = (CHECK_ROWS, served.d_model)
    if tuple(answer.shape) != expected:
        raise CheckFailed(
            f"model {served.name!r} answered {CHECK_ROWS} rows with shape {list(answer.shape)}, not {list(expected)}"
        )
    bad = answer.size - int(np.isfinite(answer).sum())
    if bad:
        raise CheckFailed(
            f"model {served.name!r} answered {CHECK_ROWS} rows of standard normal input with {bad} of "
            f"{answer.size} values not finite (NaN or ±inf)"
        )
    return f"{served.summary()}: warm, answered {CHECK_ROWS} rows, {list(answer.shape)}, finite; {served.digest}"
