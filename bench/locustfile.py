"""Locust against ffn-serve, every answer checked against numpy arithmetic on the model's weights.

    locust -f bench/locustfile.py --host http://127.0.0.1:8000 --headless -u 16 -r 16 -t 30s \\
        --ffn-model m --ffn-weights /models/m.safetensors

Each simulated user sends requests of `--ffn-rows` rows, raw float32 on the native route (or V2
JSON with `--ffn-protocol v2`), taken from a pool of fixed random rows whose answers were worked
out once at start, in float64 numpy, from the weights file the server serves: a native safetensors
file (what `ffn-extract` and `ffn_core.save_ffn` write; its metadata says the activation and
whether it is gated, `--ffn-activation` where it does not). An answer other than the expected one,
to `--ffn-rtol` (float32's by default; widen it for float16 or bfloat16 models), counts as a
failure in Locust's statistics with what differed; so does any status but 200. With
`--exit-code-on-error 1` a run with any failure exits 1.

Imports locust, numpy and safetensors only: no torch and nothing of the server, so it runs on a
machine that only sends load.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from locust import FastHttpUser, events, task
from locust.env import Environment
from safetensors import safe_open

POOL_ROWS = 256  # rows whose answers are worked out at start; each request sends a slice of them
POOL_SEED = 20240611

_erf = np.vectorize(math.erf, otypes=[np.float64])
ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "relu": lambda z: np.maximum(z, 0.0),
    "gelu": lambda z: 0.5 * z * (1.0 + _erf(z / math.sqrt(2.0))),
    "gelu_tanh": lambda z: 0.5 * z * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z**3))),
    "silu": lambda z: z / (1.0 + np.exp(-z)),
    "identity": lambda z: z,
}


def expected_answers(path: str, x: np.ndarray, activation: str | None = None) -> np.ndarray:
    """y = f(x W1ᵀ + b1) [⊙ (x Vᵀ + c)] W2ᵀ + b2 in float64, from a native weights file (seeds' names)."""
    with safe_open(path, framework="numpy") as weights:
        params = {key: weights.get_tensor(key).astype(np.float64) for key in weights.keys()}  # noqa: SIM118
        stored = json.loads((weights.metadata() or {}).get("ffn_config", "{}"))
    activation = activation or stored.get("activation")
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"{path}: no activation in its metadata and none given, or an unknown one ({activation!r}); "
            f"pass --ffn-activation, one of {', '.join(ACTIVATIONS)}"
        )
    hidden = ACTIVATIONS[activation](x @ params["layer1.weight"].T + params.get("layer1.bias", 0.0))
    if "linear_v.weight" in params:  # gated (GLU family)
        hidden = hidden * (x @ params["linear_v.weight"].T + params.get("linear_v.bias", 0.0))
    return hidden @ params["layer2.weight"].T + params.get("layer2.bias", 0.0)


@dataclass(frozen=True)
class Reference:
    """The pool of rows, their expected answers, and how requests are made and checked."""

    model: str
    x: np.ndarray  # (POOL_ROWS, d_model) float32, as sent
    y: np.ndarray  # (POOL_ROWS, d_model) float64
    rows: int
    protocol: str
    rtol: float

    def mismatch(self, start: int, answer: np.ndarray) -> str | None:
        """What differs between `answer` and the expected rows from `start`; None if it is right."""
        expected = self.y[start : start + self.rows]
        if answer.shape != expected.shape:
            return f"answer of shape {answer.shape}, expected {expected.shape}"
        allowed = self.rtol * max(1.0, float(np.abs(expected).max()))
        if float(np.abs(answer - expected).max()) <= allowed:
            return None
        # One message for every wrong answer, so that Locust's failures table groups them in one row.
        return f"wrong answer: off by more than {self.rtol:g} of its scale"


REFERENCE: list[Reference] = []  # set once per process, when Locust starts (the `init` event)


@events.init_command_line_parser.add_listener
def _arguments(parser) -> None:  # type: ignore[no-untyped-def]  # Locust's configargparse parser
    parser.add_argument("--ffn-model", default="demo", help="the served model's name")
    parser.add_argument("--ffn-weights", default="", help="the native safetensors file the model serves (required)")
    parser.add_argument("--ffn-activation", default="", help="the activation, where the file's metadata has none")
    parser.add_argument("--ffn-rows", type=int, default=1, help="rows per request (at most 256)")
    parser.add_argument("--ffn-protocol", choices=["native", "v2"], default="native", help="raw float32 or V2 JSON")
    parser.add_argument("--ffn-rtol", type=float, default=1e-4, help="tolerance, relative to the answer's scale")


@events.init.add_listener
def _work_out_the_answers(environment: Environment, **_: object) -> None:
    options = environment.parsed_options
    if options is None:
        return
    if not options.ffn_weights:
        raise SystemExit("locustfile: --ffn-weights names the model's weights file, to check every answer against")
    if not 1 <= options.ffn_rows <= POOL_ROWS:
        raise SystemExit(f"locustfile: --ffn-rows must be 1 to {POOL_ROWS}")
    with safe_open(options.ffn_weights, framework="numpy") as weights:
        d_model = weights.get_slice("layer1.weight").get_shape()[1]
    x = np.random.default_rng(POOL_SEED).standard_normal((POOL_ROWS, d_model)).astype(np.float32)
    y = expected_answers(options.ffn_weights, x.astype(np.float64), options.ffn_activation or None)
    REFERENCE[:] = [Reference(options.ffn_model, x, y, options.ffn_rows, options.ffn_protocol, options.ffn_rtol)]


class FfnUser(FastHttpUser):
    """One client: a request at a time, each from a random place in the pool, each answer checked."""

    @task
    def transform(self) -> None:
        ref = REFERENCE[0]
        start = random.randrange(POOL_ROWS - ref.rows + 1)
        x = ref.x[start : start + ref.rows]
        if ref.protocol == "native":
            path, name = f"/v1/models/{ref.model}/transform", "native transform"
            headers = {
                "Content-Type": "application/octet-stream",
                "Accept": "application/octet-stream",
                "X-Shape": f"{x.shape[0]},{x.shape[1]}",
                "X-Dtype": "float32",
            }
            body = x.tobytes()
        else:
            path, name = f"/v2/models/{ref.model}/infer", "v2 infer"
            headers = {"Content-Type": "application/json"}
            tensor = {"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}
            body = json.dumps({"inputs": [tensor]}).encode()
        with self.client.post(path, data=body, headers=headers, name=name, catch_response=True) as response:
            if response.status_code != 200:
                response.failure(f"status {response.status_code}: {(response.text or '')[:200]}")
                return
            try:
                answer = _decode(ref.protocol, response.content or b"", x.shape)
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                response.failure(f"unreadable answer: {exc}")
                return
            wrong = ref.mismatch(start, answer)
            if wrong is None:
                response.success()
            else:
                response.failure(wrong)


def _decode(protocol: str, content: bytes, shape: tuple[int, ...]) -> np.ndarray:
    if protocol == "native":
        return np.frombuffer(content, dtype="<f4").astype(np.float64).reshape(shape)
    (output,) = json.loads(content)["outputs"]
    return np.asarray(output["data"], dtype=np.float64).reshape(output["shape"])
