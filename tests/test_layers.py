"""ffn_core is the bottom layer: it pulls in nothing of the service, and its modules form no cycle."""

from __future__ import annotations

import ast
import graphlib
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUBMODULES = sorted(f"ffn_core.{path.stem}" for path in (ROOT / "ffn_core").glob("*.py") if path.stem != "__init__")
SERVICE = ("app", "fastapi", "starlette", "uvicorn")  # top-level packages ffn_core must not import


def _service_modules_after(*imports: str) -> list[list[str]]:
    """For each module in turn, imported in one fresh interpreter: the service's modules loaded by then."""
    code = "import importlib, json, sys\n" + "".join(
        f"importlib.import_module({name!r}); print(json.dumps(sorted(sys.modules)))\n" for name in imports
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    snapshots = [json.loads(line) for line in result.stdout.splitlines()]
    assert [name in modules for name, modules in zip(imports, snapshots)] == [True] * len(imports)
    return [[name for name in modules if name.split(".")[0] in SERVICE] for modules in snapshots]


def test_ffn_core_imports_nothing_of_the_service():
    # The package first, as a user imports it; then every module, extract's CLI included.
    assert _service_modules_after("ffn_core", *SUBMODULES) == [[]] * (1 + len(SUBMODULES))


def test_the_check_sees_the_service_when_it_is_there():
    # The same look at sys.modules finds the web framework once it is imported: the empty lists
    # above are a finding, not a blind spot.
    [found] = _service_modules_after("fastapi")
    assert {"fastapi", "starlette"} <= set(found)


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
