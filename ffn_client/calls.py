"""The API's calls besides the tensors, as data: method, path, body, and how to read the answer.

`Client` and `AsyncClient` send a `Call` each its own way (blocking, or awaited) and share the
rest, so that no path or answer check is written twice. The answers are the server's JSON,
typed with TypedDicts: plain dicts at run time, checked by a type checker, with the names and
types of docs/api.md (the V2 ones are Triton's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypedDict, TypeVar
from urllib.parse import quote

import httpx

from ffn_client.encodings import dumps, loads
from ffn_client.errors import ProtocolError, error_from_response

T = TypeVar("T")


class ModelInfo(TypedDict):
    """One model of GET /v1/models."""

    name: str
    d_model: int
    d_ff: int
    activation: str
    gated: bool
    variant: str
    bias: dict[str, bool | None]
    dropout: float
    dtype: str
    device: str
    format: str
    ready: bool


class ServerMetadata(TypedDict):
    """GET /v2: the server's name, version and the V2 extensions it implements."""

    name: str
    version: str
    extensions: list[str]


class TensorMetadata(TypedDict):
    name: str
    datatype: str
    shape: list[int]


class ModelMetadata(TypedDict):
    """GET /v2/models/{name}: the model's input and output tensors."""

    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class ModelConfig(TypedDict):
    """GET /v2/models/{name}/config: Triton's ModelConfig (model_config.proto) as JSON."""

    name: str
    platform: str
    backend: str
    max_batch_size: int
    input: list[dict[str, Any]]
    output: list[dict[str, Any]]
    dynamic_batching: dict[str, Any]
    instance_group: list[dict[str, Any]]
    version_policy: dict[str, Any]
    parameters: dict[str, dict[str, str]]


class StatDuration(TypedDict):
    count: int
    ns: int


class ModelStatistics(TypedDict):
    """One entry of Triton's `model_stats` (GET /v2/models/{name}/stats)."""

    name: str
    version: str
    last_inference: int  # ms since the epoch; 0: none yet
    inference_count: int  # rows computed
    execution_count: int  # forward passes
    inference_stats: dict[str, StatDuration]  # success, fail, queue, compute_infer, ...
    response_stats: dict[str, Any]
    batch_stats: list[dict[str, Any]]
    memory_usage: list[dict[str, Any]]


class RepositoryModel(TypedDict):
    """One entry of the V2 repository index."""

    name: str
    version: str
    state: str  # READY, ...
    reason: str


@dataclass(frozen=True)
class Call(Generic[T]):
    """One request and how to read its answer (`read` raises the typed error of a refusal)."""

    method: str
    path: str
    read: Callable[[httpx.Response], T]
    body: bytes | None = None
    headers: dict[str, str] | None = None


def models() -> Call[list[ModelInfo]]:
    return Call("GET", "/v1/models", lambda r: _member(r, "models", list))


def server_metadata() -> Call[ServerMetadata]:
    return Call("GET", "/v2", lambda r: _json(r, dict))


def model_metadata(model: str) -> Call[ModelMetadata]:
    return Call("GET", _model_path(model), lambda r: _json(r, dict))


def model_ready(model: str) -> Call[bool]:
    return Call("GET", _model_path(model, "/ready"), _ready)


def model_config(model: str) -> Call[ModelConfig]:
    return Call("GET", _model_path(model, "/config"), lambda r: _json(r, dict))


def statistics(model: str | None = None) -> Call[list[ModelStatistics]]:
    path = "/v2/models/stats" if model is None else _model_path(model, "/stats")
    return Call("GET", path, lambda r: _member(r, "model_stats", list))


def repository_index(ready_only: bool = False) -> Call[list[RepositoryModel]]:
    body = dumps({"ready": True}) if ready_only else b"{}"
    return Call("POST", "/v2/repository/index", lambda r: _json(r, list), body, {"Content-Type": "application/json"})


def _model_path(model: str, tail: str = "") -> str:
    return f"/v2/models/{quote(model, safe='')}{tail}"


def _check(response: httpx.Response) -> httpx.Response:
    if response.status_code != 200:
        raise error_from_response(response.status_code, response.headers, response.content)
    return response


def _json(response: httpx.Response, kind: type) -> Any:
    """The 200 answer's JSON, which must be a `kind` (dict or list); a refusal raises its typed error."""
    answer = loads(_check(response).content)
    if not isinstance(answer, kind):
        raise ProtocolError(f"{response.request.url.path}: expected a JSON {kind.__name__}, got {answer!r:.200}")
    return answer


def _member(response: httpx.Response, name: str, kind: type) -> Any:
    """The member `name` of the 200 answer's JSON object, which must be a `kind`."""
    answer = _json(response, dict)
    if not isinstance(answer.get(name), kind):
        raise ProtocolError(f"{response.request.url.path}: expected {{{name!r}: {kind.__name__}}}, got {answer!r:.200}")
    return answer[name]


def _ready(response: httpx.Response) -> bool:
    """200: ready; 503: loaded but not ready (warming up, draining, or its batcher died); else the error."""
    if response.status_code == 503:
        return False
    _check(response)
    return True
