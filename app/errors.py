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
