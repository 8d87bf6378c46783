"""Triton's V2 extensions: model configuration, statistics and the repository index, in Triton's JSON shapes.

The trace extension is app/web/v2/trace_extension.py's, logging log_settings.py's, system shared
memory system_shared_memory.py's (with CUDA shared memory's refusal); their routes are listed here
with the rest. The extensions this server does not implement (repository
load/unload, generate) have their routes too, so that a client calling one learns which
extension it asked for and why it is missing: a 400 `unsupported_extension`, not a bare 404.
`EXTENSIONS` (GET /v2) lists exactly the ones implemented here and in the infer route.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import Response

from app.engine.service import ServedModel
from app.settings import Settings
from app.web.endpoints import Endpoint, Handler
from app.web.errors import UnsupportedExtension
from app.web.openapi import error_responses
from app.web.state import ServiceState, StateDep
from app.web.v2 import codec, log_settings, statistics, system_shared_memory, trace_extension
from app.web.v2.codec import PLATFORM
from app.web.v2.schemas import (
    ModelConfiguration,
    RepositoryIndexRequest,
    RepositoryModel,
    StatisticsResponse,
)

# binary_tensor_data and parameters (mc_passes, ...) are the infer route's; the rest are here.
# model_repository is not listed: of its three APIs only the index is served.
EXTENSIONS = ["binary_tensor_data", "model_configuration", "statistics", "parameters", "trace", "logging"]


def extensions(settings: Settings) -> list[str]:
    """GET /v2's list: exactly the extensions this server answers, system shared memory when it is on."""
    return [*EXTENSIONS, system_shared_memory.EXTENSION] if settings.shared_memory else list(EXTENSIONS)


# ----- model configuration ---------------------------------------------------------------------


def model_configuration(served: ServedModel, settings: Settings) -> dict[str, Any]:
    """The model as Triton's ModelConfig JSON: batching from the settings, tensors from the model."""
    config, device = served.config, served.device
    tensor = {"data_type": f"TYPE_{served.dtype.v2}", "dims": [served.d_model]}
    on_gpu = device.type == "cuda"
    details = {
        "d_ff": config.d_ff,
        "activation": config.activation,
        "gated": config.gated,
        "variant": config.variant,
        "dropout": served.dropout,
        "max_mc_passes": settings.max_mc_passes,
        "max_queue_rows": settings.max_queue_rows,
    }
    return {
        "name": served.name,
        "platform": PLATFORM,
        "backend": "pytorch",
        "version_policy": {"latest": {"num_versions": 1}},
        # Rows are the batch dimension. A request may hold more (up to max_queue_rows): it is cut
        # into chunks of this size and reassembled.
        "max_batch_size": settings.max_batch_rows,
        "input": [
            {
                "name": codec.INPUT_NAME,
                **tensor,
                "format": "FORMAT_NONE",
                "is_shape_tensor": False,
                "allow_ragged_batch": False,
                "optional": False,
            }
        ],
        "output": [{"name": codec.OUTPUT_NAME, **tensor, "label_filename": "", "is_shape_tensor": False}],
        "dynamic_batching": {
            "preferred_batch_size": [],
            "max_queue_delay_microseconds": round(settings.max_wait_ms * 1000),
            "preserve_ordering": False,
            "default_queue_policy": {
                "timeout_action": "REJECT",
                "default_timeout_microseconds": round(settings.default_timeout_ms * 1000),
                "allow_timeout_override": True,
            },
        },
        "instance_group": [
            {
                "name": served.name,
                "kind": "KIND_GPU" if on_gpu else "KIND_CPU",
                "count": 1,
                "gpus": [device.index or 0] if on_gpu else [],
            }
        ],
        "parameters": {
            key: {"string_value": str(value).lower() if isinstance(value, bool) else str(value)}
            for key, value in details.items()
        },
    }


async def config(name: str, state: StateDep) -> dict[str, Any]:
    return model_configuration(state.engine.model(name), state.settings)


async def version_config(name: str, version: str, state: StateDep) -> dict[str, Any]:
    return model_configuration(state.engine.model(name, version), state.settings)


# ----- statistics ------------------------------------------------------------------------------


def _statistics(state: ServiceState, models: list[ServedModel]) -> dict[str, Any]:
    return statistics.model_stats(state.metrics.merged, models)  # every worker's samples


async def all_stats(state: StateDep) -> dict[str, Any]:
    return _statistics(state, state.engine.models())


async def stats(name: str, state: StateDep) -> dict[str, Any]:
    return _statistics(state, [state.engine.model(name)])


async def version_stats(name: str, version: str, state: StateDep) -> dict[str, Any]:
    return _statistics(state, [state.engine.model(name, version)])


# ----- model repository ------------------------------------------------------------------------


def _repository_entry(served: ServedModel) -> RepositoryModel:
    status = served.status
    return RepositoryModel(
        name=served.name, version=str(served.version), state=status.state.value, reason=status.reason
    )


def repository_models(models: list[ServedModel], ready_only: bool) -> list[RepositoryModel]:
    """The repository index (both doors): every model and its state, or only the READY ones."""
    entries = [_repository_entry(served) for served in models]
    return [entry for entry in entries if entry.state == "READY"] if ready_only else entries


async def repository_index(state: StateDep, body: RepositoryIndexRequest | None = None) -> list[RepositoryModel]:
    return repository_models(state.engine.models(), body is not None and body.ready)


# ----- the extensions not implemented ----------------------------------------------------------


def _unsupported(extension: str, detail: str) -> Handler:
    async def refuse() -> Response:
        raise UnsupportedExtension(extension, detail)

    return refuse


_UNSUPPORTED: dict[tuple[str, str], list[str]] = {
    (
        "model_repository",
        "the models are fixed at start by the config file, so load and unload are refused; "
        "POST /v2/repository/index lists them",
    ): [
        "POST /v2/repository/models/{name}/load",
        "POST /v2/repository/models/{name}/unload",
    ],
    ("generate", "the FFN maps embeddings to embeddings, not text to text; use /infer"): [
        "POST /v2/models/{name}/generate",
        "POST /v2/models/{name}/generate_stream",
        "POST /v2/models/{name}/versions/{version}/generate",
        "POST /v2/models/{name}/versions/{version}/generate_stream",
    ],
}

_DETAILS = {extension: detail for extension, detail in _UNSUPPORTED}


def unsupported(extension: str) -> UnsupportedExtension:
    """The refusal of an extension this server does not implement, as its HTTP routes give it (both doors)."""
    return UnsupportedExtension(extension, _DETAILS[extension])


_TAGS = {"tags": ["v2 extensions"]}
_CONFIG = {
    "summary": "Model configuration (Triton's ModelConfig JSON)",
    "response_model": ModelConfiguration,
    "responses": error_responses(401, 404),
    **_TAGS,
}
_STATS = {
    "summary": "Inference statistics (Triton's statistics extension)",
    "response_model": StatisticsResponse,
    "responses": error_responses(401, 404),
    **_TAGS,
}

ENDPOINTS = [
    *log_settings.ENDPOINTS,
    *system_shared_memory.ENDPOINTS,
    Endpoint("GET", "/v2/models/stats", all_stats, openapi={**_STATS, "summary": "Statistics of every model"}),
    Endpoint("GET", "/v2/models/{name}/stats", stats, openapi=_STATS),
    Endpoint("GET", "/v2/models/{name}/versions/{version}/stats", version_stats, openapi=_STATS),
    Endpoint("GET", "/v2/models/{name}/config", config, openapi=_CONFIG),
    Endpoint("GET", "/v2/models/{name}/versions/{version}/config", version_config, openapi=_CONFIG),
    Endpoint(
        "POST",
        "/v2/repository/index",
        repository_index,
        openapi={
            "summary": "The models and their state (model repository index)",
            "response_model": list[RepositoryModel],
            "responses": error_responses(400, 401),
            **_TAGS,
        },
    ),
    *trace_extension.ENDPOINTS,
    *(
        Endpoint(
            route.split(" ")[0],
            route.split(" ")[1],
            _unsupported(extension, detail),
            openapi={"include_in_schema": False},
        )
        for (extension, detail), routes in _UNSUPPORTED.items()
        for route in routes
    ),
]
