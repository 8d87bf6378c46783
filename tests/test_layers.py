"""The architecture's contracts: layers import in one direction, tables are written once."""

from __future__ import annotations

import importlib.metadata
import inspect
import subprocess
import sys
import typing

import pytest

from app import __version__
from app.engine import errors as engine_errors
from app.settings import ModelSpec
from app.web import errors as web_errors
from ffn_core import ACTIVATIONS, FORMATS
from ffn_core.dtypes import DTYPE_NAMES

WEB_FRAMEWORKS = ("fastapi", "starlette", "uvicorn", "app.web", "app.main")


def _modules_loaded_by(statement: str) -> set[str]:
    """The top-level and package names in sys.modules after running `statement` in a fresh interpreter."""
    code = f"{statement}\nimport sys\nprint('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_the_engine_imports_nothing_of_the_web() -> None:
    loaded = _modules_loaded_by(
        "import app.engine.service, app.engine.batcher, app.engine.runner, app.engine.registry, app.engine.errors"
    )
    assert "app.engine.batcher" in loaded  # the probe really imported the engine
    offenders = sorted(m for m in loaded if m.startswith(WEB_FRAMEWORKS))
    assert offenders == []


def test_every_service_error_has_one_row_in_the_table() -> None:
    def classes(module: object, base: type) -> set[type]:
        return {cls for _, cls in inspect.getmembers(module, inspect.isclass)
                if issubclass(cls, base) and cls is not base and cls.__module__ == module.__name__}  # type: ignore[attr-defined]

    for cls in classes(engine_errors, engine_errors.EngineError) | classes(web_errors, web_errors.EdgeError):
        assert cls in web_errors.ERRORS, f"{cls.__name__} has no status in app.web.errors.ERRORS"
    statuses = {kind.error_type: kind.status for kind in web_errors.ERRORS.values()}
    assert statuses["overloaded"] == 429 and statuses["unavailable"] == 503 and statuses["invalid_input"] == 400


def test_engine_errors_carry_no_status() -> None:
    for name in ("status", "error_type", "headers"):
        assert not hasattr(engine_errors.Overloaded("x"), name)


@pytest.mark.parametrize(("field", "table"), [
    ("dtype", DTYPE_NAMES),
    ("format", FORMATS),
    ("activation", tuple(ACTIVATIONS)),
])
def test_settings_choices_are_ffn_cores_tables(field: str, table: tuple[str, ...]) -> None:
    annotation = ModelSpec.model_fields[field].annotation
    choices = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    (literal,) = choices if typing.get_origin(annotation) is not typing.Literal else (annotation,)
    assert set(typing.get_args(literal)) == set(table)


def test_one_version_string_from_the_package_metadata() -> None:
    assert __version__ == importlib.metadata.version("ffn-serve")
