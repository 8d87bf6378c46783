"""The served model a V2 path names: by name, and by version where the path has one (only "1" is)."""

from __future__ import annotations

from app.engine.errors import ModelNotFound
from app.engine.registry import ServedModel
from app.web.state import ServiceState

SERVER_NAME = "ffn-serve"
PLATFORM = "pytorch_ffn"
MODEL_VERSION = "1"


def check_version(version: str | None) -> None:
    if version is not None and version != MODEL_VERSION:
        raise ModelNotFound(f"model version {version[:32]!r} is not served; the only version is {MODEL_VERSION!r}")


def served_model(state: ServiceState, name: str, version: str | None) -> ServedModel:
    """The model named in the path; 404 for an unknown name or a version other than 1."""
    check_version(version)
    return state.engine.registry.get(name)
