"""Request plans: what a tensor request's head means, decided once per distinct head and reused.

A native transform request's head (its model, Content-Type, X-Shape, X-Dtype and Accept) fixes
everything about it but its body: how the body decodes, how many bytes a raw body must hold, the
dtype the engine answers in, and the answer's headers. Clients send the same head again and
again, so a door parses and checks it once, keeps the plan, and per request only decodes its
body against it. A plan belongs to one served copy of its model (held weakly: a plan never keeps
a retired copy's weights alive): a load or unload puts another copy (or none) in service, and a
door makes the plan again when its copy is no longer the one the engine names.

Building a plan raises the very error the request would get (415, 406, 400 for a bad X-Shape),
so a door can leave a head it cannot plan to its full path, which answers it as always.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from app.engine.facade import ModelFacade
from app.protocol import native as codec
from app.protocol.tensors import check_finite_output, raw_bytes
from ffn_core.dtypes import DType

MAX_PLANS = 256  # distinct heads kept per door: a client varying its headers costs a rebuild, never memory
P = TypeVar("P")


@dataclass(frozen=True)
class NativePlan:
    """A native transform request's head, decided: how its body decodes and how its answer is encoded."""

    name: str
    d_model: int
    copy: weakref.ref[ModelFacade]  # the served copy the head was checked against (weak: a retired copy goes)
    encoding_in: codec.Encoding
    encoding_out: codec.Encoding
    raw: codec.RawLayout | None  # a raw body's layout, from X-Shape and X-Dtype
    # The answer's headers that no body changes (raw: all but the digest, which names the copy that computed it).
    answer_headers: tuple[tuple[str, str], ...]

    def decode(self, body: bytes | bytearray | memoryview, max_rows: int) -> codec.DecodedInput:
        """The body's rows, refused exactly as the full path refuses them (400, 406), checked answerable."""
        if self.raw is not None:
            return self.raw.rows_of(body)  # answerable: checked when the plan was made
        d_model = self.d_model
        data = bytes(body) if isinstance(body, memoryview) else body  # a raw body is viewed; the others read bytes
        if self.encoding_in == "npy":
            decoded = codec.decode_npy(data, d_model)
        else:
            decoded = codec.decode_json(data, d_model, max_rows)
        codec.check_answerable(self.encoding_out, decoded.dtype)
        return decoded

    def is_for(self, model: ModelFacade) -> bool:
        """Whether this plan was made for `model`, the copy serving its name now."""
        return self.copy() is model

    def answer_dtype(self, decoded: codec.DecodedInput) -> DType:
        return codec.answer_dtype(decoded, self.encoding_out)

    def encode(
        self, output: np.ndarray, decoded: codec.DecodedInput
    ) -> tuple[bytes | memoryview, tuple[tuple[str, str], ...]]:
        """The answer's body, and its headers beyond `answer_headers`; 422 if it is not finite."""
        if self.raw is not None and self.encoding_out == "raw":
            check_finite_output(output)
            return raw_bytes(output), ()
        body, headers = codec.encode(self.name, output, decoded, self.encoding_out)
        return body, tuple((name, value) for name, value in headers.items() if name != "content-type")


def native_plan(
    model: ModelFacade, content_type: str | None, shape: str | None, dtype: str | None, accept: str | None
) -> NativePlan:
    """The plan of a transform request with these headers to `model`; the request's own error if its head is wrong."""
    encoding_in = codec.request_encoding(content_type)
    encoding_out = codec.response_encoding(accept)
    raw = None
    headers: dict[str, str] = {"content-type": codec.MEDIA_TYPE_OF[encoding_out]}
    if encoding_in == "raw":
        raw = codec.raw_layout(shape, dtype, model.d_model)
        codec.check_answerable(encoding_out, raw.dtype)
        if encoding_out == "raw":
            headers["x-shape"] = ",".join(map(str, raw.shape))
            headers["x-dtype"] = raw.dtype.name
    return NativePlan(
        model.name, model.d_model, weakref.ref(model), encoding_in, encoding_out, raw, tuple(headers.items())
    )


class PlanCache(Generic[P]):
    """Plans by their head, at most MAX_PLANS: full, it starts again empty (a rebuild costs one request a few µs)."""

    def __init__(self) -> None:
        self._plans: dict[Hashable, P] = {}

    def get(self, key: Hashable) -> P | None:
        return self._plans.get(key)

    def put(self, key: Hashable, plan: P) -> None:
        if len(self._plans) >= MAX_PLANS:
            self._plans.clear()
        self._plans[key] = plan
