"""An unloaded model: listed (UNAVAILABLE, "unloaded", with the version it last served), never served."""

from __future__ import annotations

import difflib
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from app.engine.description import listing
from app.engine.errors import EngineError, ModelNotFound, Unavailable
from app.engine.status import UNLOADED, ModelStatus

if TYPE_CHECKING:
    from app.engine.registry import ServedModel


def not_served_error(
    name: str, version: str | None, served_version: int | None, *, unloaded: bool, served: Collection[str] = ()
) -> ModelNotFound:
    """Why `name` (at `version`) cannot be looked up: not served (or unloaded), or served at another version.

    `served`: the names served, for a hint: the nearest one, when one is close."""
    if served_version is None:
        if unloaded:
            return unloaded_error(name)
        return ModelNotFound(f"model {name[:100]!r} is not served here{_hint(name, served)}", name=name)
    return ModelNotFound(
        f"model {name[:100]!r} has no version {str(version)[:32]!r}; the version served is {served_version}",
        name=name,
        version=version,
    )


def _hint(name: str, served: Collection[str]) -> str:
    """'; did you mean X?' with the served name closest to `name`, if one is close (the door's hint lists them all)."""
    close = difflib.get_close_matches(name[:100], list(served), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def not_ready_error(name: str, status: ModelStatus) -> EngineError:
    """Why a model that is not READY takes no work: unloaded (404), else 503 with the status's reason."""
    if status == UNLOADED:
        return unloaded_error(name)
    return Unavailable(f"model {name!r} is not ready: {status.reason}")


def unloaded_error(name: str) -> ModelNotFound:
    """Infer, metadata and the rest for an unloaded model: 404, as Triton answers ("no available versions")."""
    return ModelNotFound(f"model {name[:100]!r} is unloaded", name=name, unloaded=True)


class UnloadedModel:
    """A model unloaded while serving: no weights, still listed, UNAVAILABLE ("unloaded"), with its last version."""

    def __init__(self, served: ServedModel) -> None:
        self.spec = served.spec
        self.version = served.version
        self.digest = served.digest  # of the copy it last served
        self.description = served.description()

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def status(self) -> ModelStatus:
        return UNLOADED

    def describe(self) -> dict[str, Any]:
        return listing(self.description, UNLOADED)
