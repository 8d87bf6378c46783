"""Where a model's weights come from: its file or its Hub repository's (weights_path), the model repository
folder, a load's config, the file's identity.

- A load's `config` parameter holds the keys of a `[[models]]` table as JSON; its weights path is
  relative to the model repository folder and must stay inside it (`..` and symlinks that leave
  it are refused), so a client that may load models can still read no other file.
- `WeightsFile` is a weights file's identity when a load was asked for (device, inode, size and
  modification time): every worker checks it before and after reading, so that all of them serve
  the same bytes under one version, and a worker started later never replays a load of a file
  that has been replaced since (it fails instead, loudly).
- `changes` compares what is served with a config file read again (SIGHUP).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson
from pydantic import ValidationError

from app.config.settings import ModelSpec
from app.engine.errors import LoadFailed
from ffn_core import WeightsError
from ffn_core.hub import hub_format, hub_weights

MAX_CONFIG_CHARS = 16 * 1024  # a [[models]] table is a few hundred characters


@dataclass(frozen=True)
class WeightsFile:
    """A weights file as it was when a load was asked for: a replaced or rewritten file differs."""

    path: str
    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path) -> WeightsFile:
        """The file's identity now; OSError if it cannot be read (missing, not allowed)."""
        st = os.stat(path)
        return cls(str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def check(self) -> None:
        """Raise LoadFailed unless the file is still the one the load was asked for."""
        try:
            now = WeightsFile.of(Path(self.path))
        except OSError as exc:
            raise LoadFailed(f"{self.path}: {exc.strerror or exc}") from None
        if now != self:
            raise LoadFailed(
                f"{self.path} was replaced or changed after the load was asked for; load again to serve what it holds now"
            )

    def as_args(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_args(cls, args: Mapping[str, Any] | None) -> WeightsFile | None:
        return None if args is None else cls(**args)


def weights_path(spec: ModelSpec) -> Path | None:
    """Where the spec's weights are: its file, or its hf_model's file in huggingface_hub's cache (fetched
    first unless HF_HUB_OFFLINE; WeightsError if it cannot be had). None: the built-in demo weights."""
    if spec.hf_model is not None:
        return hub_weights(spec.hf_model, spec.revision, spec.layer, spec.format)
    return spec.weights


def weights_format(spec: ModelSpec, path: Path) -> str:
    """How to read the weights at `path`: the table's format, else the family the hf_model's config.json
    names, else native."""
    if spec.format is not None:
        return spec.format
    return hub_format(path) if spec.hf_model is not None else "native"


def identify(spec: ModelSpec) -> WeightsFile | None:
    """The identity of the spec's weights file (None: the built-in demo weights); LoadFailed if unreadable.

    An hf_model's file is found (or fetched) here, once, by the process that takes the load: every
    worker then reads that very file."""
    try:
        path = weights_path(spec)
    except WeightsError as exc:
        raise LoadFailed(f"model {spec.name!r}: {exc}") from None
    if path is None:
        return None
    try:
        return WeightsFile.of(path)
    except OSError as exc:
        raise LoadFailed(f"model {spec.name!r}: cannot load {path}: {exc.strerror or exc}") from None


def inside(repository: Path, relative: str) -> Path:
    """`relative` resolved in `repository` (itself resolved); LoadFailed if it leaves it, through `..` or a symlink."""
    try:
        resolved = (repository / relative).resolve()
    except (OSError, ValueError) as exc:  # a link loop, an embedded NUL
        raise LoadFailed(f"weights {relative[:200]!r}: {exc}") from None
    if not resolved.is_relative_to(repository):
        raise LoadFailed(
            f"weights {relative[:200]!r} resolve outside the model repository {repository}: "
            "a load reads only files inside it (no '..', no symlinks out of it)"
        )
    return resolved


def spec_from_config(name: str, config: str, repository: Path | None) -> ModelSpec:
    """The ModelSpec of a load's `config` parameter: a [[models]] table as JSON, weights inside `repository`."""
    if len(config) > MAX_CONFIG_CHARS:
        raise LoadFailed(f"the config parameter has {len(config)} characters; at most {MAX_CONFIG_CHARS}")
    try:
        table = orjson.loads(config)
    except orjson.JSONDecodeError as exc:
        raise LoadFailed(f"the config parameter is not JSON: {exc}") from None
    if not isinstance(table, dict):
        raise LoadFailed("the config parameter must be a JSON object with the keys of a [[models]] table")
    if table.get("name", name) != name:
        raise LoadFailed(f"the config parameter names model {str(table['name'])[:100]!r}, the path {name!r}")
    if table.get("hf_model") is not None:
        raise LoadFailed(
            "a load's config parameter names weights inside the model repository only; "
            "a model from the Hub (hf_model) is a [[models]] table of the config file"
        )
    weights = table.get("weights")
    if weights is not None:
        if not isinstance(weights, str):
            raise LoadFailed("the config parameter's weights must be a path (a string)")
        if repository is None:
            raise LoadFailed(
                "a config parameter naming weights needs a model repository: set model_repository "
                "(FFN_MODEL_REPOSITORY, --model-repository) or serve from a config file"
            )
        table["weights"] = str(inside(repository, weights))
    try:
        return ModelSpec.model_validate({**table, "name": name})
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in error['loc']) or 'config'}: {error['msg']}"
            for error in exc.errors(include_url=False)
        )
        raise LoadFailed(f"the config parameter is not a valid [[models]] table: {problems}") from None


@dataclass(frozen=True)
class Served:
    """What a process serves under a name: the table it was loaded from and its file's identity then."""

    spec: ModelSpec
    source: WeightsFile | None


@dataclass(frozen=True)
class Changes:
    """What a config file read again changes: models to load (new or changed) and to unload."""

    added: list[ModelSpec]
    changed: list[tuple[ModelSpec, str]]  # the table, and why it is reloaded
    removed: list[str]
    unchanged: list[str]

    def summary(self) -> str:
        parts = [
            *(f"{spec.name} added" for spec in self.added),
            *(f"{spec.name} changed ({why})" for spec, why in self.changed),
            *(f"{name} removed" for name in self.removed),
        ]
        return ", ".join(parts) or "nothing changed"


def changes(served: Mapping[str, Served], wanted: list[ModelSpec]) -> Changes:
    """Compare what is served with the config file's tables: a table edited, or its file replaced, is a change."""
    added, changed, unchanged = [], [], []
    for spec in wanted:
        current = served.get(spec.name)
        if current is None:
            added.append(spec)
        elif current.spec != spec:
            changed.append((spec, "its table was edited"))
        elif current.source is not None and _replaced(current.source):
            changed.append((spec, f"{current.source.path} was replaced"))
        else:
            unchanged.append(spec.name)
    names = {spec.name for spec in wanted}
    return Changes(added, changed, [name for name in served if name not in names], unchanged)


def _replaced(source: WeightsFile) -> bool:
    try:
        return WeightsFile.of(Path(source.path)) != source
    except OSError:
        return True  # gone: the load will say so
