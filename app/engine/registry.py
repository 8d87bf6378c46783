"""The served models: each one's weights on its device, its runner, its batcher and its status."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any

import torch

from app.engine.batcher import Batcher
from app.engine.errors import Unavailable
from app.engine.montecarlo import MonteCarloRequest, MonteCarloResult
from app.engine.observe import BatchObserver
from app.engine.runner import ModelRunner, device_executor, resolve_device, set_tf32
from app.engine.status import READY, ModelState, ModelStatus
from app.metrics import Metrics
from app.settings import ModelSpec, Settings
from ffn_core import FeedForward, FFNConfig, GatedFeedForward, WeightsError, demo_ffn, fuse_gate, load_ffn
from ffn_core.dtypes import DTYPES, DType

log = logging.getLogger("ffn_serve")


class ModelLoadError(RuntimeError):
    """A configured model could not be loaded; the message names the model, the file and the reason."""


class ServedModel:
    """One served model: its weights on their device, its runner and batcher, and its one status.

    The edge reads its description and status and sends it work (`check_serving`, `infer`,
    `infer_monte_carlo`); the runner and the batcher are the engine's own.
    """

    def __init__(
        self,
        spec: ModelSpec,
        model: FeedForward,
        runner: ModelRunner,
        batcher: Batcher,
        metrics: Metrics,
        *,
        executor: Executor | None = None,
        version: int = 1,
    ) -> None:
        """`executor`: the device's thread, which warm-up runs on."""
        self.spec = spec
        self.version = version
        self._model = model
        self._runner = runner
        self._batcher = batcher
        self._executor = executor
        self._state_gauge = metrics.model_state
        self._status = ModelStatus(ModelState.LOADING, "warming up")  # its weights are loaded already
        self._set_status(self._status)
        batcher.on_failure = lambda reason: self._set_status(ModelStatus(ModelState.UNAVAILABLE, reason))

    # ----- what it is ------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def config(self) -> FFNConfig:
        return self._model.config

    @property
    def d_model(self) -> int:
        return self._model.config.d_model

    @property
    def device(self) -> torch.device:
        return self._runner.device

    @property
    def dropout(self) -> float:
        """The hidden-layer dropout rate of Monte Carlo dropout requests: the config's, else the file's."""
        return self.spec.dropout if self.spec.dropout is not None else self._model.config.dropout

    @property
    def dtype(self) -> DType:
        """The compute dtype: the wire dtype of answers that ask for none."""
        return DTYPES[self.spec.dtype]

    @property
    def weight_bytes(self) -> int:
        """The weights' size on their device (the start-up log and V2 statistics' memory_usage)."""
        return sum(p.numel() * p.element_size() for p in self._model.parameters())

    def summary(self) -> str:
        """One line for the start-up log: sizes, variant, dtype, device, memory and source."""
        config = self._model.config
        count = sum(p.numel() for p in self._model.parameters())
        size = self.weight_bytes
        source = str(self.spec.weights) if self.spec.weights else "built-in demo weights"
        return (
            f"{self.name}: {config.variant}, d_model {config.d_model}, d_ff {config.d_ff}, {self.spec.dtype} "
            f"on {self.device}, {count:,} parameters ({size / 2**20:.1f} MiB), from {source}"
        )

    def describe(self) -> dict[str, Any]:
        """The model as GET /v1/models lists it."""
        config = self._model.config
        status = self.status
        return {
            "name": self.name,
            "version": self.version,
            "d_model": config.d_model,
            "d_ff": config.d_ff,
            "activation": config.activation,
            "gated": config.gated,
            "variant": config.variant,
            "bias": {
                "layer1": config.bias1,
                "layer2": config.bias2,
                "linear_v": config.bias_gate if config.gated else None,
            },
            "dropout": self.dropout,
            "dtype": self.spec.dtype,
            "device": str(self.device),
            "format": self.spec.format if self.spec.weights else "demo",
            "ready": status.ready,
            "state": status.state.value,
            "reason": status.reason,
        }

    # ----- its status ------------------------------------------------------------------------

    @property
    def status(self) -> ModelStatus:
        return self._status

    def _set_status(self, status: ModelStatus) -> None:
        """The one place a model's state changes; ffn_model_state follows it."""
        self._status = status
        for state in ModelState:
            self._state_gauge.labels(model=self.name, state=state.value).set(1 if state is status.state else 0)

    def warmed_up(self) -> None:
        if self._status.state is ModelState.LOADING:
            self._set_status(READY)

    def draining(self) -> None:
        if self._status.state is not ModelState.UNAVAILABLE:
            self._set_status(ModelStatus(ModelState.UNAVAILABLE, "draining before shutdown"))

    # ----- its life, driven by the Engine ----------------------------------------------------

    async def start(self) -> None:
        await self._batcher.start()

    async def warm_up(self, enabled: bool) -> None:
        """Run every batch-size bucket once on the device thread (unless not `enabled`), then turn READY."""
        if enabled:
            sizes = await asyncio.get_running_loop().run_in_executor(self._executor, self._runner.warm_up)
            log.info("model %s warm at batch sizes %s", self.name, sizes)
        self.warmed_up()

    async def drain(self, timeout_s: float) -> bool:
        """Turn UNAVAILABLE, then wait up to `timeout_s` for the accepted work. True if it finished."""
        self.draining()
        return await self._batcher.drain(timeout_s)

    async def stop(self) -> None:
        """Answer whatever is still pending 503."""
        await self._batcher.stop()

    def computed_rows(self, rows: int) -> int:
        """The rows the device computes for a batch of `rows`: its padded bucket where batches are padded."""
        return self._runner.computed_rows(rows)

    def set_observer(self, observer: BatchObserver | None) -> None:
        """Tell `observer` of every batch and Monte Carlo slice this model runs (the tracing's hook)."""
        self._batcher.observer = observer

    # ----- its work --------------------------------------------------------------------------

    def check_serving(self) -> None:
        """Refuse new work unless READY: warming up, draining, or its batcher gone (503, with why)."""
        status = self._status
        if not status.ready:
            raise Unavailable(f"model {self.name!r} is not ready: {status.reason}")

    async def infer(self, rows: torch.Tensor, *, deadline: float | None) -> torch.Tensor:
        """The FFN of `rows` (n, d_model), batched with other requests' rows."""
        self.check_serving()
        return await self._batcher.submit(rows, deadline=deadline)

    async def infer_monte_carlo(
        self, rows: torch.Tensor, request: MonteCarloRequest, *, deadline: float | None
    ) -> MonteCarloResult:
        """Mean and std of a Monte Carlo dropout request's passes over `rows` (n, d_model)."""
        self.check_serving()
        return await self._batcher.submit_monte_carlo(rows, request, deadline=deadline)


def load_weights(spec: ModelSpec, device: torch.device, *, fuse: bool = False) -> FeedForward:
    """The model's weights on `device` in its dtype; gated ones with W1‖V fused when `fuse`."""
    dtype = DTYPES[spec.dtype].torch
    if spec.weights is None:
        model = demo_ffn().to(device=device, dtype=dtype).requires_grad_(False)
    else:
        model = load_ffn(
            spec.weights,
            format=spec.format,
            layer=spec.layer,
            activation=spec.activation,
            gated=spec.gated,
            dtype=dtype,
            device=device,
        )
    return fuse_gate(model) if fuse and isinstance(model, GatedFeedForward) else model


def build_runner(model: FeedForward, settings: Settings) -> ModelRunner:
    """The model's runner with the GPU path's switches from the settings."""
    return ModelRunner(
        model,
        max_batch_rows=settings.max_batch_rows,
        staging={"auto": None, "on": True, "off": False}[settings.staging],
        cuda_graphs=settings.cuda_graphs,
        tf32=settings.tf32,
        batch_invariant_rows=settings.batch_invariant_rows if settings.batch_invariant else None,
    )


class Registry:
    """Name -> ServedModel, plus one executor thread per device shared by that device's models."""

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.models: dict[str, ServedModel] = {}
        self.executors: dict[str, ThreadPoolExecutor] = {}

    def load(self) -> None:
        """Load every configured model; the first that fails raises ModelLoadError."""
        s = self.settings
        set_tf32(s.tf32)
        for spec in s.served_models():
            source = str(spec.weights) if spec.weights else "built-in demo weights"
            try:
                device = resolve_device(spec.device)
                model = load_weights(spec, device, fuse=s.fuse_gate)
            except WeightsError as exc:  # its message already names the file
                raise ModelLoadError(f"model {spec.name!r}: {exc}") from exc
            except (ValueError, OSError) as exc:
                raise ModelLoadError(f"model {spec.name!r}: cannot load {source}: {exc}") from exc
            executor = self.executors.setdefault(str(device), device_executor(device))
            runner = build_runner(model, s)
            batcher = Batcher(
                runner,
                name=spec.name,
                max_batch_rows=s.max_batch_rows,
                max_wait_s=s.max_wait_ms / 1000.0,
                max_queue_rows=s.max_queue_rows,
                executor=executor,
                metrics=self.metrics,
                # Staged: the next batch is launched while the last one computes (double-buffered).
                launch=runner.launch if runner.staged else None,
                max_in_flight=2,
                monte_carlo=runner.start_monte_carlo,
            )
            served = ServedModel(spec, model, runner, batcher, self.metrics, executor=executor)
            self.models[spec.name] = served
            log.info("loaded model %s", served.summary())

    def shutdown_executors(self) -> None:
        for executor in self.executors.values():
            executor.shutdown(wait=False, cancel_futures=True)
