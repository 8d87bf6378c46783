"""The image's entry script and the model folder: `demo` only from an empty folder.

A mounted folder the container's user cannot read, or one holding files but no config.toml (a
misnamed config), used to start the built-in `demo`, healthy and silent. Now it stops the start
with a message and exit 2. Run here as the image runs it, with a stub `ffn-serve` on PATH that
reports what it was started with; deploy/docker_check.py runs the same cases in a container,
as UID 10001 on a folder owned by another user.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENTRYPOINT = ROOT / "deploy" / "docker" / "entrypoint.sh"


def run_entrypoint(tmp_path: Path, models: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, Any]:
    """The entry script's exit code, its stderr, and what the stub command saw (None if it never ran)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("ffn-serve", "ffn-extract"):
        stub = bin_dir / name
        stub.write_text(
            f"#!{sys.executable}\nimport json, os, sys\n"
            f"print(json.dumps({{'command': {name!r}, 'args': sys.argv[1:], 'config': os.environ.get('FFN_CONFIG')}}))\n"
        )
        stub.chmod(0o755)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FFN_")}
    result = subprocess.run(
        ["/bin/sh", str(ENTRYPOINT), *args],
        env={**clean, "PATH": f"{bin_dir}:{clean['PATH']}", "MODELS_DIR": str(models), **(env or {})},
        capture_output=True,
        text=True,
        timeout=30,
    )
    return result.returncode, result.stderr.strip(), json.loads(result.stdout) if result.stdout else None


def folder(tmp_path: Path, *files: str) -> Path:
    models = tmp_path / "models"
    models.mkdir()
    for name in files:
        (models / name).write_text("")
    return models


def test_a_folder_with_files_but_no_config_toml_stops_the_start(tmp_path: Path) -> None:
    models = folder(tmp_path, "model.toml", "weights.safetensors")
    code, stderr, seen = run_entrypoint(tmp_path, models)
    assert (code, seen) == (2, None), stderr
    assert stderr == (
        f"ffn-entrypoint: the model folder {models} holds model.toml weights.safetensors but no config.toml: "
        "name the config file config.toml, or set FFN_CONFIG to it (the built-in demo model is served only "
        "from an empty folder)"
    )


def test_an_explicit_config_or_another_command_is_not_in_the_way(tmp_path: Path) -> None:
    models = folder(tmp_path, "model.toml")
    code, _, seen = run_entrypoint(tmp_path, models, env={"FFN_CONFIG": str(models / "model.toml")})
    assert code == 0 and seen["config"] == str(models / "model.toml")
    code, _, seen = run_entrypoint(tmp_path, models, "ffn-extract", "--help")
    assert code == 0 and seen["command"] == "ffn-extract"


def test_hidden_files_readmes_and_lost_found_leave_a_folder_empty(tmp_path: Path) -> None:
    models = folder(tmp_path, ".gitignore", "README.md")
    (models / "lost+found").mkdir()
    code, stderr, seen = run_entrypoint(tmp_path, models)
    assert code == 0, stderr
    assert seen == {"command": "ffn-serve", "args": [], "config": None}  # the built-in demo


def test_a_config_toml_that_is_there_but_broken_goes_to_ffn_serve_which_says_why(tmp_path: Path) -> None:
    models = folder(tmp_path)
    (models / "config.toml").symlink_to(tmp_path / "nowhere.toml")  # a dangling link: not a file
    code, _, seen = run_entrypoint(tmp_path, models, "--port", "9000")
    assert code == 0 and seen["config"] == str(models / "config.toml") and seen["args"] == ["--port", "9000"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any folder; docker_check.py runs this case as UID 10001")
def test_an_unreadable_folder_stops_the_start(tmp_path: Path) -> None:
    models = folder(tmp_path, "config.toml")
    models.chmod(0)
    try:
        code, stderr, seen = run_entrypoint(tmp_path, models)
    finally:
        models.chmod(0o755)
    assert (code, seen) == (2, None)
    assert stderr.startswith(f"ffn-entrypoint: cannot read the model folder {models} as uid {os.geteuid()}")
