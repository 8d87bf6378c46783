"""Monte Carlo dropout from the client: N stochastic passes, answered as their mean and spread.

The request is an ordinary transform with three parameters, `mc_passes`, `mc_seed` and
`mc_dropout`: the query string of the native route, the request `parameters` of V2. The answer
holds the mean and the standard deviation: `mean` and `std` in native JSON, the two stacked
([2, *shape], mean first) in raw bytes and .npy, the outputs `output` and `output_std` in V2; and
the parameters used (X-MC-* headers, JSON members, the V2 answer's `parameters`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ffn_client.encodings import (
    V2_OUTPUT,
    EncodedRequest,
    decode_response,
    encode_request,
    loads,
    v2_answer,
)
from ffn_client.errors import ProtocolError

V2_STD = "output_std"


@dataclass(frozen=True)
class MonteCarloResult:
    """The mean and standard deviation over `passes` dropout passes, each in the input's shape.

    `std` is Bessel-corrected. `seed` is the masks' seed the server used (drawn by it when none
    was sent): sent back with the same input and model, it gives the same answer.
    """

    mean: np.ndarray
    std: np.ndarray
    passes: int
    dropout: float
    seed: int


def encode_mc_request(
    model: str,
    array: np.ndarray,
    passes: int,
    *,
    seed: int | None = None,
    dropout: float | None = None,
    encoding: str = "binary",
    dtype: str | None = None,
    timeout_ms: float | None = None,
) -> EncodedRequest:
    """The Monte Carlo dropout request for `array`; the arguments are those of `encode_request`."""
    parameters: dict[str, int | float] = {"mc_passes": passes}
    if seed is not None:
        parameters["mc_seed"] = seed
    if dropout is not None:
        parameters["mc_dropout"] = dropout
    return encode_request(model, array, encoding, dtype, timeout_ms, parameters=parameters, outputs=(V2_OUTPUT, V2_STD))


def decode_mc_response(request: EncodedRequest, headers: Mapping[str, str], body: bytes) -> MonteCarloResult:
    """The mean, standard deviation and parameters of a 200 answer to a Monte Carlo request."""
    if request.encoding.startswith("v2-"):
        answer, tensors = v2_answer(headers, body)
        if V2_OUTPUT not in tensors or V2_STD not in tensors:
            raise ProtocolError(f"V2 answer lacks {V2_OUTPUT!r} or {V2_STD!r}: it has {sorted(tensors)}")
        mean, std = (_shaped(tensors[name], request) for name in (V2_OUTPUT, V2_STD))
        return _result(mean, std, answer.get("parameters"))
    if request.encoding == "json":
        document = loads(body)
        if not isinstance(document, dict) or "mean" not in document or "std" not in document:
            raise ProtocolError(f"JSON answer has no `mean` and `std`: {bytes(body[:200])!r}")
        mean, std = (_shaped(np.asarray(document[key], dtype=np.float32), request) for key in ("mean", "std"))
        return _result(mean, std, document)
    # Raw bytes and .npy: the two stacked, read as one tensor of shape [2, *shape].
    stacked = EncodedRequest(request.encoding, request.path, b"", {}, (2, *request.shape), request.dtype)
    both = decode_response(stacked, headers, body)
    echoed = {name: headers.get(f"x-{name.replace('_', '-')}") for name in ("mc_passes", "mc_dropout", "mc_seed")}
    return _result(both[0], both[1], echoed)


def _shaped(values: np.ndarray, request: EncodedRequest) -> np.ndarray:
    if values.size != np.prod(request.shape):
        raise ProtocolError(f"answer has shape {list(values.shape)}, expected {list(request.shape)}")
    return values.reshape(request.shape)


def _result(mean: np.ndarray, std: np.ndarray, echoed: object) -> MonteCarloResult:
    """The result, with the parameters the server says it used (JSON members or header text)."""
    if not isinstance(echoed, Mapping):
        raise ProtocolError(f"the answer does not say its Monte Carlo parameters: {echoed!r:.200}")
    try:
        passes, dropout, seed = int(echoed["mc_passes"]), float(echoed["mc_dropout"]), int(echoed["mc_seed"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"bad Monte Carlo parameters in the answer {dict(echoed)!r:.200}: {exc}") from None
    return MonteCarloResult(mean=mean, std=std, passes=passes, dropout=dropout, seed=seed)
