"""End to end: the real `ffn-serve` command on a free 127.0.0.1 port with a TOML config, via httpx."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from ffn_core import FFNConfig, build_ffn, save_ffn
from tests.reference import numpy_weights, relu_ffn
from tests.server_process import free_port, running_server

D_MODEL, D_FF = 64, 256


def gelu_glu_reference(x: np.ndarray, w: dict[str, np.ndarray]) -> np.ndarray:
    """GEGLU in float64: (gelu(x W1ᵀ + b1) * (x Vᵀ + c)) W2ᵀ + b2, erf GELU written out."""
    from math import erf

    erf_v = np.vectorize(erf)
    a = x.astype(np.float64) @ w["layer1.weight"].T + w["layer1.bias"]
    gate = x.astype(np.float64) @ w["linear_v.weight"].T + w["linear_v.bias"]
    hidden = 0.5 * a * (1.0 + erf_v(a / np.sqrt(2.0))) * gate
    return hidden @ w["layer2.weight"].T + w["layer2.bias"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """ffn-serve with two models from a TOML config: a GEGLU from a native file, and a ReLU one."""
    folder: Path = tmp_path_factory.mktemp("models")
    torch.manual_seed(7)
    geglu = build_ffn(FFNConfig(d_model=D_MODEL, d_ff=D_FF, activation="gelu", gated=True))
    relu = build_ffn(FFNConfig(d_model=D_MODEL, d_ff=D_FF, activation="relu"))
    save_ffn(geglu, folder / "geglu.safetensors")
    torch.save(relu.state_dict(), folder / "relu.pt")
    (folder / "ffn.toml").write_text(
        'max_batch_rows = 256\nmax_wait_ms = 0\n\n'
        '[[models]]\nname = "geglu"\nweights = "geglu.safetensors"\n\n'
        '[[models]]\nname = "relu"\nweights = "relu.pt"\nformat = "torch"\nactivation = "relu"\n'
    )
    with running_server(env={"FFN_TORCH_THREADS": "1"}, config=folder / "ffn.toml") as server:
        yield server.url, {"geglu": numpy_weights(geglu), "relu": numpy_weights(relu)}
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
    for name, reference in (("geglu", gelu_glu_reference), ("relu", relu_ffn)):
        r = httpx.post(f"{url}/v1/models/{name}/transform", json={"inputs": x.tolist()})
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(np.array(r.json()["outputs"]), reference(x, weights[name]), rtol=1e-5, atol=1e-5)


async def test_batch_invariance_under_load(served):
    """64 concurrent requests of 1..300 rows: row for row what each gives alone, and what numpy gives."""
    url, weights = served
    rng = np.random.default_rng(42)
    inputs = [rng.standard_normal((int(rng.integers(1, 301)), D_MODEL)).astype(np.float32) for _ in range(64)]
    headers = {"content-type": "application/octet-stream", "accept": "application/octet-stream"}

    async def send(client: httpx.AsyncClient, x: np.ndarray) -> np.ndarray:
        r = await client.post(f"{url}/v1/models/geglu/transform", content=x.tobytes(),
                              headers=headers | {"x-shape": f"{x.shape[0]},{D_MODEL}"})
        assert r.status_code == 200, r.text
        return np.frombuffer(r.content, dtype="<f4").reshape(x.shape)

    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:
        together = await asyncio.gather(*(send(client, x) for x in inputs))
        alone = [await send(client, x) for x in inputs]
    metrics = httpx.get(f"{url}/metrics").text
    batches = _metric(metrics, 'ffn_batch_rows_count{model="geglu"}')
    assert batches < 2 * len(inputs), "concurrent requests should have shared batches"
    for x, y_together, y_alone in zip(inputs, together, alone):
        np.testing.assert_allclose(y_together, y_alone, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(y_together, gelu_glu_reference(x, weights["geglu"]), rtol=1e-5, atol=1e-5)


def _metric(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{series} not in /metrics")


def test_unloadable_model_stops_the_start(tmp_path):
    (tmp_path / "bad.toml").write_text('[[models]]\nname = "broken"\nweights = "missing.safetensors"\n')
    result = subprocess.run(
        [sys.executable, "-m", "app.cli", "--config", str(tmp_path / "bad.toml"), "--port", str(free_port())],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode != 0
    assert "missing.safetensors" in result.stderr and "broken" in result.stderr


def test_invalid_config_is_refused(tmp_path):
    (tmp_path / "bad.toml").write_text('max_batch_rows = 0\n')
    result = subprocess.run([sys.executable, "-m", "app.cli", "--config", str(tmp_path / "bad.toml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "max_batch_rows" in result.stderr


def test_the_ffn_serve_console_script(tmp_path):
    """The installed `ffn-serve` command itself: built-in demo model, ready, an answer, exit 0 on SIGTERM."""
    script = Path(sys.executable).with_name("ffn-serve")
    if not script.exists():
        pytest.skip(f"ffn-serve is not installed beside {sys.executable}")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FFN_")} | {"FFN_MAX_BATCH_ROWS": "64"}
    process = subprocess.Popen([str(script), "--port", str(port)], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            assert process.poll() is None, "ffn-serve exited while starting"
            try:
                if httpx.get(f"{url}/v2/health/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        r = httpx.post(f"{url}/v1/models/demo/transform", json={"inputs": [[0.5] * 512]})
        assert r.status_code == 200 and r.json()["shape"] == [1, 512]
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
