"""The engine's errors: kinds of failure with a message for the caller, and no HTTP statuses.

The protocol core maps each kind to a status and an error_type in one table (app.protocol.errors), the
way TEI's router maps its core's ErrorType to a StatusCode.
"""

from __future__ import annotations

from app.errors import ServiceError


class EngineError(ServiceError):
    """A request the engine could not serve."""


class ModelNotFound(EngineError):
    """No model of that name (or version) is served; `unloaded`: it was, until an unload.

    The message says what is missing; each door adds where to look (its own path or method).
    """

    def __init__(self, message: str, *, name: str, unloaded: bool = False, version: str | None = None) -> None:
        super().__init__(message)
        self.name = name
        self.unloaded = unloaded
        self.version = version


class RequestTooLarge(EngineError):
    """A request holds more rows than the model's queue can ever hold."""


class Overloaded(EngineError):
    """The model's queue is full; try again after `retry_after_s` seconds."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unavailable(EngineError):
    """Not taking work: still warming up, draining before shutdown, or shutting down."""


class DeadlineExceeded(EngineError):
    """The request's deadline passed while it was queued; it was never computed."""


class InsufficientMemory(EngineError):
    """The request alone does not fit in the device's memory."""


class ModelError(EngineError):
    """The forward pass failed for a reason that is not the client's: a bug or a device fault."""


class ModelControlOff(EngineError):
    """A load or unload while the models are fixed at start (`setting`: model_control = none)."""

    setting = "model_control"


class LoadFailed(EngineError):
    """A load that did not happen (or not in every worker): the message names the file and why."""


class NotTogether(Exception):
    """Several requests offered as one entry (`infer_soon(..., requests=...)`) whose rows the queue cannot
    take together, though it might take some of them: nothing was queued or counted, and the caller
    offers them one by one, so that each gets its own answer. Never reaches a client."""
