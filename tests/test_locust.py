"""bench/locustfile.py: Locust, headless, against a real server, every answer checked against numpy.

Locust monkeypatches the process that imports it (gevent), so it runs in subprocesses only: the
locustfile's own numpy FFN is checked against tests/reference.py's for every variant through a
small script, and two headless runs of a few seconds hit a real server serving a gated GELU
model: with the right weights no answer fails; pointed at other weights (the control), every
answer is a failure naming why and the run exits 1.
"""

from __future__ import annotations

import csv
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from ffn_core import FFNConfig, build_ffn, save_ffn
from ffn_testing import ServerProcess, start_server
from tests.reference import numpy_ffn, numpy_weights

LOCUST = shutil.which("locust", path=str(Path(sys.executable).parent)) or shutil.which("locust")
LOCUSTFILE = Path(__file__).resolve().parent.parent / "bench" / "locustfile.py"
D_MODEL = 16

pytestmark = pytest.mark.skipif(LOCUST is None, reason="locust is not installed (the test extra has it)")


def write_model(path: Path, seed: int, **config: object) -> dict[str, np.ndarray]:
    torch.manual_seed(seed)
    model = build_ffn(FFNConfig(d_model=D_MODEL, d_ff=64, **config))  # type: ignore[arg-type]  # keyword fields
    save_ffn(model, path)
    return numpy_weights(model)


VARIANTS = {
    "relu": {"activation": "relu"},
    "gelu-no-bias": {"activation": "gelu", "bias1": False, "bias2": False},
    "gelu_tanh": {"activation": "gelu_tanh"},
    "swiglu": {"activation": "silu", "gated": True},
    "geglu": {"activation": "gelu", "gated": True, "bias_gate": False},
    "bilinear": {"activation": "identity", "gated": True},
}


def test_the_locustfiles_numpy_ffn_is_the_reference_for_every_variant(tmp_path: Path) -> None:
    x = np.random.default_rng(3).standard_normal((5, D_MODEL))
    np.save(tmp_path / "x.npy", x)
    params = {
        name: write_model(tmp_path / f"{name}.safetensors", i, **cfg) for i, (name, cfg) in enumerate(VARIANTS.items())
    }
    script = (
        "import sys, numpy as np\n"
        f"sys.path.insert(0, {str(LOCUSTFILE.parent)!r})\n"
        "from locustfile import expected_answers\n"
        f"folder = {str(tmp_path)!r}\n"
        "x = np.load(folder + '/x.npy')\n"
        f"for name in {list(VARIANTS)!r}:\n"
        "    np.save(f'{folder}/{name}.y.npy', expected_answers(f'{folder}/{name}.safetensors', x))\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120, capture_output=True)
    for name, cfg in VARIANTS.items():
        expected = numpy_ffn(x, params[name], str(cfg["activation"]))
        np.testing.assert_allclose(np.load(tmp_path / f"{name}.y.npy"), expected, rtol=1e-12, atol=1e-12)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    """A real server serving `m`, a gated GELU model (the erf path and the gate), from its folder."""
    folder = tmp_path_factory.mktemp("locust")
    write_model(folder / "m.safetensors", 1, activation="gelu", gated=True)
    write_model(folder / "other.safetensors", 2, activation="gelu", gated=True)
    (folder / "ffn.toml").write_text('[[models]]\nname = "m"\nweights = "m.safetensors"\n')
    with start_server(env={"FFN_LOG_LEVEL": "warning"}, config=folder / "ffn.toml") as server:
        yield server, folder


def locust(server: ServerProcess, weights: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """A headless run of 4 users for 10 s; its statistics go to `out`_stats.csv and _failures.csv.

    10 s, not less: on a machine loaded by other work a 3 s run once ended before any request was answered.
    """
    assert LOCUST is not None
    command = [LOCUST, "-f", str(LOCUSTFILE), "--headless", "-u", "4", "-r", "4", "-t", "10s"]
    command += ["--host", server.url, "--csv", str(out), "--exit-code-on-error", "1", "--only-summary"]
    command += ["--ffn-model", "m", "--ffn-weights", str(weights), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def totals(out: Path) -> tuple[int, int]:
    """(requests, failures) of the run's Aggregated row."""
    with open(f"{out}_stats.csv", newline="") as f:
        (row,) = [row for row in csv.DictReader(f) if row["Name"] == "Aggregated"]
    return int(row["Request Count"]), int(row["Failure Count"])


@pytest.mark.server
def test_a_headless_run_against_the_right_weights_has_no_failure(
    served: tuple[ServerProcess, Path], tmp_path: Path
) -> None:
    server, folder = served
    run = locust(server, folder / "m.safetensors", tmp_path / "right", "--ffn-rows", "3")
    assert run.returncode == 0, run.stdout + run.stderr
    requests, failures = totals(tmp_path / "right")
    assert requests > 0 and failures == 0, (requests, failures)


@pytest.mark.server
def test_answers_that_are_not_the_weights_fail_and_the_run_exits_1(
    served: tuple[ServerProcess, Path], tmp_path: Path
) -> None:
    """The control: the same server, the locustfile told other weights; V2 JSON answers, decoded and compared."""
    server, folder = served
    run = locust(server, folder / "other.safetensors", tmp_path / "wrong", "--ffn-protocol", "v2")
    assert run.returncode == 1, run.stdout + run.stderr
    requests, failures = totals(tmp_path / "wrong")
    assert requests > 0 and failures == requests
    with open(tmp_path / "wrong_failures.csv", newline="") as f:
        errors = {row["Error"] for row in csv.DictReader(f)}
    assert errors == {"CatchResponseError('wrong answer: off by more than 0.0001 of its scale')"}
