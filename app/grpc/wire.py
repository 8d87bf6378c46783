"""A budget on what parsing an infer request costs, checked on its wire bytes before protobuf parses them.

Tensor data parses to its own size: `raw_input_contents` are byte strings, packed `fp32_contents`
four bytes a value. Everything else costs the parser far more memory than its wire size: an
empty sub-message is two bytes on the wire and an object of a hundred in memory, a one-byte
varint eight. So a request may hold at most `MAX_OTHER_BYTES` of anything but tensor data, and
at most `MAX_FIELDS` fields in all: what a request with a few names, a shape, a few parameters
and outputs needs many times over, and a hard bound on the parser's memory and on this scan's
own time (it reads field headers only, skipping every payload). The HTTP door counts a JSON
body's arrays and values before parsing it (app/protocol/tensors.py) for the same reason.

Every method's messages are read through `tolerant`: a tensor method's by `read_infer_request`,
any other method's within its HTTP twin's body limit (limits.control_message_bytes).

A request of at most `MAX_OTHER_BYTES` in all is not scanned: whatever it holds, its parse is small.

A larger one is also read without copying its tensor data: protobuf parses the message with its
`raw_input_contents` left out (what is left is at most `MAX_OTHER_BYTES`), and the tensors are
views of the wire bytes, which the request holds against the process's budget of held bytes
(`max_held_bytes`, app/protocol/admission.py) from before it is parsed until it is answered.
Without this a 31 MiB request was four copies of its tensor: the wire bytes, protobuf's, the
field's value and a writable copy.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb

from app.errors import ServiceError
from app.grpc.malformed import Malformed
from app.protocol.admission import HeldBytes, Hold
from app.protocol.errors import InvalidInput, PayloadTooLarge
from app.protocol.limits import MAX_FIELDS, MAX_OTHER_BYTES, control_message_bytes

# Field numbers of grpc_service.proto (tritonclient.grpc.service_pb2).
_LENGTH_DELIMITED = 2
_REQUEST_INPUTS, _REQUEST_RAW_INPUT_CONTENTS = 5, 7  # ModelInferRequest
_INPUT_CONTENTS = 5  # ModelInferRequest.InferInputTensor
_CONTENTS_FP32 = 6  # InferTensorContents


class _Budget:
    """Fields seen so far and bytes of everything but tensor data, refused as soon as either is over."""

    def __init__(self) -> None:
        self.fields = 0
        self.other = 0

    def field(self) -> None:
        self.fields += 1
        if self.fields > MAX_FIELDS:
            raise PayloadTooLarge(
                f"the request holds more than {MAX_FIELDS} protobuf fields; an infer request needs a few dozen "
                "(repeated values such as fp32_contents must be packed, as every protobuf library writes them)"
            )

    def add(self, size: int) -> None:
        self.other += size
        if self.other > MAX_OTHER_BYTES:
            raise PayloadTooLarge(
                f"the request holds more than {MAX_OTHER_BYTES} bytes besides its tensor data "
                "(names, shape, parameters, outputs); send the tensor in raw_input_contents or fp32_contents"
            )


@dataclass(eq=False)
class InferMessage:
    """A ModelInferRequest as read off the wire: its fields, its tensor bytes, and the bytes it holds.

    `request` carries every field but `raw_input_contents`, which are `raw`: views of the wire
    bytes for a large message, the parsed field's values for a small one. `release()` gives the
    held bytes back once the request is answered (and, should it never be, when it is dropped).
    """

    request: pb.ModelInferRequest
    raw: list[bytes | memoryview]
    hold: Hold | None = None
    _released: weakref.finalize | None = field(default=None, repr=False)

    def hold_answer(self, size: int) -> None:
        """From now on hold the answer's `size` bytes instead of the request's (TooManyBytesHeld past the budget)."""
        if self.hold is not None:
            self.hold.resize(size)

    def release(self) -> None:
        """Give every byte back (the answer is written, or will never be); once."""
        if self._released is not None:
            self._released()


def read_infer_request(data: bytes, held: HeldBytes | None = None) -> InferMessage:
    """Parse a ModelInferRequest within the budgets: its non-tensor bytes (this module's), its bytes held (`held`).

    The wire bytes are taken from `held` before anything is parsed: past the budget, TooManyBytesHeld
    (RESOURCE_EXHAUSTED with a retry hint) and the bytes are dropped at once.
    """
    hold = None
    if held is not None:
        hold = Hold(held)
        hold.grow(len(data))
    try:
        message = _parse_infer_request(data)
    except BaseException:
        if hold is not None:
            hold.resize(0)
        raise
    if hold is not None:
        message.hold = hold
        message._released = weakref.finalize(message, hold.resize, 0)
    return message


def _parse_infer_request(data: bytes) -> InferMessage:
    if len(data) <= MAX_OTHER_BYTES:  # small: parsed whole, whatever it holds
        request = pb.ModelInferRequest.FromString(data)
        raw: list[bytes | memoryview] = list(request.raw_input_contents)
        del request.raw_input_contents[:]
        return InferMessage(request, raw)
    view = memoryview(data)
    budget = _Budget()
    rest: list[memoryview] = []  # every field but the tensors' bytes, as they came (at most MAX_OTHER_BYTES)
    raw = []
    for number, wire_type, start, end, field_start in _fields_with_headers(view, budget):
        if wire_type == _LENGTH_DELIMITED and number == _REQUEST_RAW_INPUT_CONTENTS:
            raw.append(view[start:end])
            continue
        if wire_type == _LENGTH_DELIMITED and number == _REQUEST_INPUTS:
            _check_input(view[start:end], budget)
        else:
            budget.add(end - start)
        rest.append(view[field_start:end])
    return InferMessage(pb.ModelInferRequest.FromString(b"".join(rest)), raw)


def check_message_size(data: bytes, limit: int, method: str) -> None:
    """A message of a method that carries no tensor is small: refused before it is parsed when over `limit`."""
    if len(data) > limit:
        raise PayloadTooLarge(f"a {method} message is at most {limit} bytes, got {len(data)}")


def _check_input(view: memoryview, budget: _Budget) -> None:
    for number, wire_type, start, end in _fields(view, budget):
        if wire_type == _LENGTH_DELIMITED and number == _INPUT_CONTENTS:
            for inner, inner_type, inner_start, inner_end in _fields(view[start:end], budget):
                if not (inner_type == _LENGTH_DELIMITED and inner == _CONTENTS_FP32):
                    budget.add(inner_end - inner_start)
        else:
            budget.add(end - start)


def _fields(view: memoryview, budget: _Budget) -> Iterator[tuple[int, int, int, int]]:
    """(field number, wire type, payload start, payload end) of each field of one message, headers only."""
    for number, wire_type, start, end, _ in _fields_with_headers(view, budget):
        yield number, wire_type, start, end


def _fields_with_headers(view: memoryview, budget: _Budget) -> Iterator[tuple[int, int, int, int, int]]:
    """As _fields, with where each field's header starts (so that a field can be copied whole)."""
    position, end = 0, len(view)
    while position < end:
        budget.field()
        field_start = position
        key, position = _varint(view, position, end)
        number, wire_type = key >> 3, key & 7
        start = position
        if wire_type == 0:
            _, position = _varint(view, position, end)
        elif wire_type == 1:
            position += 8
        elif wire_type == _LENGTH_DELIMITED:
            length, start = _varint(view, position, end)
            position = start + length
        elif wire_type == 5:
            position += 4
        else:  # 3 and 4 are proto2 groups, which no field of this protocol is; 6 and 7 do not exist
            raise InvalidInput(f"malformed protobuf: field {number} has wire type {wire_type}")
        if position > end:
            raise InvalidInput(f"malformed protobuf: field {number} runs past the end of its message")
        yield number, wire_type, start, position, field_start


def _varint(view: memoryview, position: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while position < end and shift < 70:
        byte = view[position]
        position += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, position
        shift += 7
    raise InvalidInput("malformed protobuf: a varint runs past the end of its message or past 10 bytes")


# The methods whose requests carry tensors: their wire bytes are checked against this module's budget first.
_TENSOR_METHODS = {"ModelInfer", "ModelStreamInfer"}


def tolerant(method: str, parse: Callable[[bytes], Any], held: HeldBytes) -> Callable[[bytes], Any]:
    """`parse` made to read within the wire budgets, its failures returned as a Malformed the method answers.

    A tensor method's message is read by `read_infer_request` (its bytes held against `held`), any
    other method's checked against its limit first (limits.control_message_bytes); a message that
    does not parse or is over a budget becomes a Malformed: grpc's own handling would answer UNKNOWN.
    """
    limit = control_message_bytes(method)

    def read(data: bytes) -> Any:
        if method in _TENSOR_METHODS:
            return read_infer_request(data, held)
        check_message_size(data, limit, method)
        return parse(data)

    def deserialize(data: bytes) -> Any:
        try:
            return read(data)
        except ServiceError as exc:
            return Malformed(exc)
        except DecodeError as exc:
            return Malformed(InvalidInput(f"malformed protobuf: {exc}"))

    return deserialize
