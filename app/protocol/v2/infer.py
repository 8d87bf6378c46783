"""The V2 infer step on plain values, written once for every way the HTTP door serves it.

A body's request decoded against the copy serving now (its rows, deadline and Monte Carlo ask),
and the engine's answer encoded with the parameters every V2 answer carries (the copy's digest,
and a Monte Carlo answer's parameters used). The FastAPI route (app/http/v2/routes.py) and the
lean path (app/http/transport/lean.py) both call these, so that the two cannot answer apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from app.engine.facade import ModelFacade
from app.engine.montecarlo import MonteCarloRequest, MonteCarloResult
from app.observe import identity
from app.protocol import mc_parameters
from app.protocol.admission import deadline_from
from app.protocol.digest import ANSWER_PARAMETER, DIGEST_HEADER
from app.protocol.state import ServiceState
from app.protocol.v2 import codec


@dataclass(frozen=True)
class InferCall:
    """A V2 infer request decoded and ready to queue: what to compute, until when, and how."""

    request: codec.V2Request
    deadline: float  # loop time
    monte_carlo: MonteCarloRequest | None  # None: a plain pass


def decoded(state: ServiceState, served: ModelFacade, body: bytes | bytearray, header_length: str | None) -> InferCall:
    """The body's request for `served`, every field checked (400, 413); nothing is queued yet."""
    settings = state.settings
    request = codec.decode(
        body, header_length, served.d_model, settings.max_queue_rows, state.shared_memory, settings.max_body_bytes
    )
    identity.decoded(request.shape, request.dtype.name)
    timeout_ms = None if request.timeout_us is None else request.timeout_us / 1000.0
    deadline = deadline_from(timeout_ms, settings.default_timeout_ms)
    # Most requests carry no parameters: then none asks for Monte Carlo dropout.
    asked = mc_parameters.from_json(request.parameters, served, settings.max_mc_passes) if request.parameters else None
    return InferCall(request, deadline, asked)


def encoded(
    name: str, served: ModelFacade, call: InferCall, answer: np.ndarray | MonteCarloResult
) -> tuple[bytes, dict[str, str]]:
    """The answer's body and headers (the copy's digest among them); 422 if an output is not finite.

    `answer`: the plain pass's rows, or a Monte Carlo request's mean (`output`) and spread (`output_std`)."""
    if isinstance(answer, MonteCarloResult):
        assert call.monte_carlo is not None, "a Monte Carlo answer to a plain request; this is a bug."
        tensors = {codec.OUTPUT_NAME: answer.mean, codec.STD_OUTPUT_NAME: answer.std}
        parameters = {**mc_parameters.echoed(call.monte_carlo), ANSWER_PARAMETER: served.digest}
    else:
        tensors = {codec.OUTPUT_NAME: answer}
        parameters = {ANSWER_PARAMETER: served.digest}
    content, headers = codec.encode(name, served.version, call.request, tensors, parameters)
    headers[DIGEST_HEADER] = served.digest
    return content, headers
