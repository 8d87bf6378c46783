"""End to end: the real `ffn-serve` command on a free 127.0.0.1 port with a TOML config, via httpx."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from ffn_core import FFNConfig, build_ffn, save_ffn
from ffn_testing import free_port, metric_value, start_server
from tests.reference import numpy_ffn, numpy_weights

pytestmark = pytest.mark.server  # every test here starts ffn-serve processes

D_MODEL, D_FF = 64, 256
ACTIVATION = {"geglu": "gelu", "relu": "relu"}  # the served models' activations, for the reference


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, dict]:
    """A folder with ffn.toml and two models: a GEGLU in a native file, a ReLU in a torch one; their numpy weights."""
    folder: Path = tmp_path_factory.mktemp("models")
    torch.manual_seed(7)
    geglu = build_ffn(FFNConfig(d_model=D_MODEL, d_ff=D_FF, activation="gelu", gated=True))
    relu = build_ffn(FFNConfig(d_model=D_MODEL, d_ff=D_FF, activation="relu"))
    save_ffn(geglu, folder / "geglu.safetensors")
    torch.save(relu.state_dict(), folder / "relu.pt")
    (folder / "ffn.toml").write_text(
        "max_batch_rows = 256\nmax_wait_ms = 0\n\n"
        '[[models]]\nname = "geglu"\nweights = "geglu.safetensors"\n\n'
        '[[models]]\nname = "relu"\nweights = "relu.pt"\nformat = "torch"\nactivation = "relu"\n'
    )
    return folder, {"geglu": numpy_weights(geglu), "relu": numpy_weights(relu)}


@pytest.fixture(scope="module")
def served(models):
    """ffn-serve on the models' TOML config: greedy batches (max_wait_ms = 0) of at most 256 rows."""
    folder, weights = models
    with start_server(env={"FFN_TORCH_THREADS": "1"}, config=folder / "ffn.toml") as server:
        yield server.url, weights
    assert server.returncode == 0, "ffn-serve must exit 0 after SIGTERM"


def test_ready_live_and_models(served):
    url, _ = served
    assert httpx.get(f"{url}/v2/health/live").status_code == 200
    models = {m["name"]: m for m in httpx.get(f"{url}/v1/models").json()["models"]}
    assert models["geglu"]["variant"] == "geglu" and models["geglu"]["d_ff"] == D_FF
    assert models["relu"]["variant"] == "relu" and models["relu"]["format"] == "torch"


def test_each_model_matches_numpy(served):
    url, weights = served
    x = np.random.default_rng(0).standard_normal((9, D_MODEL)).astype(np.float32)
    for name, activation in ACTIVATION.items():
        r = httpx.post(f"{url}/v1/models/{name}/transform", json={"inputs": x.tolist()})
        assert r.status_code == 200, r.text
        expected = numpy_ffn(x, weights[name], activation)
        np.testing.assert_allclose(np.array(r.json()["outputs"]), expected, rtol=1e-5, atol=1e-5)


async def test_batch_invariance_under_load(served, models):
    """64 concurrent requests of 1..300 rows in one batch: row for row what each gives alone, and numpy.

    Together they go to a second server whose one batch holds all their rows and waits a second
    (the most max_wait_ms allows) for them, so they share batches however slowly a loaded test
    machine sends them (a greedy batcher shares only what arrives during a pass: from a starved
    client, nothing; a CI run saw 64 batches for the 64). Alone, each goes to the
    greedy server, in passes of at most 256 rows.
    """
    url, weights = served
    folder, _ = models
    rng = np.random.default_rng(42)
    inputs = [rng.standard_normal((int(rng.integers(1, 301)), D_MODEL)).astype(np.float32) for _ in range(64)]
    total_rows = sum(len(x) for x in inputs)
    headers = {"content-type": "application/octet-stream", "accept": "application/octet-stream"}

    async def send(client: httpx.AsyncClient, base: str, x: np.ndarray) -> np.ndarray:
        r = await client.post(
            f"{base}/v1/models/geglu/transform",
            content=x.tobytes(),
            headers=headers | {"x-shape": f"{x.shape[0]},{D_MODEL}"},
        )
        assert r.status_code == 200, r.text
        return np.frombuffer(r.content, dtype="<f4").reshape(x.shape)

    one_batch = ["--max-batch-rows", str(total_rows), "--max-queue-rows", str(total_rows), "--max-wait-ms", "1000"]
    env = {"FFN_TORCH_THREADS": "1", "FFN_WARMUP": "false", "FFN_GRPC": "false"}
    with start_server(env=env, config=folder / "ffn.toml", args=one_batch) as batching:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64), timeout=120) as client:
            together = await asyncio.gather(*(send(client, batching.url, x) for x in inputs))
        batches = metric_value(httpx.get(f"{batching.url}/metrics").text, "ffn_batch_rows_count", model="geglu")
    # One batch unless the client took over a second to send them; 32 only if each took 2 s.
    assert 1 <= batches < len(inputs) / 2, f"{batches} batches for {len(inputs)} concurrent requests"
    async with httpx.AsyncClient(timeout=60) as client:
        alone = [await send(client, url, x) for x in inputs]
    for x, y_together, y_alone in zip(inputs, together, alone, strict=True):
        np.testing.assert_allclose(y_together, y_alone, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(y_together, numpy_ffn(x, weights["geglu"], "gelu"), rtol=1e-5, atol=1e-5)


def test_unloadable_model_stops_the_start(tmp_path):
    (tmp_path / "bad.toml").write_text('[[models]]\nname = "broken"\nweights = "missing.safetensors"\n')
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "app.cli",
            "--config",
            str(tmp_path / "bad.toml"),
            "--port",
            str(free_port()),
            "--grpc-port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "missing.safetensors" in result.stderr and "broken" in result.stderr


def test_invalid_config_is_refused(tmp_path):
    (tmp_path / "bad.toml").write_text("max_batch_rows = 0\n")
    result = subprocess.run(
        [sys.executable, "-m", "app.cli", "--config", str(tmp_path / "bad.toml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "max_batch_rows" in result.stderr


def test_the_ffn_serve_console_script():
    """The installed `ffn-serve` command itself: built-in demo model, ready, an answer, exit 0 on SIGTERM."""
    script = Path(sys.executable).with_name("ffn-serve")
    if not script.exists():
        pytest.skip(f"ffn-serve is not installed beside {sys.executable}")
    with start_server(env={"FFN_MAX_BATCH_ROWS": "64"}, command=[str(script)]) as server:
        r = httpx.post(f"{server.url}/v1/models/demo/transform", json={"inputs": [[0.5] * 512]})
        assert r.status_code == 200 and r.json()["shape"] == [1, 512]
        assert server.stop() == 0
