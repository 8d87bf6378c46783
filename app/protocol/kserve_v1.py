"""KServe's V1 protocol (TensorFlow Serving's REST shape): instances in, predictions out, and model readiness.

`POST /v1/models/{name}:predict` takes `{"instances": [...]}` (row format: one instance per
element) or `{"inputs": [...]}` (KServe reads either, the same way), and answers
`{"predictions": [...]}`, one prediction per instance, as KServe's own model servers do. Here an
instance is one embedding, a list of d_model numbers, or one sequence of them, [seq, d_model];
its prediction has the same shape. `GET /v1/models/{name}` answers `{"name", "ready": true}`,
and 503 when the model is not ready (KServe's ModelNotReady), 404 when there is no such model.

V1 is JSON only, so it costs what V2's JSON costs: the body is counted before it is parsed
(tensors.read_json_body, against max_queue_rows rows, and the 64 KiB besides the tensor), every value checked a finite float32
number, and an answer holding inf or NaN refused (422). Errors are the one table's
`{"error", "error_type"}` bodies: V1's own error body is `{"error": ...}`, which KServe's SDK reads.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import orjson

from app.engine.errors import Unavailable
from app.engine.facade import EngineFacade
from app.protocol.errors import InvalidInput, UnsupportedMediaType
from app.protocol.fields import media_type
from app.protocol.native import FLOAT32, DecodedInput
from app.protocol.tensors import check_finite_output, check_shape, json_numbers_to_array, read_json_body

Field = Literal["instances", "inputs"]
FIELDS: tuple[Field, ...] = ("instances", "inputs")
MEDIA_TYPE = "application/json"


def check_content(content_type: str | None) -> None:
    """V1 bodies are JSON: another media type is refused before the body is read."""
    media = media_type(content_type)
    if media is not None and media != MEDIA_TYPE:
        raise UnsupportedMediaType(
            f"Content-Type {media[:64]!r} is not supported; KServe V1 bodies are {MEDIA_TYPE} "
            "(binary tensors: the V2 binary extension or the native route)"
        )


def decode(body: bytes | bytearray, d_model: int, max_rows: int) -> DecodedInput:
    """`{"instances": [...]}` or `{"inputs": [...]}` -> (rows, d_model) float32, refused (400, 413) if anything is wrong."""
    # The tensor is the array of "instances", or of "inputs" (a body holding both is refused below).
    key = "instances" if b'"instances"' in body else "inputs"
    parsed = read_json_body(body, key, max_rows, d_model)
    document = parsed.envelope
    if not isinstance(document, dict):
        raise InvalidInput('a KServe V1 body is a JSON object {"instances": [...]}')
    given = [key for key in FIELDS if key in document]
    unknown = sorted(set(document) - set(FIELDS))
    if unknown:
        raise InvalidInput(f'unknown field {unknown[0][:64]!r}; a KServe V1 body is {{"instances": [...]}}')
    if len(given) != 1:
        raise InvalidInput('a KServe V1 body holds one of "instances" or "inputs": a list of instances')
    (field,) = given
    sightings = parsed.sightings if field == key else body.count(f'"{field}"'.encode())
    if sightings > 1:
        raise InvalidInput(f'duplicate key "{field}" in the JSON body')
    array = json_numbers_to_array(parsed.tensor(document[field]), field, parsed.tensor_text, FLOAT32)
    if array.ndim == 1:  # [] or a flat list of numbers: not a list of instances
        raise InvalidInput(
            f'"{field}" must be a list of instances, each a list of d_model={d_model} numbers '
            f"(or [seq, {d_model}]), got shape {list(array.shape)}"
        )
    rows = check_shape(array.shape, d_model)
    return DecodedInput(array.reshape(rows, d_model), array.shape, FLOAT32)


def encode(output: np.ndarray, decoded: DecodedInput) -> bytes:
    """`{"predictions": [...]}`: one prediction per instance, each of its instance's shape (422 if not finite).

    `output` is the engine's float32 answer (the dtype of `decoded`).
    """
    check_finite_output(output)
    return orjson.dumps({"predictions": output.reshape(decoded.shape)}, option=orjson.OPT_SERIALIZE_NUMPY)


def model_ready(engine: EngineFacade, name: str) -> bytes:
    """`{"name", "ready": true}` for a ready model; 503 (Unavailable) when it is not, 404 when unknown."""
    status = engine.model(name).status
    if not status.ready:
        raise Unavailable(f"model {name!r} is not ready: {status.reason}")
    return orjson.dumps({"name": name, "ready": True})
