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
    out = []
    for _ in range(config.payloads):
        rows = int(rng.integers(lo, hi + 1))
        array = rng.standard_normal((rows, d_model), dtype=np.float32)
        request = encode_request(config.model, array, config.encoding, config.dtype, config.deadline_ms)
        out.append((request.path, request.body, request.headers, rows))
    return out


async def discover_d_model(http: httpx.AsyncClient, model: str) -> int:
    """The model's d_model from GET /v1/models, or else from its V2 metadata; the error says why not."""
    try:
        response = await http.get("/v1/models")
        if response.status_code == 200:
            for entry in response.json().get("models", []):
                if entry.get("name") == model and "d_model" in entry:
                    return int(entry["d_model"])
        response = await http.get(f"/v2/models/{quote(model, safe='')}")
        if response.status_code == 200:
            return int(response.json()["inputs"][0]["shape"][-1])
        cause = str(error_from_response(response.status_code, response.headers, response.content))
    except httpx.TransportError as exc:
        raise ConnectionError(f"cannot reach {http.base_url}: {type(exc).__name__}: {exc}") from exc
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        cause = f"{response.request.url} answered what is not model metadata ({type(exc).__name__}: {exc})"
    raise LookupError(f"cannot find d_model of model {model!r} at {http.base_url}: {cause}; pass --d-model")
