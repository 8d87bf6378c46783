"""Server and model metadata in the Open Inference Protocol's shapes, for both doors."""

from __future__ import annotations

from app import __version__
from app.protocol.digest import MODEL_PARAMETER
from app.protocol.state import ServiceState
from app.protocol.v2 import codec
from app.protocol.v2.codec import PLATFORM, SERVER_NAME
from app.protocol.v2.extensions import extensions
from app.protocol.v2.schemas import ModelMetadata, ServerMetadata


def server_metadata(state: ServiceState) -> ServerMetadata:
    """GET /v2 and ServerMetadata: the server's name, version and the extensions it implements."""
    return ServerMetadata(name=SERVER_NAME, version=__version__, extensions=extensions(state.settings))


def model_metadata(state: ServiceState, name: str, version: str | None) -> ModelMetadata:
    """A model's metadata; ModelNotFound (404, NOT_FOUND) for an unknown name or version."""
    served = state.engine.model(name, version)
    tensor = {"datatype": served.dtype.v2, "shape": [-1, served.d_model]}
    return ModelMetadata.model_validate(
        {
            "name": name,
            "versions": [str(served.version)],
            "platform": PLATFORM,
            "inputs": [{"name": codec.INPUT_NAME, **tensor}],
            "outputs": [{"name": codec.OUTPUT_NAME, **tensor}],
            "parameters": {MODEL_PARAMETER: served.digest},
        }
    )
