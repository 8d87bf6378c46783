"""Pydantic models of the Open Inference Protocol bodies, for /openapi.json and metadata answers."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from ffn_core.dtypes import BY_V2


def _datatype() -> Any:
    """A required `datatype` field, its choices from the one dtype table."""
    choices: list[JsonValue] = [*sorted(BY_V2)]
    return Field(json_schema_extra={"enum": choices})


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class ServerLive(BaseModel):
    live: bool


class ServerReady(BaseModel):
    ready: bool


class ModelReady(BaseModel):
    """What KServe's own server answers for a ready model."""

    name: str
    ready: bool


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
    parameters: dict[str, str] = Field(
        default_factory=dict,
        description="digest: the sha256 of the weights and their table this copy serves (HTTP only: gRPC's "
        "ModelMetadataResponse has no parameters; its model configuration's do).",
    )


# A request's, an input's or an output's parameter: a scalar (an array or an object is refused, 400).
Parameter = bool | int | float | str | None


class InferInput(BaseModel):
    name: Literal["input"]
    shape: list[int] = Field(description="[rows, d_model] or [batch, seq, d_model].")
    datatype: str = _datatype()
    parameters: dict[str, Parameter] | None = Field(default=None, description="binary_data_size for binary inputs.")
    data: list[Any] | None = Field(default=None, description="Row-major values, flat or nested.")


class InferRequestedOutput(BaseModel):
    name: Literal["output", "output_std"] = Field(description="output_std: Monte Carlo dropout requests only.")
    parameters: dict[str, Parameter] | None = Field(default=None, description="binary_data: true for a binary output.")


class InferRequest(BaseModel):
    id: str | None = None
    parameters: dict[str, Parameter] | None = Field(
        default=None,
        description="Scalars: binary_data_output: true for binary outputs; timeout in microseconds; "
        "Monte Carlo dropout: mc_passes (2..max_mc_passes), mc_seed, mc_dropout (a rate in [0, 1)).",
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


# ----- extensions: model configuration, statistics, model repository (Triton's JSON shapes) -----


class ConfigTensor(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    data_type: str = Field(description="TYPE_FP32, TYPE_FP16 or TYPE_BF16: the model's compute dtype.")
    dims: list[int] = Field(description="Without the batch dimension (max_batch_size > 0): [d_model].")


class ModelConfiguration(BaseModel):
    """Triton's ModelConfig as JSON (model_config.proto); the fields this service can fill."""

    model_config = ConfigDict(extra="allow")

    name: str
    platform: str
    backend: str
    max_batch_size: int = Field(description="max_batch_rows: the most rows in one forward pass.")
    input: list[ConfigTensor]
    output: list[ConfigTensor]
    dynamic_batching: dict[str, Any]
    instance_group: list[dict[str, Any]]
    parameters: dict[str, dict[str, str]] = Field(description="FFN details as {key: {string_value}}.")


class DurationStat(BaseModel):
    count: int
    ns: int


class InferenceStats(BaseModel):
    success: DurationStat
    fail: DurationStat
    queue: DurationStat
    compute_input: DurationStat
    compute_infer: DurationStat
    compute_output: DurationStat
    cache_hit: DurationStat
    cache_miss: DurationStat


class MemoryUsage(BaseModel):
    type: str
    id: int
    byte_size: int


class ModelStatistics(BaseModel):
    name: str
    version: str
    last_inference: int = Field(description="Milliseconds since the epoch; 0 before the first.")
    inference_count: int = Field(description="Rows computed.")
    execution_count: int = Field(description="Forward passes.")
    inference_stats: InferenceStats
    response_stats: dict[str, Any]
    batch_stats: list[dict[str, Any]]
    memory_usage: list[MemoryUsage]
    digest: str = Field(description="The sha256 of the weights and their table this copy serves (HTTP only).")


class StatisticsResponse(BaseModel):
    model_stats: list[ModelStatistics]


class RepositoryIndexRequest(BaseModel):
    # Strict: `true` or `false` only, as every other boolean the service reads (0, "yes", "true" are 400).
    model_config = ConfigDict(strict=True)

    ready: bool = Field(default=False, description="Only the models ready for inference.")


class RepositoryModel(BaseModel):
    name: str
    version: str
    state: Literal["READY", "LOADING", "UNAVAILABLE"]
    reason: str
    digest: str = Field(
        description="The sha256 of the weights and their table served (unloaded: last served); HTTP only, "
        "gRPC's ModelIndex has no field for it."
    )
