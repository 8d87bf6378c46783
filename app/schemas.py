"""Pydantic models of the wire formats, for the OpenAPI page and the small JSON answers.

The tensor routes do not validate their bodies through these (a float at a time through
pydantic is far too slow): the codecs parse them with orjson and numpy. These models only
describe the same shapes so that /openapi.json stays accurate.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

Matrix = list[list[float]]
Tensor3 = list[list[list[float]]]


class ErrorBody(BaseModel):
    error: str = Field(description="What was wrong, for a person to read.")
    error_type: str = Field(description="The kind of error, for a program: invalid_input, model_not_found, ...")


class TransformRequest(BaseModel):
    inputs: Matrix | Tensor3 = Field(
        description="Embeddings, shape [rows, d_model] or [batch, seq, d_model]; finite float32 numbers."
    )


class TransformResponse(BaseModel):
    model: str
    shape: list[int] = Field(description="The output's shape: the same as the input's.")
    dtype: Literal["float32"] = "float32"
    outputs: Matrix | Tensor3


class BiasFlags(BaseModel):
    layer1: bool
    layer2: bool
    linear_v: bool | None


class ModelInfo(BaseModel):
    name: str
    d_model: int
    d_ff: int
    activation: str
    gated: bool
    variant: str = Field(description="relu, gelu, gelu_tanh, silu, reglu, geglu, swiglu, bilinear, ...")
    bias: BiasFlags
    dtype: Literal["float32", "float16", "bfloat16"]
    device: str
    format: str
    ready: bool


class ModelList(BaseModel):
    models: list[ModelInfo]


def error_responses(*statuses: int) -> dict[int | str, dict[str, object]]:
    """OpenAPI entries for the error statuses a route can answer."""
    described = {
        400: "Malformed or mismatched input.",
        401: "Missing or wrong API key.",
        404: "Unknown model.",
        406: "Unsupported Accept.",
        413: "Body too large.",
        415: "Unsupported Content-Type or Content-Encoding.",
        429: "Queue full; retry after the Retry-After header's seconds.",
        503: "Not ready, or draining before shutdown.",
        504: "Deadline passed while queued.",
        507: "The request alone does not fit in the device's memory.",
    }
    return {status: {"model": ErrorBody, "description": described[status]} for status in statuses}
