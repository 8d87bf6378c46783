"""Pydantic models of the native API's bodies, for the OpenAPI page and the small JSON answers.

The transform route does not validate its body through these (a float at a time through
pydantic is far too slow): the codec parses it with orjson and numpy. These models describe
the same shapes so that /openapi.json stays accurate.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from ffn_core.dtypes import DTYPE_NAMES

Matrix = list[list[float]]
Tensor3 = list[list[list[float]]]


class TransformRequest(BaseModel):
    inputs: Matrix | Tensor3 = Field(
        description="Embeddings, shape [rows, d_model] or [batch, seq, d_model]; finite float32 numbers."
    )


class TransformResponse(BaseModel):
    model: str
    shape: list[int] = Field(description="The output's shape: the same as the input's.")
    dtype: Literal["float32"] = "float32"
    outputs: Matrix | Tensor3


class MonteCarloResponse(BaseModel):
    model: str
    shape: list[int] = Field(description="The shape of `mean` and of `std`: the input's.")
    dtype: Literal["float32"] = "float32"
    mc_passes: int
    mc_dropout: float
    mc_seed: int = Field(description="The seed the masks were drawn from: send it again to repeat the answer.")
    mean: Matrix | Tensor3
    std: Matrix | Tensor3 = Field(description="Per-element standard deviation over the passes (Bessel-corrected).")


class BiasFlags(BaseModel):
    layer1: bool
    layer2: bool
    linear_v: bool | None


class ModelInfo(BaseModel):
    name: str
    version: int = Field(description="The version of the weights served (V2's model_version).")
    digest: str = Field(
        description="sha256 of the weights and their table (config, dropout, dtype): equal on every replica "
        "and worker that serves the same weights; each answer's X-Model-Digest header says which one answered."
    )
    d_model: int
    d_ff: int
    activation: str
    gated: bool
    variant: str = Field(description="relu, gelu, gelu_tanh, silu, reglu, geglu, swiglu, bilinear, ...")
    bias: BiasFlags
    dropout: float = Field(description="The rate Monte Carlo dropout requests use unless they pass mc_dropout.")
    dtype: str = Field(description="Compute dtype.", json_schema_extra={"enum": list(DTYPE_NAMES)})
    device: str
    format: str
    ready: bool = Field(description="Whether it takes work: state is READY.")
    state: Literal["LOADING", "READY", "UNAVAILABLE"] = Field(
        description="The model's one state, as every surface reports it (health, V2 readiness, repository index)."
    )
    reason: str = Field(description="Why it is not READY; empty when it is.")


class ModelList(BaseModel):
    models: list[ModelInfo]
