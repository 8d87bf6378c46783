"""Pydantic models of the Open Inference Protocol bodies, for /openapi.json and metadata answers."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, JsonValue

from ffn_core.dtypes import BY_V2



def _datatype() -> Any:
    """A required `datatype` field, its choices from the one dtype table."""
    choices: list[JsonValue] = [*sorted(BY_V2)]
    return Field(json_schema_extra={"enum": choices})


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class TensorMetadata(BaseModel):
    name: str
    datatype: str = _datatype()
    shape: list[int] = Field(description="-1 marks a variable dimension.")


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class InferInput(BaseModel):
    name: Literal["input"]
    shape: list[int] = Field(description="[rows, d_model] or [batch, seq, d_model].")
    datatype: str = _datatype()
    parameters: dict[str, Any] | None = Field(default=None, description="binary_data_size for binary inputs.")
    data: list[Any] | None = Field(default=None, description="Row-major values, flat or nested.")


class InferRequestedOutput(BaseModel):
    name: Literal["output"]
    parameters: dict[str, Any] | None = Field(default=None, description="binary_data: true for a binary output.")


class InferRequest(BaseModel):
    id: str | None = None
    parameters: dict[str, Any] | None = Field(
        default=None, description="binary_data_output: true for binary outputs; timeout in microseconds."
    )
    inputs: list[InferInput] = Field(min_length=1, max_length=1)
    outputs: list[InferRequestedOutput] | None = None


class InferOutput(BaseModel):
    name: str
    shape: list[int]
    datatype: str = _datatype()
    parameters: dict[str, Any] | None = None
    data: list[float] | None = None


class InferResponse(BaseModel):
    model_name: str
    model_version: str | None = None
    id: str | None = None
    parameters: dict[str, Any] | None = None
    outputs: list[InferOutput]
