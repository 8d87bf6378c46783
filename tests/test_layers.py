"""The architecture's contracts: layers import in one direction, tables are written once.

ffn_core is the bottom layer and pulls in nothing of the service; the engine pulls in nothing of
the web; ffn_client nothing of the server (import-linter, contracts in pyproject.toml, and one
interpreter for what only shows at run time); every error has one row in the status table; the
settings' choices are ffn_core's tables.
"""

from __future__ import annotations

import ast
import graphlib
import importlib
import importlib.metadata
import inspect
import json
import subprocess
import sys
import typing
from pathlib import Path

import pytest

import ffn_core
from app import __version__
from app.config.settings import ModelSpec
from app.engine import errors as engine_errors
from app.protocol import errors as protocol_errors
from ffn_core import ACTIVATIONS, FORMATS
from ffn_core.dtypes import DTYPE_NAMES

ROOT = Path(__file__).resolve().parents[1]
SUBMODULES = sorted(f"ffn_core.{path.stem}" for path in (ROOT / "ffn_core").glob("*.py") if path.stem != "__init__")
SERVICE = ("app", "fastapi", "starlette", "uvicorn", "grpc")  # top-level packages ffn_core must not import
ENGINE = sorted(f"app.engine.{path.stem}" for path in (ROOT / "app" / "engine").glob("*.py") if path.stem != "__init__")


def _modules_of(package: str) -> list[str]:
    """Every module of a package of app (its folder's .py files, recursively), the package's own included."""
    return sorted(
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for path in (ROOT / package.replace(".", "/")).rglob("*.py")
    )


PROTOCOL = _modules_of("app.protocol")
DOORS = _modules_of("app.http") + _modules_of("app.grpc")


def _service_modules_after(*imports: str) -> list[list[str]]:
    """Imported in turn in one fresh interpreter: after each, the service's modules loaded by then."""
    code = "import importlib, json, sys\n" + "".join(
        f"importlib.import_module({name!r}); print(json.dumps(sorted(sys.modules)))\n" for name in imports
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    snapshots = [json.loads(line) for line in result.stdout.splitlines()]
    assert [name in modules for name, modules in zip(imports, snapshots, strict=True)] == [True] * len(imports)
    return [[name for name in modules if name.split(".")[0] in SERVICE] for modules in snapshots]


def _web_modules(modules: list[str]) -> list[str]:
    doors = ("app.http", "app.grpc", "app.protocol")
    return [m for m in modules if m.split(".")[0] in ("fastapi", "starlette", "uvicorn", "grpc") or m.startswith(doors)]


def test_the_import_contracts_hold() -> None:
    # pyproject's [tool.importlinter]: ffn_core imports nothing of the service or the client, the
    # engine nothing of the web, ffn_client no app, ffn_core or torch; directly or through each other.
    # In its own interpreter: lint_imports configures logging with dictConfig, which disables
    # every logger already made (the tests' caplog would see nothing after it).
    code = (
        "import sys; from importlinter.cli import lint_imports; "
        f"sys.exit(lint_imports(config_filename={str(ROOT / 'pyproject.toml')!r}, no_cache=True, no_logo=True))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_what_ffn_core_and_the_engine_load_at_run_time() -> None:
    # import-linter reads our sources; what a third-party import pulls in shows only at run time.
    # One interpreter: ffn_core and each of its modules (the extract CLI included), then each
    # engine module, then FastAPI, which the same look must find (so the empty lists are a finding).
    core = ["ffn_core", *SUBMODULES]
    after = _service_modules_after(*core, *ENGINE, "fastapi")
    assert after[: len(core)] == [[]] * len(core)
    assert [_web_modules(modules) for modules in after[len(core) : -1]] == [[]] * len(ENGINE)
    assert {"fastapi", "starlette"} <= set(after[-1])


def test_the_protocol_core_loads_no_web_or_grpc_stack_at_run_time() -> None:
    # What each door's stack pulls in shows only at run time: every module of app.protocol, imported
    # in turn, leaves starlette, fastapi, uvicorn, grpc and both doors unloaded; then FastAPI, which
    # the same look must find (so the empty lists are a finding).
    after = _service_modules_after(*PROTOCOL, "fastapi")
    doors = ("app.http", "app.grpc")
    stacks = [[m for m in modules if m.split(".")[0] != "app" or m.startswith(doors)] for modules in after]
    assert stacks[:-1] == [[]] * len(PROTOCOL)
    assert {"fastapi", "starlette"} <= set(stacks[-1])


def test_the_doors_and_the_protocol_core_load_no_torch_at_run_time() -> None:
    # The doors will run in processes that never import torch: numpy arrays meet the engine at its
    # facade (app/engine/facade.py). In one interpreter, every module of app.protocol, app.http and
    # app.grpc in turn leaves torch unloaded; then the engine's service, which the same look must
    # find loading it.
    imports = [
        *PROTOCOL,
        *DOORS,
        "app.handoff.front",
        "app.handoff.remote",
        "app.engine.service",
    ]  # the front's side too
    code = "import importlib, sys\n" + "".join(
        f"importlib.import_module({name!r}); print('torch' in sys.modules)\n" for name in imports
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    loaded = dict(zip(imports, (line == "True" for line in result.stdout.splitlines()), strict=True))
    assert [name for name in imports[:-1] if loaded[name]] == []
    assert loaded["app.engine.service"]
    assert len(DOORS) > 30 and "app.http.native.routes" in DOORS and "app.grpc.service" in DOORS


def test_ffn_core_exports_its_names_on_first_use() -> None:
    # ffn_core's package imports its modules when a name is first used (so that ffn_core.dtypes needs
    # no torch): every exported name is there, and is its defining module's own object.
    exported = {name: getattr(ffn_core, name) for name in ffn_core.__all__}  # each one found
    assert exported["FFNConfig"] is importlib.import_module("ffn_core.config").FFNConfig
    assert exported["load_ffn"] is importlib.import_module("ffn_core.weights").load_ffn
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        ffn_core.nothing  # noqa: B018


def test_only_the_http_transport_touches_uvicorns_internals() -> None:
    # uvicorn.protocols is uvicorn's inside, not its API: one folder to port per uvicorn release.
    # (import-linter sees external packages whole, so this contract is read from the sources.)
    importers = set()
    for path in (ROOT / "app").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            if any(name.startswith("uvicorn.protocols") for name in names):
                importers.add(path.relative_to(ROOT).parent.as_posix())
    assert importers == {"app/http/transport"}


def test_ffn_core_modules_import_each_other_in_one_direction():
    graph: dict[str, set[str]] = {}
    for path in (ROOT / "ffn_core").glob("*.py"):
        name = "ffn_core" if path.stem == "__init__" else f"ffn_core.{path.stem}"
        graph[name] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                graph[name].add(node.module)
            elif isinstance(node, ast.Import):
                graph[name].update(alias.name for alias in node.names)
        graph[name] = {module for module in graph[name] if module.split(".")[0] == "ffn_core"}
    assert set(graph) == {"ffn_core", *SUBMODULES}
    order = list(graphlib.TopologicalSorter(graph).static_order())  # raises CycleError on a cycle
    assert order[-1] == "ffn_core"  # the package comes last: it only re-exports


APP_TOP_LEVEL = {"__init__", "cli", "main", "control", "errors"}  # the command, the app factory, two shared leaves


def test_app_holds_its_folders_and_a_handful_of_modules() -> None:
    """app/'s top level shows the architecture: folders named for their job, at most six modules beside them."""
    modules = {path.stem for path in (ROOT / "app").glob("*.py")}
    assert modules == APP_TOP_LEVEL
    assert len(modules - {"__init__"}) <= 6
    folders = {path.name for path in (ROOT / "app").iterdir() if (path / "__init__.py").exists()}
    assert {"config", "observe", "process", "engine", "protocol", "http", "grpc", "handoff", "tracing"} <= folders


def _folder_of(module: str) -> str | None:
    """The folder of app a module is in (app.engine.batcher: engine); None for app's top-level modules."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (ROOT / "app" / parts[1]).is_dir()) else None


def test_no_folder_of_app_imports_back_one_that_imports_it() -> None:
    """Module-level imports only (a function's own import runs when called, as a TYPE_CHECKING one never does)."""
    graph: dict[str, set[str]] = {}
    for path in (ROOT / "app").rglob("*.py"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        source = _folder_of(module)
        if source is None:
            continue
        targets = graph.setdefault(source, set())
        for node in ast.parse(path.read_text()).body:  # the module's own statements: its top level
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                target = _folder_of(name) if name.startswith("app.") else None
                if target is not None and target != source:
                    targets.add(target)
    assert {"config", "observe", "process", "engine"} <= set(graph)
    order = list(graphlib.TopologicalSorter(graph).static_order())  # raises CycleError on a cycle
    assert order.index("config") < order.index("engine") < order.index("process")


def test_every_service_error_has_one_row_in_the_table() -> None:
    def classes(module: object, base: type) -> set[type]:
        return {
            cls
            for _, cls in inspect.getmembers(module, inspect.isclass)
            if issubclass(cls, base) and cls is not base and cls.__module__ == module.__name__
        }  # type: ignore[attr-defined]

    for cls in classes(engine_errors, engine_errors.EngineError) | classes(protocol_errors, protocol_errors.EdgeError):
        assert cls in protocol_errors.ERRORS, f"{cls.__name__} has no status in app.protocol.errors.ERRORS"
    statuses = {kind.error_type: kind.status for kind in protocol_errors.ERRORS.values()}
    assert statuses["overloaded"] == 429 and statuses["unavailable"] == 503 and statuses["invalid_input"] == 400


def test_engine_errors_carry_no_status() -> None:
    for name in ("status", "error_type", "headers"):
        assert not hasattr(engine_errors.Overloaded("x"), name)


@pytest.mark.parametrize(
    ("field", "table"),
    [
        ("dtype", DTYPE_NAMES),
        ("format", FORMATS),
        ("activation", tuple(ACTIVATIONS)),
    ],
)
def test_settings_choices_are_ffn_cores_tables(field: str, table: tuple[str, ...]) -> None:
    annotation = ModelSpec.model_fields[field].annotation
    choices = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    (literal,) = choices if typing.get_origin(annotation) is not typing.Literal else (annotation,)
    assert set(typing.get_args(literal)) == set(table)


def test_one_version_string_from_the_package_metadata() -> None:
    assert __version__ == importlib.metadata.version("ffn-serve")
