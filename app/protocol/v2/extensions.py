"""Triton's V2 extensions: model configuration and the repository index in Triton's JSON shapes, and the list.

As functions on plain values, for both doors (app/http/v2/extensions.py, app/grpc/service.py).
The trace extension is trace_extension.py's, logging log_settings.py's, system shared memory
system_shared_memory.py's (with CUDA shared memory's refusal), statistics statistics.py's, the
model repository's load and unload model_control.py's. `extensions` (GET /v2, ServerMetadata)
lists exactly the ones implemented.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from app.config.settings import Settings
from app.engine.facade import ListedModel, ModelFacade
from app.protocol.digest import MODEL_PARAMETER
from app.protocol.errors import UnsupportedExtension
from app.protocol.v2 import codec, system_shared_memory
from app.protocol.v2.codec import PLATFORM
from app.protocol.v2.schemas import RepositoryModel

# binary_tensor_data and parameters (mc_passes, ...) are the infer route's; the rest are here.
EXTENSIONS = ["binary_tensor_data", "model_configuration", "statistics", "parameters", "trace", "logging"]


def extensions(settings: Settings) -> list[str]:
    """GET /v2's list: exactly the extensions this server answers: system shared memory when it is
    on, model_repository (index, load, unload) with model_control = explicit."""
    listed = list(EXTENSIONS)
    if settings.shared_memory:
        listed.append(system_shared_memory.EXTENSION)
    if settings.model_control == "explicit":
        listed.append("model_repository")
    return listed


# ----- model configuration ---------------------------------------------------------------------


def model_configuration(served: ModelFacade, settings: Settings) -> dict[str, Any]:
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
        MODEL_PARAMETER: served.digest,  # the weights' identity, in the one map both doors carry
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


# ----- model repository ------------------------------------------------------------------------


def _repository_entry(served: ListedModel) -> RepositoryModel:
    status = served.status
    return RepositoryModel(
        name=served.name,
        version=str(served.version),
        state=status.state.value,
        reason=status.reason,
        digest=served.digest,
    )


def repository_models(models: Sequence[ListedModel], ready_only: bool) -> list[RepositoryModel]:
    """The repository index (both doors): every model and its state (unloaded ones too, as Triton
    lists them: UNAVAILABLE, "unloaded", with the version they last served), or only the READY ones."""
    entries = [_repository_entry(served) for served in models]
    return [entry for entry in entries if entry.state == "READY"] if ready_only else entries


# ----- the extensions not implemented ----------------------------------------------------------

# The extension this server does not implement, and why: its routes (app/http/v2/extensions.py) and
# gRPC methods answer this, so that a client learns which extension it asked for and why it is missing.
UNSUPPORTED = {
    "generate": "the FFN maps embeddings to embeddings, not text to text; use /infer",
    "explain": "an FFN has no explainer (KServe V1's :explain); use :predict",  # KServe V1's, beside V2's
}


def unsupported(extension: str) -> UnsupportedExtension:
    """The refusal of an extension this server does not implement (both doors)."""
    return UnsupportedExtension(extension, UNSUPPORTED[extension])
