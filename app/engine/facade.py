"""The engine as the doors see it: what they read of it and send it, and no torch.

`app/engine/service.py: Engine` and the `ServedModel`s it hands out (`app/engine/registry.py`) are
what `app/main.py` wires in; these protocols are all that the doors (app.http, app.grpc) and the
protocol core (app.protocol) know of them, so that those run in processes that never import torch
(tests/test_layers.py). mypy holds the engine to them where app/main.py hands it to the doors.

Rows cross as numpy arrays: (n, d_model), C-contiguous, carrying float32, float16 or bfloat16
(as its uint16 patterns; ffn_core/dtypes.py), read in place and never written. The answer comes
back as an array carrying the dtype asked for, converted on the engine's side when it differs
from the batch's; a Monte Carlo answer is its mean and std so (app/engine/montecarlo.py).
Errors are app/engine/errors.py's kinds, statuses app/engine/status.py's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from app.config.settings import Settings
from app.engine.montecarlo import MonteCarloRequest, MonteCarloResult
from app.engine.status import ModelStatus
from ffn_core.dtypes import DType

if TYPE_CHECKING:  # a type only: app.observe.collectors imports torch within its readers (pyproject: no torch here)
    from app.observe.collectors import GpuReading


class Device(Protocol):
    """Where a model computes (a torch.device is one): "cpu" or "cuda", and its index."""

    @property
    def type(self) -> str: ...

    @property
    def index(self) -> int | None: ...


class FFNShape(Protocol):
    """What the doors read of a model's FFNConfig (ffn_core/config.py)."""

    @property
    def d_ff(self) -> int: ...

    @property
    def activation(self) -> str: ...

    @property
    def gated(self) -> bool: ...

    @property
    def variant(self) -> str: ...


class ListedModel(Protocol):
    """A model as a list shows it: one served, or one unloaded while serving (app/engine/unloaded.py)."""

    @property
    def name(self) -> str: ...

    @property
    def version(self) -> int: ...

    @property
    def digest(self) -> str: ...

    @property
    def status(self) -> ModelStatus: ...

    def describe(self) -> dict[str, Any]:
        """The model as GET /v1/models lists it."""
        ...


class ModelFacade(ListedModel, Protocol):
    """A served model: its description, and the work it takes."""

    @property
    def d_model(self) -> int: ...

    @property
    def dtype(self) -> DType:
        """The compute dtype."""
        ...

    @property
    def dropout(self) -> float:
        """The dropout rate of its Monte Carlo dropout requests."""
        ...

    @property
    def config(self) -> FFNShape: ...

    @property
    def device(self) -> Device: ...

    @property
    def weight_bytes(self) -> int: ...

    def check_serving(self) -> None:
        """Refuse new work unless READY (Unavailable; ModelNotFound once unloaded)."""
        ...

    async def infer(self, rows: np.ndarray, answer_dtype: DType, *, deadline: float | None) -> np.ndarray:
        """The FFN of `rows` as an array carrying `answer_dtype`; `deadline` in loop.time() seconds."""
        ...

    def infer_soon(
        self,
        rows: np.ndarray,
        answer_dtype: DType,
        *,
        deadline: float | None,
        settled: Callable[[asyncio.Future[np.ndarray]], None] | None = None,
    ) -> asyncio.Future[np.ndarray]:
        """`infer` without a coroutine: refused (raising) or sent now; the answer's future, which a caller
        with no task per request waits on (the HTTP door's lean path). Cancelling it withdraws the rows.
        `settled`: called once with the future when it is done; where the batch runs in this process,
        at once from the batch's completion, else as a done-callback."""
        ...

    async def infer_monte_carlo(
        self, rows: np.ndarray, request: MonteCarloRequest, answer_dtype: DType, *, deadline: float | None
    ) -> MonteCarloResult:
        """Mean and std of a Monte Carlo dropout request's passes over `rows`, carrying `answer_dtype`."""
        ...


class EngineFacade(Protocol):
    """The served models, looked up by name; the server's readiness; model control."""

    def model(self, name: str, version: str | None = None) -> ModelFacade:
        """The model served as `name` (and `version`); ModelNotFound (404) if none."""
        ...

    def models(self) -> Sequence[ModelFacade]: ...

    def listed(self) -> Sequence[ListedModel]:
        """Every model a list shows: served, then unloaded."""
        ...

    def readiness(self) -> ModelStatus: ...

    @property
    def ready(self) -> bool: ...

    @property
    def cuda_available(self) -> bool:
        """Whether this server sees a CUDA device (what CUDA shared memory's refusal says)."""
        ...

    def gpus(self) -> list[GpuReading]:
        """The GPUs the models compute on, as a scrape shows them (ffn_gpu_memory_*, nv_gpu_*)."""
        ...

    async def load(self, name: str, config: str | None = None) -> dict[str, Any]: ...

    async def unload(self, name: str) -> dict[str, Any]: ...

    def count_refused_load(self, name: str) -> None:
        """Count a load of `name` refused before any worker heard of it."""
        ...


class ServingEngine(EngineFacade, Protocol):
    """The engine as a serving process runs it (app/main.py's lifespan, app/process/server.py's signals): the
    in-process Engine (app/engine/service.py), or a front's RemoteEngine (app/handoff/remote.py)."""

    @property
    def settings(self) -> Settings: ...

    @property
    def batches_here(self) -> bool:
        """Whether this process forms the models' batches (the tracing observes them where it does)."""
        ...

    async def start(self) -> None: ...

    async def until_warm(self) -> None:
        """Return once ready to serve (or the start was stopped)."""
        ...

    def stop_starting(self) -> None: ...

    async def drain(self) -> bool:
        """Take no new work, finish what was accepted; True if it all finished within the drain timeout."""
        ...

    async def stop(self) -> None: ...

    async def apply_config_file(self) -> None:
        """SIGHUP: the config file's [[models]] again."""
        ...

    def on_serving(self, prepare: Callable[[Any], None], *, once_per_name: bool = False) -> None:
        """Call `prepare(model)` for each model serving now and each one that starts serving later."""
        ...
