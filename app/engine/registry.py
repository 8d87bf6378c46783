"""The served models: each one's weights on its device, its runner and its batcher."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from app.engine.batcher import Batcher
from app.engine.errors import ModelNotFound
from app.engine.montecarlo import MonteCarloLane
from app.engine.runner import ModelRunner, device_executor, resolve_device, set_tf32
from app.metrics import Metrics
from app.settings import ModelSpec, Settings
from ffn_core import FeedForward, GatedFeedForward, WeightsError, demo_ffn, fuse_gate, load_ffn
from ffn_core.dtypes import DTYPES, DType

log = logging.getLogger("ffn_serve")


class ModelLoadError(RuntimeError):
    """A configured model could not be loaded; the message names the model, the file and the reason."""


@dataclass
class ServedModel:
    spec: ModelSpec
    model: FeedForward
    runner: ModelRunner
    batcher: Batcher
    monte_carlo: MonteCarloLane
    warm: bool = False

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def d_model(self) -> int:
        return self.model.config.d_model

    @property
    def dropout(self) -> float:
        """The hidden-layer dropout rate of Monte Carlo dropout requests: the config's, else the file's."""
        return self.spec.dropout if self.spec.dropout is not None else self.model.config.dropout

    @property
    def dtype(self) -> DType:
        """The compute dtype: the wire dtype of answers that ask for none."""
        return DTYPES[self.spec.dtype]

    @property
    def weight_bytes(self) -> int:
        """The weights' size on their device (the start-up log and V2 statistics' memory_usage)."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def summary(self) -> str:
        """One line for the start-up log: sizes, variant, dtype, device, memory and source."""
        config = self.model.config
        count = sum(p.numel() for p in self.model.parameters())
        size = self.weight_bytes
        source = str(self.spec.weights) if self.spec.weights else "built-in demo weights"
        return (
            f"{self.name}: {config.variant}, d_model {config.d_model}, d_ff {config.d_ff}, {self.spec.dtype} "
            f"on {self.runner.device}, {count:,} parameters ({size / 2**20:.1f} MiB), from {source}"
        )

    def describe(self) -> dict[str, Any]:
        config = self.model.config
        return {
            "name": self.name,
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
            "device": str(self.runner.device),
            "format": self.spec.format if self.spec.weights else "demo",
            "ready": self.warm,
        }


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
            )
            monte_carlo = MonteCarloLane(
                model,
                executor=executor,
                instruments=self.metrics.for_model(spec.name),
                max_rows=s.max_batch_rows,
                max_queue_rows=s.max_queue_rows,
            )
            served = ServedModel(spec, model, runner, batcher, monte_carlo)
            self.models[spec.name] = served
            log.info("loaded model %s", served.summary())

    def get(self, name: str) -> ServedModel:
        try:
            return self.models[name]
        except KeyError:
            raise ModelNotFound(f"model {name[:100]!r} is not served here; GET /v1/models lists the models") from None

    @property
    def ready(self) -> bool:
        return bool(self.models) and all(m.warm and m.batcher.accepting for m in self.models.values())

    def shutdown_executors(self) -> None:
        for executor in self.executors.values():
            executor.shutdown(wait=False, cancel_futures=True)
