"""ServiceError: the base of every error the service answers with a message of its own.

Below both layers: the engine's kinds (app.engine.errors) and the protocol's (app.protocol.errors)
derive from it; only the edge knows statuses.
"""

from __future__ import annotations


class ServiceError(Exception):
    """A request that could not be served; `message` says why, for a person to read."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def drop_frames(exc: BaseException) -> None:
    """Forget the frames an answered error was raised through (its causes' too), once it is logged.

    A frame in an exception's traceback often holds the exception itself (`error = ...; raise
    error`, `except E as e: kept = e`): a reference cycle that keeps every frame of the request
    alive, with its body and tensors, until the garbage collector next runs, which on a quiet
    server can be never (48 refused 31 MiB requests kept 700 MiB). Each door calls this when it
    has turned an error into its answer.
    """
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        error.__traceback__ = None
        error = error.__cause__ or error.__context__
