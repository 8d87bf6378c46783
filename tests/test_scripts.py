"""scripts/serve.sh and scripts/test.sh, run from another folder: paths given to them are the caller's."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from ffn_client import Client
from ffn_core import FFNConfig, build_ffn, save_ffn
from ffn_testing import start_server
from tests.reference import assert_close, numpy_ffn, numpy_weights

pytestmark = pytest.mark.server  # the scripts start ffn-serve, or the test suite, as processes

ROOT = Path(__file__).resolve().parents[1]

# Without .venv the scripts would first set it up, which takes minutes: not a test's job.
needs_venv = pytest.mark.skipif(
    not (ROOT / ".venv" / "bin" / "ffn-serve").exists(), reason="no .venv: run scripts/setup.sh --test first"
)


@needs_venv
def test_serve_sh_reads_a_config_given_relative_to_the_callers_folder(tmp_path: Path) -> None:
    folder = tmp_path / "my-project"
    (folder / "weights").mkdir(parents=True)
    model = build_ffn(FFNConfig(d_model=8, d_ff=24, activation="gelu"))
    save_ffn(model, folder / "weights" / "small.safetensors")
    (folder / "my.toml").write_text(
        'warmup = false\n\n[[models]]\nname = "small"\nweights = "weights/small.safetensors"\n'
    )
    serve_sh = ["bash", str(ROOT / "scripts" / "serve.sh")]
    with start_server(command=serve_sh, args=["--config", "my.toml"], cwd=folder) as server:
        with Client(server.url, max_retries=0) as client:
            [listed] = client.models()
            x = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
            y = client.transform("small", x)
    assert (listed["name"], listed["d_model"], listed["d_ff"], listed["activation"]) == ("small", 8, 24, "gelu")
    assert_close(y, numpy_ffn(x, numpy_weights(model), "gelu"))


@needs_venv
def test_test_sh_takes_test_paths_relative_to_the_callers_folder(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "test_probe.py").write_text(
        "def test_one():\n    assert 1 + 1 == 2\n\n\ndef test_two():\n    assert 2 * 2 == 4\n"
    )
    test_sh = ["bash", str(ROOT / "scripts" / "test.sh")]
    one = subprocess.run(
        [*test_sh, "sub/test_probe.py::test_one", "-x"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 0, one.stdout + one.stderr
    assert "1 passed" in one.stdout
    both = subprocess.run([*test_sh, "sub"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert both.returncode == 0, both.stdout + both.stderr
    assert "2 passed" in both.stdout
