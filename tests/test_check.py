"""`ffn-serve --check` (issue 29 item 9): every model loaded, warmed up and asked once in-process; exit 0,
or one line and exit 2. Real `ffn-serve --check` processes."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

pytestmark = pytest.mark.server

D_MODEL, D_FF = 16, 32


def run_check(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FFN_")}
    return subprocess.run(
        [sys.executable, "-m", "app.cli", "--check", *args], capture_output=True, text=True, timeout=180, env=env
    )


def write_native(path: Path, *, huge: bool = False) -> None:
    """A ReLU FFN's native weights; `huge`: every W2 weight 1e38, finite, but every answer past float32's range."""
    rng = np.random.default_rng(3)
    w2 = np.full((D_MODEL, D_FF), 1e38, np.float32) if huge else rng.standard_normal((D_MODEL, D_FF)).astype(np.float32)
    save_file(
        {
            "layer1.weight": rng.standard_normal((D_FF, D_MODEL)).astype(np.float32) / 4,
            "layer1.bias": np.full(D_FF, 10.0, np.float32),  # hidden units near 10 for standard normal rows
            "layer2.weight": w2,
            "layer2.bias": np.zeros(D_MODEL, np.float32),
        },
        str(path),
        metadata={"activation": "relu"},
    )


def config(folder: Path, *tables: tuple[str, str | None]) -> Path:
    text = "".join(
        f'[[models]]\nname = "{name}"\n' + (f'weights = "{weights}"\n' if weights else "") + "\n"
        for name, weights in tables
    )
    path = folder / "ffn.toml"
    path.write_text(text)
    return path


def test_check_answers_once_per_model_binds_nothing_and_exits_0(tmp_path: Path) -> None:
    write_native(tmp_path / "small.safetensors")
    with socket.socket() as http, socket.socket() as grpc:  # the service's ports, held: the check serves nothing
        for taken in (http, grpc):
            taken.bind(("127.0.0.1", 0))
            taken.listen()
        ports = [str(taken.getsockname()[1]) for taken in (http, grpc)]
        tables = config(tmp_path, ("demo", None), ("small", "small.safetensors"))
        result = run_check("--config", str(tables), "--port", ports[0], "--grpc-port", ports[1])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2, result.stdout
    assert lines[0].startswith("ffn-serve --check: demo: relu, d_model 512, d_ff 2048, float32 on ")
    assert re.search(r": warm, answered 4 rows, \[4, 512\], finite; sha256:[0-9a-f]{64}$", lines[0]), lines[0]
    assert lines[1].startswith(f"ffn-serve --check: small: relu, d_model {D_MODEL}, d_ff {D_FF}, float32 on ")
    assert f": warm, answered 4 rows, [4, {D_MODEL}], finite; sha256:" in lines[1], lines[1]
    assert result.stderr == "", "warnings only, and there were none"


def test_a_model_whose_answer_is_not_finite_fails_the_check_in_one_line(tmp_path: Path) -> None:
    write_native(tmp_path / "small.safetensors")
    write_native(tmp_path / "huge.safetensors", huge=True)  # finite weights, infinite answers
    result = run_check("--config", str(config(tmp_path, ("small", "small.safetensors"), ("huge", "huge.safetensors"))))
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = [line for line in result.stderr.splitlines() if "WARNING" not in line]  # the warm-up's own warnings
    assert lines == [
        "ffn-serve --check: model 'huge' answered 4 rows of standard normal input with 64 of 64 values "
        "not finite (NaN or ±inf)"
    ], result.stderr


def test_a_model_that_cannot_be_loaded_fails_the_check_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "text.safetensors").write_text("not weights")
    result = run_check("--config", str(config(tmp_path, ("demo", None), ("text", "text.safetensors"))))
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith("ffn-serve --check: model 'text': ") and "text.safetensors" in line, line
    missing = run_check("--config", str(config(tmp_path, ("gone", "gone.safetensors"))))
    assert missing.returncode == 2
    assert missing.stderr.splitlines() == [
        f"ffn-serve --check: model 'gone': cannot load {tmp_path / 'gone.safetensors'}: No such file or directory"
    ]


def test_help_lists_check() -> None:
    result = subprocess.run([sys.executable, "-m", "app.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert "--check" in result.stdout and "Smoke test" in result.stdout


def test_check_with_devices_places_every_model_on_each_engines_device(tmp_path: Path) -> None:
    # The table says cpu; the engines of `devices` compute on theirs, so the check loads it there: a GPU
    # that is not there (no CUDA here; on a GPU machine, no 8th GPU) fails it, naming the device.
    (tmp_path / "ffn.toml").write_text('[[models]]\nname = "demo"\ndevice = "cpu"\n')
    result = run_check(
        "--config", str(tmp_path / "ffn.toml"), "--shared-engine", "--devices", "cpu", "--devices", "cuda:7"
    )
    assert result.returncode == 2, result.stdout
    (line,) = result.stderr.splitlines()
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:  # refused before torch is imported
        assert line.startswith("ffn-serve --check: setting devices: device 'cuda:7' needs CUDA, and torch "), line
    else:
        assert line.startswith("ffn-serve --check: model 'demo': ") and "device 'cuda:7' requested but" in line, line
