"""An unloaded model: listed (UNAVAILABLE, "unloaded", with the version it last served), never served."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from app.engine.errors import ModelNotFound
from app.engine.status import UNLOADED, ModelStatus

if TYPE_CHECKING:
    from app.engine.registry import ServedModel


def unloaded_error(name: str) -> ModelNotFound:
    """Infer, metadata and the rest for an unloaded model: 404, as Triton answers ("no available versions")."""
    return ModelNotFound(f"model {name[:100]!r} is unloaded", name=name, unloaded=True)


class UnloadedModel:
    """A model unloaded while serving: no weights, still listed, UNAVAILABLE ("unloaded"), with its last version."""

    def __init__(self, served: ServedModel) -> None:
        self.spec = served.spec
        self.version = served.version
        self.digest = served.digest  # of the copy it last served
        self._description = served.describe() | {
            "ready": False,
            "state": UNLOADED.state.value,
            "reason": UNLOADED.reason,
        }

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def status(self) -> ModelStatus:
        return UNLOADED

    def describe(self) -> dict[str, Any]:
        return dict(self._description)
