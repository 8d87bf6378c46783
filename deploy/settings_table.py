"""Print the Markdown table of every setting as an environment variable, from `Settings` itself.

docs/deployment.md holds this output between its `settings-table` markers; tests/test_deploy.py
fails when the two differ. Run from the repository root: `python deploy/settings_table.py`.
"""

from __future__ import annotations

import sys
import types
import typing
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from app.config.settings import Settings

ENV_PREFIX = "FFN_"
# Used only where a field has no description of its own.
FALLBACK_DESCRIPTIONS: dict[str, str] = {}


def type_text(annotation: Any) -> str:
    """How to write a value of this type in the environment."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return type_text(args[0])
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{a}`" for a in typing.get_args(annotation))
    if origin is list:
        (item,) = typing.get_args(annotation)
        if isinstance(item, type) and issubclass(item, BaseModel):
            return "JSON list of tables"
        return "JSON list of strings" if item is str else f"JSON list of {type_text(item)}"
    names = {
        str: "string",
        int: "integer",
        float: "number",
        bool: "`true` or `false`",
        Path: "path",
        SecretStr: "string",
    }
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def default_text(field: FieldInfo) -> str:
    """The default as one would write it in the environment; unset when there is none."""
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, list):
        return "`[]`" if not value else f"`{value}`"
    return f"`{value}`"


def table() -> str:
    """One row per Settings field: variable, type, default, description."""
    rows = ["| Variable | Type | Default | Description |", "| --- | --- | --- | --- |"]
    for name, field in Settings.model_fields.items():
        description = field.description or FALLBACK_DESCRIPTIONS.get(name, "")
        description = description.replace("|", "\\|").replace("\n", " ")
        rows.append(
            f"| `{ENV_PREFIX}{name.upper()}` | {type_text(field.annotation)} | {default_text(field)} | {description} |"
        )
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(table())
