"""The served models: each one's weights on its device, its runner, its batcher and its status.

A name maps to one ServedModel at a time, a copy of the weights with its own runner, batcher and
version. A reload builds a new copy beside the old and swaps the entry (app/engine/lifecycle.py);
the old copy then `retire`s: it finishes what it admitted, stops and lets its memory go. An
unloaded name keeps an UnloadedModel entry, so that it is still listed (UNAVAILABLE, "unloaded").
"""

from __future__ import annotations

import asyncio
import logging
import warnings
from collections.abc import Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from app.config.settings import ModelSpec, Settings
from app.engine.batcher import Batcher, Settled, answer_as_array, future_as_array, rows_as_tensor
from app.engine.description import ModelDescription, listing
from app.engine.linger import Arrivals
from app.engine.montecarlo import MonteCarloRequest, MonteCarloResult
from app.engine.observe import BatchObserver
from app.engine.repository import Served, WeightsFile, weights_format, weights_path
from app.engine.runner import ModelRunner, device_executor, resolve_device, set_tf32
from app.engine.status import DRAINING, READY, UNLOADED, WARMING, ModelState, ModelStatus
from app.engine.unloaded import UnloadedModel, not_ready_error
from app.observe.metrics import Metrics, ModelInstruments
from ffn_core import FeedForward, FFNConfig, GatedFeedForward, WeightsError, demo_ffn, fuse_gate, load_ffn
from ffn_core.digest import short, weights_digest
from ffn_core.dtypes import DTYPES, DType
from ffn_core.torch_dtypes import TORCH

log = logging.getLogger("ffn_serve")

# torch warns once per process, at the first tensor made from a read-only array (rows viewed in a
# `bytes` body), that it cannot protect it. Request rows are only read: spend that warning here, silently.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    torch.from_numpy(np.frombuffer(bytes(4), dtype=np.float32))


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
        digest: str,
        executor: Executor | None = None,
        version: int = 1,
        source: WeightsFile | None = None,
        inline_forward_s: float = 0.0,
    ) -> None:
        """`digest`: the weights' and table's identity (`model_digest`), which every surface shows.
        `executor`: the device's thread, which warm-up runs on. `source`: the weights file's identity
        when it was read (None: the built-in demo weights). `inline_forward_s`: warm-up times the
        short batches against it (Batcher.inline_rows; 0: none runs on the event loop's thread)."""
        self.spec = spec
        self.version = version
        self.digest = digest
        self.source = source
        self._model = model
        self._runner = runner
        self._batcher = batcher
        self._executor = executor
        self.inline_forward_s = inline_forward_s
        self._state_gauge = metrics.model_state
        # ffn_model_state follows a copy while it is the registry's entry for its name (enter_service),
        # not while it is built beside the serving copy, nor once retired.
        self._in_service = False
        self._retired = False
        self._warming: asyncio.Future[list[int]] | None = None  # the warm-up on its thread, while it runs
        self._status = WARMING  # its weights are loaded already
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
        source = described_source(self.spec, self.source)
        return (
            f"{self.name}: {config.variant}, d_model {config.d_model}, d_ff {config.d_ff}, {self.spec.dtype} "
            f"on {self.device}, {count:,} parameters ({size / 2**20:.1f} MiB), from {source}, digest {short(self.digest)}"
        )

    def description(self) -> ModelDescription:
        """What this copy is, as the engine knows it (the fronts' table carries it)."""
        config = self._model.config
        return ModelDescription(
            name=self.name,
            version=self.version,
            digest=self.digest,
            d_model=config.d_model,
            d_ff=config.d_ff,
            activation=config.activation,
            gated=config.gated,
            variant=config.variant,
            bias_layer1=config.bias1,
            bias_layer2=config.bias2,
            bias_gate=config.bias_gate if config.gated else None,
            dropout=self.dropout,
            dtype=self.spec.dtype,
            device=str(self.device),
            format="demo" if self.source is None else weights_format(self.spec, Path(self.source.path)),
            weight_bytes=self.weight_bytes,
        )

    def describe(self) -> dict[str, Any]:
        """The model as GET /v1/models lists it."""
        return listing(self.description(), self.status)

    @property
    def served(self) -> Served:
        """The table and the file identity this copy was loaded from (what SIGHUP compares)."""
        return Served(self.spec, self.source)

    # ----- its status ------------------------------------------------------------------------

    @property
    def status(self) -> ModelStatus:
        return self._status

    def _set_status(self, status: ModelStatus) -> None:
        """The one place a model's state changes; ffn_model_state follows it while this copy is in service."""
        self._status = status
        if not self._in_service:
            return
        for state in ModelState:
            self._state_gauge.labels(model=self.name, state=state.value).set(1 if state is status.state else 0)

    def enter_service(self) -> None:
        """This copy is now the registry's entry for its name: every surface, the gauge too, reads it."""
        self._in_service = True
        self._set_status(self._status)

    def warmed_up(self) -> None:
        if self._status.state is ModelState.LOADING:
            self._set_status(READY)

    def draining(self) -> None:
        if self._status.state is not ModelState.UNAVAILABLE:
            self._set_status(DRAINING)

    def unloaded(self) -> None:
        """Unloaded: listed UNAVAILABLE ("unloaded"), and a request still on its way here answers 404."""
        self._set_status(UNLOADED)

    # ----- its life, driven by the Engine ----------------------------------------------------

    async def start(self) -> None:
        await self._batcher.start()

    async def warm_up(self, enabled: bool, *, executor: Executor | None = None) -> None:
        """Run every batch-size bucket once (unless not `enabled`), time the short ones, then turn READY.

        On the device's thread, or on `executor` (a new copy on the CPU warming up beside the one
        serving, so that the serving copy's batches do not wait behind it).
        """
        if enabled and not self._retired:
            self._warming = asyncio.get_running_loop().run_in_executor(executor or self._executor, self._runner.warm_up)
            try:
                sizes = await self._warming
            finally:
                self._warming = None
            log.info("model %s version %d warm at batch sizes %s", self.name, self.version, sizes)
        if self.inline_forward_s > 0 and not self._retired:
            rows = await asyncio.get_running_loop().run_in_executor(
                executor or self._executor, self._runner.inline_rows, self.inline_forward_s
            )
            self._batcher.inline_rows = rows
            log.info(
                "model %s version %d: batches of up to %d rows run on the event loop's thread (inline_forward_us %g)",
                self.name,
                self.version,
                rows,
                self.inline_forward_s * 1e6,
            )
        self.warmed_up()

    async def drain(self, timeout_s: float) -> bool:
        """Turn UNAVAILABLE, then wait up to `timeout_s` for the accepted work. True if it finished."""
        self.draining()
        return await self._batcher.drain(timeout_s)

    async def stop(self) -> None:
        """Answer whatever is still pending 503."""
        await self._batcher.stop()

    async def retire(self, timeout_s: float) -> bool:
        """Leave service for good (its successor, if any, owns the name): finish the admitted work
        within `timeout_s` (the rest is answered 503), stop, and let the weights go. True if all finished.

        No new request can reach a retired copy: a request looks its model up after its body has
        been read, and nothing awaits between that lookup and the admission to the batcher.
        """
        self._in_service, self._retired = False, True
        self._batcher.on_failure = None  # the lambda refers back to this object: no cycle left behind
        finished = await self._batcher.drain(timeout_s)
        await self._batcher.stop()
        if self._warming is not None:  # replaced while warming up (a worker's replayed load): let that end first
            await asyncio.wait([self._warming])
        self._runner.release()
        return finished

    def computed_rows(self, rows: int) -> int:
        """The rows the device computes for a batch of `rows`: its padded bucket where batches are padded."""
        return self._runner.computed_rows(rows)

    def set_observer(self, observer: BatchObserver | None) -> None:
        """Tell `observer` of every batch and Monte Carlo slice this model runs (the tracing's hook)."""
        self._batcher.observer = observer

    # ----- its work --------------------------------------------------------------------------

    def check_serving(self) -> None:
        """Refuse new work unless READY: warming up, draining, or its batcher gone (503, with why); unloaded (404)."""
        status = self._status
        if not status.ready:
            raise not_ready_error(self.name, status)

    async def infer(self, rows: np.ndarray, answer_dtype: DType, *, deadline: float | None) -> np.ndarray:
        """The FFN of `rows`, batched with other requests' rows, as an array carrying `answer_dtype`.

        `rows`: (n, d_model), C-contiguous, carrying float32, float16 or bfloat16 (ffn_core/dtypes.py:
        bfloat16 as uint16 patterns); read in place, never written. The answer: (n, d_model), a view
        of the batch's output when it is in `answer_dtype` already, else converted as torch rounds.
        """
        return await self.infer_soon(rows, answer_dtype, deadline=deadline)

    def infer_soon(
        self,
        rows: np.ndarray,
        answer_dtype: DType,
        *,
        deadline: float | None,
        requests: Sequence[int] | None = None,
        settled: Settled | None = None,
    ) -> asyncio.Future[np.ndarray]:
        """`infer` without a coroutine: refused (raising) or queued now; the answer's future.

        Cancelling the future withdraws the rows. `requests`: the row counts of several requests
        whose rows `rows` holds back to back, each counted as a request (Batcher.submit_soon). For
        a caller with a turn's worth of requests (the hand-off's engine, the HTTP door's lean path),
        so that it pays no task per request. `settled`: told once the future is done, at once by the
        batch that answers it (Batcher.submit_array).
        """
        self.check_serving()
        if requests is None:
            return self._batcher.submit_array(rows, answer_dtype, deadline=deadline, settled=settled)
        computed = self._batcher.submit_soon(rows_as_tensor(rows), deadline=deadline, requests=requests)
        converted = future_as_array(computed, answer_dtype)
        if settled is not None:
            converted.add_done_callback(settled)
        return converted

    async def infer_monte_carlo(
        self, rows: np.ndarray, request: MonteCarloRequest, answer_dtype: DType, *, deadline: float | None
    ) -> MonteCarloResult:
        """Mean and std of a Monte Carlo dropout request's passes over `rows` (as `infer` takes them), in `answer_dtype`."""
        self.check_serving()
        moments = await self._batcher.submit_monte_carlo(rows_as_tensor(rows), request, deadline=deadline)
        return MonteCarloResult(answer_as_array(moments.mean, answer_dtype), answer_as_array(moments.std, answer_dtype))


def described_source(spec: ModelSpec, source: WeightsFile | None = None) -> str:
    """Where a model's weights come from, for the log: the file, the Hub repository (and its file), or the demo."""
    if spec.hf_model is not None:
        where = f"{spec.hf_model}@{spec.revision or 'main'} (Hugging Face Hub)"
        return f"{where}, {source.path}" if source is not None else where
    return str(spec.weights) if spec.weights else "built-in demo weights"


def read_weights(spec: ModelSpec, path: Path | None = None) -> FeedForward:
    """The spec's weights read into host memory, in its dtype: from `path` (where weights_path found them),
    else from where the spec says; the built-in demo weights when it names no file and no hf_model."""
    dtype = TORCH[spec.dtype]
    if path is None:
        path = weights_path(spec)
    if path is None:
        return demo_ffn().to(dtype=dtype).requires_grad_(False)
    return load_ffn(
        path,
        format=weights_format(spec, path),
        layer=spec.layer,
        activation=spec.activation,
        gated=spec.gated,
        dtype=dtype,
        device="cpu",
    )


def model_digest(spec: ModelSpec, model: FeedForward) -> str:
    """The identity of a copy (ffn_core/digest.py): its tensors as read into host memory, before they
    are placed or the gate fused, and the table that says how they compute: the FFN's config, the
    dropout rate it serves and its dtype. Not its name, file path, format or device: replicas that
    read the same weights from other paths, onto other devices, show the same digest."""
    config = model.config
    dropout = spec.dropout if spec.dropout is not None else config.dropout
    return weights_digest(model.state_dict(), {**config.to_dict(), "dropout": dropout, "dtype": spec.dtype})


def place(model: FeedForward, device: torch.device, *, fuse: bool = False) -> FeedForward:
    """The weights on `device`; gated ones with W1‖V fused when `fuse`."""
    model = model.to(device)
    return fuse_gate(model) if fuse and isinstance(model, GatedFeedForward) else model


def load_weights(
    spec: ModelSpec, device: torch.device, *, fuse: bool = False, path: Path | None = None
) -> tuple[FeedForward, str]:
    """The model's weights (from `path`, if given) on `device` in its dtype (gated ones with W1‖V fused when
    `fuse`), and their digest."""
    host = read_weights(spec, path)
    digest = model_digest(spec, host)
    return place(host, device, fuse=fuse), digest


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
    """Name -> ServedModel (and the names unloaded), plus one executor thread per device shared by its models."""

    def __init__(self, settings: Settings, metrics: Metrics, device: str | None = None) -> None:
        """`device`: where every model is computed, whatever its table says (an engine process of `devices`)."""
        self.settings = settings
        self.metrics = metrics
        self.device = device
        self._instruments: dict[str, ModelInstruments] = {}
        self.models: dict[str, ServedModel] = {}
        self.unloaded: dict[str, UnloadedModel] = {}
        self.executors: dict[str, ThreadPoolExecutor] = {}
        # Requests this process's doors have begun to receive: every batcher lingers for them (linger.py).
        self.arrivals = Arrivals()

    def load(self) -> None:
        """Load every configured model as version 1; the first that fails raises ModelLoadError."""
        s = self.settings
        set_tf32(s.tf32)
        for spec in s.served_models():
            what = described_source(spec)
            try:
                device = self.device_of(spec)
                path = weights_path(spec)
                source = None if path is None else WeightsFile.of(path)
                model, digest = load_weights(spec, device, fuse=s.fuse_gate, path=path)
            except WeightsError as exc:  # its message already names the file
                raise ModelLoadError(f"model {spec.name!r}: {exc}") from exc
            except (ValueError, OSError) as exc:
                raise ModelLoadError(f"model {spec.name!r}: cannot load {what}: {exc}") from exc
            served = self.build(spec, model, version=1, source=source, digest=digest)
            self.serve(served)
            log.info("loaded model %s", served.summary())

    def device_of(self, spec: ModelSpec) -> torch.device:
        """Where `spec`'s model is computed: this registry's device if it has one, else the table's.
        ValueError if it names a GPU that is not there."""
        return resolve_device(self.device or spec.device)

    def build(
        self, spec: ModelSpec, model: FeedForward, *, version: int, source: WeightsFile | None, digest: str
    ) -> ServedModel:
        """A ServedModel around weights already on their device: its runner and batcher, not yet started."""
        s = self.settings
        executor = self.executor(next(model.parameters()).device)
        runner = build_runner(model, s)
        batcher = Batcher(
            runner,
            name=spec.name,
            max_batch_rows=s.max_batch_rows,
            max_wait_s=s.max_wait_ms / 1000.0,
            linger_s=s.batch_linger_ms / 1000.0,
            arrivals=self.arrivals,
            max_queue_rows=s.max_queue_rows,
            executor=executor,
            instruments=self.instruments(spec.name),
            # Staged: the next batch is launched while the last one computes (double-buffered).
            launch=runner.launch if runner.staged else None,
            max_in_flight=2,
            monte_carlo=runner.start_monte_carlo,
        )
        return ServedModel(
            spec,
            model,
            runner,
            batcher,
            self.metrics,
            digest=digest,
            executor=executor,
            version=version,
            source=source,
            inline_forward_s=s.inline_forward_us / 1e6,
        )

    def instruments(self, name: str) -> ModelInstruments:
        """A model's instruments, bound once per name: every copy a reload builds uses the same series."""
        bound = self._instruments.get(name)
        if bound is None:
            bound = self._instruments[name] = self.metrics.for_model(name)
        return bound

    def executor(self, device: torch.device) -> ThreadPoolExecutor:
        """The one thread that runs `device`'s work, shared by every model on it."""
        if str(device) not in self.executors:
            self.executors[str(device)] = device_executor(device)
        return self.executors[str(device)]

    def serve(self, served: ServedModel) -> ServedModel | None:
        """Serve `served` under its name from now on; the copy it replaces, if any (to be retired)."""
        previous = self.models.get(served.name)
        self.models[served.name] = served
        self.unloaded.pop(served.name, None)
        served.enter_service()
        self.metrics.model_version.labels(model=served.name).set(served.version)
        if previous is not None:
            self._info_gone(previous)
        self.metrics.model_info.labels(model=served.name, version=str(served.version), digest=served.digest).set(1)
        return previous

    def unload(self, name: str) -> ServedModel:
        """Serve nothing under `name` from now on (it is listed as unloaded); the copy, to be retired."""
        served = self.models.pop(name)
        served.unloaded()
        self.unloaded[name] = UnloadedModel(served)
        self.metrics.model_version.labels(model=name).set(0)
        self._info_gone(served)
        return served

    def forget(self, name: str) -> None:
        """`name` is no model of the service any more (no [[models]] table names it, and it is unloaded):
        it leaves the lists (the repository index, GET /v1/models) and /metrics."""
        self.unloaded.pop(name, None)
        self._instruments.pop(name, None)
        self.metrics.forget_model(name)

    def _info_gone(self, served: ServedModel) -> None:
        """ffn_model_info drops a copy no longer served: its series goes (with workers, whose files keep
        every series written, it reads 0)."""
        labels = {"model": served.name, "version": str(served.version), "digest": served.digest}
        self.metrics.model_info.labels(**labels).set(0)
        self.metrics.model_info.remove(*labels.values())

    def shutdown_executors(self) -> None:
        for executor in self.executors.values():
            executor.shutdown(wait=False, cancel_futures=True)
