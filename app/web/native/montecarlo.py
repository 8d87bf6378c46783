"""Monte Carlo dropout on the native route: query parameters in, mean and standard deviation out.

`POST /v1/models/{name}/transform?mc_passes=32&mc_seed=7&mc_dropout=0.1`, whatever the body's
encoding. The answer: JSON `{"model", "shape", "dtype", "mc_passes", "mc_dropout", "mc_seed",
"mean", "std"}`; raw bytes or `.npy` hold the two stacked, shape [2, *shape] (index 0 the
mean, 1 the std). Every encoding also carries the parameters used as X-MC-* headers.
"""

from __future__ import annotations

import io
from urllib.parse import parse_qsl

import numpy as np
import orjson
import torch

from app.engine.montecarlo import MonteCarloRequest, MonteCarloResult
from app.web import montecarlo
from app.web.errors import InvalidInput
from app.web.native.codec import FLOAT32, MEDIA_TYPE_OF, DecodedInput, Encoding
from app.web.tensors import raw_bytes, to_wire_dtype

HEADERS = {montecarlo.PASSES: "x-mc-passes", montecarlo.DROPOUT: "x-mc-dropout", montecarlo.SEED: "x-mc-seed"}


def query_parameters(query: bytes) -> dict[str, str]:
    """The query string's Monte Carlo parameters; any other name, or one given twice, is refused."""
    try:
        pairs = parse_qsl(query.decode("ascii"), keep_blank_values=True, strict_parsing=True)
    except (UnicodeDecodeError, ValueError):
        raise InvalidInput(f"malformed query string {query[:64]!r}") from None
    values: dict[str, str] = {}
    for name, value in pairs:
        if name not in montecarlo.NAMES:
            raise InvalidInput(f"unknown query parameter {name[:32]!r}; this route takes {list(montecarlo.NAMES)}")
        if name in values:
            raise InvalidInput(f"query parameter {name!r} given twice")
        values[name] = value
    return values


def encode(
    model: str, result: MonteCarloResult, request: MonteCarloRequest, decoded: DecodedInput, encoding: Encoding
) -> tuple[bytes | memoryview, dict[str, str]]:
    """The answer's body and headers in `encoding`: JSON with mean and std, or the two stacked."""
    parameters = montecarlo.echoed(request)
    headers = {HEADERS[name]: str(value) for name, value in parameters.items()}
    if encoding == "json":
        # Through to_wire_dtype like the plain answer: inf or NaN is a 422, never written as null.
        mean, std = (to_wire_dtype(t, FLOAT32).numpy().reshape(decoded.shape) for t in (result.mean, result.std))
        body = orjson.dumps(
            {"model": model, "shape": list(decoded.shape), "dtype": "float32", **parameters, "mean": mean, "std": std},
            option=orjson.OPT_SERIALIZE_NUMPY,
        )
        return body, {"content-type": MEDIA_TYPE_OF["json"], **headers}
    stacked = to_wire_dtype(torch.stack([result.mean, result.std]), decoded.dtype)  # (2, rows, d_model)
    shape = (2, *decoded.shape)
    if encoding == "npy":
        buffer = io.BytesIO()
        np.save(buffer, stacked.numpy().reshape(shape), allow_pickle=False)
        return buffer.getvalue(), {"content-type": MEDIA_TYPE_OF["npy"], **headers}
    return raw_bytes(stacked), {
        "content-type": MEDIA_TYPE_OF["raw"],
        "x-shape": ",".join(map(str, shape)),
        "x-dtype": decoded.dtype.name,
        **headers,
    }
