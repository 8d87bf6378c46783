"""`metrics_dir` (FFN_METRICS_DIR): where worker processes keep their metrics files.

A folder that cannot be used stops the start with one line and exit 2, never a traceback (a
read-only root file system left the default without a temporary folder: tests/test_docker.py
runs that case in a real container). A folder given by the operator is emptied of a previous
run's metrics files, whose counts would otherwise add to this run's, and is kept at exit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from app.observe.metrics_folder import MetricsFolderError, check_metrics_dir, metrics_folder
from ffn_testing import free_port, metric_value, start_server
from tests.wire import raw_headers

D_MODEL = 512


def serve_and_fail(*args: str) -> subprocess.CompletedProcess[str]:
    """ffn-serve with `args`, expected to stop before serving."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FFN_")}
    return subprocess.run(
        [sys.executable, "-m", "app.cli", "--port", str(free_port()), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


@pytest.mark.parametrize("kind", ["missing", "file", "read-only"])
def test_an_unusable_metrics_dir_stops_the_start_with_one_line_and_exit_2(tmp_path: Path, kind: str) -> None:
    folder = {
        "missing": tmp_path / "absent",
        "file": tmp_path / "a-file",
        # /proc takes no new file from anyone, root included (a chmod would not stop root).
        "read-only": Path("/proc"),
    }[kind]
    if kind == "file":
        folder.write_text("")
    result = serve_and_fail("--workers", "2", "--metrics-dir", str(folder))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("ffn-serve: invalid setting metrics_dir (FFN_METRICS_DIR): ")
    assert str(folder) in lines[0]
    assert {"missing": "does not exist", "file": "is not a folder", "read-only": "is not writable"}[kind] in lines[0]
    with pytest.raises(MetricsFolderError):
        check_metrics_dir(folder)


def test_the_default_folder_is_made_and_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # tempfile caches the folder it found first
    check_metrics_dir(None)
    check_metrics_dir(tmp_path)
    with metrics_folder(None) as folder:
        assert folder.parent == tmp_path and folder.is_dir()
    assert not folder.exists()


def write_stale_counts(folder: Path, count: int) -> None:
    """A previous run's counter file in `folder`: `count` demo requests answered ok."""
    code = (
        "from prometheus_client import CollectorRegistry, Counter\n"
        "Counter('ffn_requests', 'x', ['model', 'outcome'], registry=CollectorRegistry())"
        f".labels('demo', 'ok').inc({count})\n"
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(folder)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)


@pytest.mark.server
def test_a_given_metrics_dir_is_emptied_of_stale_counts_and_kept(tmp_path: Path) -> None:
    folder = tmp_path / "metrics"
    folder.mkdir()
    write_stale_counts(folder, 1000)
    (stale,) = folder.glob("counter_*.db")
    (folder / "notes.txt").write_text("not ours: left alone")
    with start_server(env={"FFN_WORKERS": "2", "FFN_METRICS_DIR": str(folder)}) as server:
        x = np.ones((2, D_MODEL), np.float32)
        with httpx.Client(base_url=server.url, timeout=60) as client:
            for _ in range(3):
                answer = client.post("/v1/models/demo/transform", content=x.tobytes(), headers=raw_headers(x.shape))
                assert answer.status_code == 200
            page = client.get("/metrics").text
        assert metric_value(page, "ffn_requests_total", model="demo", outcome="ok") == 3
        assert not stale.exists()
        assert list(folder.glob("*.db")), "the workers keep their metrics in the given folder"
    assert server.returncode == 0
    assert folder.is_dir() and (folder / "notes.txt").read_text() == "not ours: left alone"
