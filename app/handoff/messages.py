"""The control messages between a front and an engine, typed, and the engine's errors as data.

Each message is a struct read by field name on both sides (as vLLM's request structs are), and
crosses as a compact MessagePack array: its tag, then its fields in the order written here
(frames.py encodes a turn's messages as one list). Adding a field at the end of a message keeps
older fields where they were; every field is typed, and a frame that does not decode as these
types ends the connection.

Front to engine:
- Hello: the first message of a connection: how the memory it handed over as it began (frames.py's
  `send_memory`) is cut into slots, and how large its large area is (arena.py).
- Submit: one request, its rows in the slot whose header is at `place` in the block, with `room`
  bytes after it (a small slot, or a large one of its own size: rows never travel in a message);
  `deadline` is time.monotonic() seconds (one clock for every process of a host) or None. Dtypes are ffn_core/dtypes.py's names.
  `request_id` is the request's (X-Request-Id, or the one it was given), which the engine's batch
  spans list, or None for a call that came with no request context; `trace` is a traced request's
  span context, which the engine's batch spans link to (app/tracing/spans.py).
- Cancel: its client left; the engine answers it anyway, Failed or Done.
- Control: model control, as the engine facade's: "load" (name, config), "unload" (name),
  answered Reply or Failed; "refused_load" (name), counted, not answered (ask 0).

Engine to front:
- Done: the answer is in the request's slot under its generation; a Monte Carlo answer is its mean
  then its std. `rides`: a traced request's batches and
  slices; `copy`: the model copy that computed it, which the answer names.
- Failed: an app/engine/errors.py kind (generation 0 for a Control's).
- Table: the engine's models and readiness (engine.py's `engine_table`): after Hello, whenever it
  changes, and before each Reply. A model crosses as app/engine/description.py's ModelDescription,
  the engine's own, never as the public API lists it.
- Reply: a Control's result.
- Gpus: the GPUs the engine computes on, for the fronts' scrapes (ffn_gpu_memory_*, nv_gpu_*): after
  Hello, and every GPUS_EVERY_S while they change (engine.py).
"""

from __future__ import annotations

from typing import Any

import msgspec

from app.engine import errors
from app.engine.description import ModelDescription
from app.observe.collectors import GpuReading  # its readers import torch when they read, never at import


class _Message(msgspec.Struct, frozen=True, array_like=True, gc=False, tag_field="kind"):
    """A message: a tagged array on the wire; no cycles, so the garbage collector never tracks one."""


class Hello(_Message, frozen=True, tag="hello"):
    slots: int
    slot_bytes: int
    large_bytes: int


class MonteCarlo(msgspec.Struct, frozen=True, array_like=True, gc=False):
    passes: int
    dropout: float
    seed: int


class TraceContext(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A span's context. The trace id is 128 bits, past MessagePack's integers: it crosses as 32 hex digits."""

    trace_id: str
    span_id: int
    flags: int

    @classmethod
    def of(cls, trace_id: int, span_id: int, flags: int) -> TraceContext:
        return cls(f"{trace_id:032x}", span_id, flags)

    def ids(self) -> tuple[int, int, int]:
        """(trace id, span id, flags) as OpenTelemetry's ints."""
        return int(self.trace_id, 16), self.span_id, self.flags


class Submit(_Message, frozen=True, tag="submit"):
    ask: int
    place: int
    room: int
    generation: int
    model: str
    version: str | None
    shape: tuple[int, ...]
    rows_dtype: str
    answer_dtype: str
    deadline: float | None
    monte_carlo: MonteCarlo | None
    request_id: str | None
    trace: TraceContext | None


class Cancel(_Message, frozen=True, tag="cancel"):
    ask: int


class Control(_Message, frozen=True, tag="control"):
    ask: int
    what: str
    arguments: dict[str, Any]


class ModelCopy(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """The model copy that computed an answer."""

    name: str
    version: int
    digest: str


class Ride(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A batch (`batch` its span's context) or a Monte Carlo slice (`passes_done`) a traced request ran in;
    times in epoch nanoseconds."""

    arrived: int
    started: int
    ended: int
    batch: TraceContext | None = None
    passes_done: int = 0


class Done(_Message, frozen=True, tag="done"):
    ask: int
    generation: int
    shape: tuple[int, ...]
    rides: list[Ride] | None
    copy: ModelCopy


class Failed(_Message, frozen=True, tag="failed"):
    ask: int
    generation: int
    error: str  # an app/engine/errors.py kind's name (KINDS)
    message: str
    attributes: dict[str, str | int | float | bool | None]


class ModelEntry(msgspec.Struct, frozen=True, gc=False):
    """A model in the engine's table: its description, and its state there (app/engine/status.py's)."""

    description: ModelDescription
    state: str
    reason: str


class Table(_Message, frozen=True, tag="table"):
    readiness_state: str
    readiness_reason: str
    cuda: bool
    models: list[ModelEntry]
    unloaded: list[ModelEntry]


class Reply(_Message, frozen=True, tag="reply"):
    ask: int
    result: dict[str, Any]


class Gpus(_Message, frozen=True, tag="gpus"):
    readings: list[GpuReading]  # a dataclass: crosses as a map of its fields


FrontMessage = Hello | Submit | Cancel | Control
EngineMessage = Done | Failed | Table | Reply | Gpus
Message = FrontMessage | EngineMessage

# The engine's errors that cross, by name; anything else crosses as a ModelError.
KINDS: dict[str, type[errors.EngineError]] = {
    kind.__name__: kind
    for kind in (
        errors.ModelNotFound,
        errors.RequestTooLarge,
        errors.Overloaded,
        errors.Unavailable,
        errors.DeadlineExceeded,
        errors.InsufficientMemory,
        errors.ModelError,
        errors.ModelControlOff,
        errors.LoadFailed,
    )
}


def failed(ask: int, generation: int, exc: BaseException) -> Failed:
    """The Failed message of an engine error; a bug crosses as ModelError, named only by its type."""
    if type(exc).__name__ in KINDS and isinstance(exc, errors.EngineError):
        attributes = {
            k: v for k, v in vars(exc).items() if k != "message" and isinstance(v, str | int | float | bool | None)
        }
        return Failed(ask, generation, type(exc).__name__, exc.message, attributes)
    return Failed(ask, generation, "ModelError", f"the engine failed: {type(exc).__name__}", {})


def cancelled(ask: int, generation: int) -> Failed:
    """The Failed message of a request its front cancelled."""
    return Failed(ask, generation, "ModelError", "cancelled", {})


def error_of(message: Failed) -> errors.EngineError:
    """The error a Failed message describes, as the engine raised it (its attributes set as they were)."""
    cls = KINDS.get(message.error, errors.ModelError)
    error = cls.__new__(cls)
    errors.EngineError.__init__(error, message.message)
    for name, value in message.attributes.items():
        setattr(error, name, value)
    return error


def rides_of(recorded: list[tuple[Any, ...]]) -> list[Ride]:
    """What app/tracing/spans.py's HandedOffTrace recorded (its BATCH_RIDE and SLICE_RIDE tuples), as Rides."""
    rides = []
    for ride in recorded:
        if ride[0] == "batch":
            _, trace_id, span_id, arrived, started, ended = ride
            rides.append(Ride(arrived, started, ended, batch=TraceContext.of(trace_id, span_id, 0)))
        else:
            _, arrived, started, ended, passes_done = ride
            rides.append(Ride(arrived, started, ended, passes_done=passes_done))
    return rides


def rides_as_recorded(rides: list[Ride]) -> list[tuple[Any, ...]]:
    """Rides as HandedOffTrace recorded them, for the front's RequestTrace.rode_in_engine."""
    recorded: list[tuple[Any, ...]] = []
    for ride in rides:
        if ride.batch is not None:
            trace_id, span_id, _ = ride.batch.ids()
            recorded.append(("batch", trace_id, span_id, ride.arrived, ride.started, ride.ended))
        else:
            recorded.append(("slice", ride.arrived, ride.started, ride.ended, ride.passes_done))
    return recorded
