"""What a load run sends, settled before it starts: the model's width, asked of the server, and the bodies.

Bodies are encoded once, up front, so that the run itself only puts prebuilt bytes on the wire.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import quote

import httpx
import numpy as np

from ffn_client.encodings import encode_request
from ffn_client.errors import error_from_response

if TYPE_CHECKING:
    from ffn_client.load import LoadConfig


def make_payloads(config: LoadConfig, d_model: int) -> list[tuple[str, bytes, dict[str, str], int]]:
    """`config.payloads` encoded requests of random rows in the configured range: (path, body, headers, rows)."""
    rng = np.random.default_rng(config.seed)
    lo, hi = config.rows
    out: list[tuple[str, bytes, dict[str, str], int]] = []
    for _ in range(config.payloads):
        rows = int(rng.integers(lo, hi + 1))
        array = rng.standard_normal((rows, d_model), dtype=np.float32)
        if config.over_grpc:  # a serialized ModelInferRequest: the gRPC senders send it as it is
            from ffn_client.grpc_load import infer_request

            out.append(("", infer_request(config.model, array, config.dtype, config.deadline_ms), {}, rows))
            continue
        request = encode_request(config.model, array, config.encoding, config.dtype, config.deadline_ms)
        out.append((request.path, request.body, request.headers, rows))
    return out


async def discover_d_model(http: httpx.AsyncClient, model: str) -> int:
    """The model's d_model from GET /v1/models, or else from its V2 metadata.

    Otherwise LookupError, saying what the server answered (status, error_type, message) and
    what to change: the API key, the model name, or --d-model for a server that does not say.
    """
    where = f"cannot find d_model of model {model!r} at {http.base_url}"
    served: list[str] = []
    try:
        response = await http.get("/v1/models")
        if response.status_code == 200:
            for entry in response.json().get("models", []):
                if entry.get("name") == model and "d_model" in entry:
                    return int(entry["d_model"])
                served.append(str(entry.get("name")))
        if response.status_code not in (401, 403):  # the V2 route would be refused alike
            response = await http.get(f"/v2/models/{quote(model, safe='')}")
            if response.status_code == 200:
                return int(response.json()["inputs"][0]["shape"][-1])
    except httpx.TransportError as exc:
        raise ConnectionError(f"cannot reach {http.base_url}: {type(exc).__name__}: {exc}") from exc
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        raise LookupError(
            f"{where}: {response.request.url} answered what is not model metadata ({type(exc).__name__}: {exc}); "
            "pass --d-model"
        ) from exc
    error = error_from_response(response.status_code, response.headers, response.content)
    raise LookupError(f"{where}: the server answered {error}{_what_to_change(error.status, served)}")


def _what_to_change(status: int | None, served: list[str]) -> str:
    if status in (401, 403):
        return "; pass its key with --api-key (or FFN_API_KEY)"
    if status == 404:
        return f"; it serves {', '.join(map(repr, served))}: pass one with --model" if served else "; check --url"
    if status == 503:
        return "; it is not ready: wait until GET /v2/health/ready answers 200"
    return ""
