"""The control messages between a front and an engine, and the engine's errors as data.

Front to engine:
- (HELLO, slots, slot bytes): the first message of a connection: how the memory it handed over as it
  began (frames.py's `send_memory`) is cut into slots.
- (SUBMIT, id, slot, generation, model, version, shape, rows dtype, answer dtype, deadline,
  monte carlo, inline rows, request id, trace): one request. `slot` is -1 when the rows travel
  inline (bytes); `deadline` is time.monotonic() seconds (one clock for every process of a host) or
  None; `monte carlo` is (passes, dropout, seed) or None. Dtypes are ffn_core/dtypes.py's names.
  `request id` is the request's (X-Request-Id, or the one it was given), which the engine's batch
  spans list, or None for a call that came with no request context. `trace` is None, or for a
  traced request (trace id, span id, trace flags): its span's context, which the engine's batch
  spans link to (app/tracing/spans.py).
- (CANCEL, id): its client left; the engine answers it anyway, FAILED or DONE.
- (CONTROL, id, what, arguments): model control, as the engine facade's: "load" (name, config),
  "unload" (name), answered REPLY or FAILED; "refused_load" (name), counted, not answered (id 0).

Engine to front:
- (DONE, id, generation, shape, inline answer, rides, copy): the answer is in the request's slot
  under its generation (inline None), or here as bytes; a Monte Carlo answer is its mean then its
  std. `rides`: None, or for a traced request the batches and slices it ran in (HandedOffTrace's).
  `copy`: (name, version, digest) of the model copy that computed it, which the answer names.
- (FAILED, id, generation, kind, message, attributes): an app/engine/errors.py kind (generation 0
  for a CONTROL's).
- (TABLE, table): the engine's models and readiness as a front's facade shows them (engine.py's
  `engine_table`): after HELLO, whenever it changes, and before each REPLY.
- (REPLY, id, result): a CONTROL's result.
- (GPUS, readings): the GPUs the engine computes on, app/collectors.py's GpuReading each, for
  the fronts' scrapes (ffn_gpu_memory_*, nv_gpu_*): after HELLO, and every GPUS_EVERY_S while
  they change (engine.py).
"""

from __future__ import annotations

from typing import Any

from app.engine import errors

HELLO, SUBMIT, CANCEL, DONE, FAILED = "hello", "submit", "cancel", "done", "failed"
CONTROL, TABLE, REPLY, GPUS = "control", "table", "reply", "gpus"

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


def error_as_data(exc: BaseException) -> tuple[str, str, dict[str, Any]]:
    """(kind, message, attributes) of an engine error; a bug crosses as ModelError, named only by its type."""
    if type(exc).__name__ in KINDS and isinstance(exc, errors.EngineError):
        attributes = {
            k: v for k, v in vars(exc).items() if k != "message" and isinstance(v, str | int | float | bool | None)
        }
        return type(exc).__name__, exc.message, attributes
    return "ModelError", f"the engine failed: {type(exc).__name__}", {}


def error_from_data(kind: str, message: str, attributes: dict[str, Any]) -> errors.EngineError:
    """The error `error_as_data` described, as the engine raised it (its attributes set as they were)."""
    cls = KINDS.get(kind, errors.ModelError)
    error = cls.__new__(cls)
    errors.EngineError.__init__(error, message)
    for name, value in attributes.items():
        setattr(error, name, value)
    return error
