"""ModelDescription: what a served model copy is, as the engine knows it, apart from how any API lists it.

The engine process sends it to its fronts (app/handoff/messages.py's TABLE), which serve the doors
from it; `listing` turns it into GET /v1/models' JSON in every process alike, so that a change of
the public listing is a change here, never one of the protocol between the service's own processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.engine.status import ModelStatus


@dataclass(frozen=True)
class ModelDescription:
    """One model copy: its identity, its shape and variant, where and in what dtype it computes."""

    name: str
    version: int
    digest: str
    d_model: int
    d_ff: int
    activation: str
    gated: bool
    variant: str
    bias_layer1: bool
    bias_layer2: bool
    bias_gate: bool | None  # None: not gated
    dropout: float
    dtype: str  # ffn_core/dtypes.py's name
    device: str  # "cpu", "cuda:0"
    format: str  # the weights' format ("demo" for the built-in weights)
    weight_bytes: int


def listing(description: ModelDescription, status: ModelStatus) -> dict[str, Any]:
    """The model as GET /v1/models lists it, in the state `status`."""
    d = description
    return {
        "name": d.name,
        "version": d.version,
        "digest": d.digest,
        "d_model": d.d_model,
        "d_ff": d.d_ff,
        "activation": d.activation,
        "gated": d.gated,
        "variant": d.variant,
        "bias": {"layer1": d.bias_layer1, "layer2": d.bias_layer2, "linear_v": d.bias_gate},
        "dropout": d.dropout,
        "dtype": d.dtype,
        "device": d.device,
        "format": d.format,
        "ready": status.ready,
        "state": status.state.value,
        "reason": status.reason,
    }
