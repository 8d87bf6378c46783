"""The V2 extensions' HTTP routes: model configuration, statistics, the repository index, and every extension's routes.

What each answers is the protocol core's (app/protocol/v2/); the routes of logging, system
shared memory, trace and model control are their own modules', listed here with the rest. The
extensions this server does not implement (V2's generate, KServe V1's explain) have their routes too, so that a client calling
one learns which extension it asked for and why it is missing: a 400 `unsupported_extension`, not
a bare 404.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from starlette.responses import Response

from app.engine.facade import ModelFacade
from app.http.endpoints import Endpoint, Handler, StateDep
from app.http.openapi import error_responses
from app.http.v2 import log_settings, system_shared_memory, trace_extension
from app.protocol.state import ServiceState
from app.protocol.v2 import statistics
from app.protocol.v2.extensions import model_configuration, repository_models, unsupported
from app.protocol.v2.schemas import ModelConfiguration, RepositoryIndexRequest, RepositoryModel, StatisticsResponse


async def config(name: str, state: StateDep) -> dict[str, Any]:
    return model_configuration(state.engine.model(name), state.settings)


async def version_config(name: str, version: str, state: StateDep) -> dict[str, Any]:
    return model_configuration(state.engine.model(name, version), state.settings)


def _statistics(state: ServiceState, models: Sequence[ModelFacade]) -> dict[str, Any]:
    return statistics.model_stats(state.metrics.merged, models)  # every worker's samples


async def all_stats(state: StateDep) -> dict[str, Any]:
    return _statistics(state, state.engine.models())


async def stats(name: str, state: StateDep) -> dict[str, Any]:
    return _statistics(state, [state.engine.model(name)])


async def version_stats(name: str, version: str, state: StateDep) -> dict[str, Any]:
    return _statistics(state, [state.engine.model(name, version)])


async def repository_index(state: StateDep, body: RepositoryIndexRequest | None = None) -> list[RepositoryModel]:
    return repository_models(state.engine.listed(), body is not None and body.ready)


def _unsupported(extension: str) -> Handler:
    async def refuse() -> Response:
        raise unsupported(extension)

    return refuse


_UNSUPPORTED_ROUTES = {
    "generate": [
        "POST /v2/models/{name}/generate",
        "POST /v2/models/{name}/generate_stream",
        "POST /v2/models/{name}/versions/{version}/generate",
        "POST /v2/models/{name}/versions/{version}/generate_stream",
    ],
    # KServe V1's explainer route, beside its :predict (else it met the readiness route's bare 405).
    "explain": ["POST /v1/models/{name}:explain"],
}

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
            route.split(" ")[0], route.split(" ")[1], _unsupported(extension), openapi={"include_in_schema": False}
        )
        for extension, routes in _UNSUPPORTED_ROUTES.items()
        for route in routes
    ),
]
