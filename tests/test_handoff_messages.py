"""The hand-off's typed messages: every kind round-trips through the wire encoding, read by field name.

No server: frames.py's encoding and its two decoders, each message built with every field set (and
its optional ones both set and unset), compared field by field after the trip.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from app.engine.description import ModelDescription, listing
from app.engine.errors import Overloaded
from app.engine.status import READY, UNLOADED
from app.handoff.frames import ENGINE_TO_FRONT, FRONT_TO_ENGINE, LENGTH, BadFrame, encode, read_frame
from app.handoff.messages import (
    Cancel,
    Control,
    Done,
    Failed,
    Gpus,
    Hello,
    Message,
    ModelCopy,
    ModelEntry,
    MonteCarlo,
    Reply,
    Ride,
    Submit,
    Table,
    TraceContext,
    error_of,
    failed,
    rides_as_recorded,
    rides_of,
)
from app.observe.collectors import GpuReading

TRACE = TraceContext.of((1 << 127) + 12345, (1 << 63) + 7, 1)  # ids past 64 bits, as OpenTelemetry's are
DESCRIPTION = ModelDescription(
    name="demo",
    version=3,
    digest="sha256:abc",
    d_model=512,
    d_ff=2048,
    activation="relu",
    gated=False,
    variant="ffn",
    bias_layer1=True,
    bias_layer2=False,
    bias_gate=None,
    dropout=0.1,
    dtype="float16",
    device="cuda:1",
    format="native",
    weight_bytes=4_194_304,
)

FRONT_MESSAGES: list[Message] = [
    Hello(64, 1 << 20, 256 << 20),
    Submit(
        ask=7,
        place=3 * (16 + (1 << 20)),
        room=1 << 20,
        generation=9,
        model="demo",
        version="2",
        shape=(4, 512),
        rows_dtype="bfloat16",
        answer_dtype="float32",
        deadline=1234.5,
        monte_carlo=MonteCarlo(8, 0.25, 42),
        request_id="req-1",
        trace=TRACE,
    ),
    Submit(7, 1 << 30, (4 << 20) - 16, 1, "demo", None, (2, 3, 512), "float32", "float16", None, None, None, None),
    Cancel(7),
    Control(11, "load", {"name": "demo", "config": None}),
]
ENGINE_MESSAGES: list[Message] = [
    Done(7, 9, (4, 512), None, ModelCopy("demo", 3, "sha256:abc")),
    Done(
        8,
        10,
        (1, 512),
        [Ride(1, 2, 3, batch=TRACE), Ride(4, 5, 6, passes_done=16)],
        ModelCopy("demo", 3, "sha256:abc"),
    ),
    Failed(7, 9, "Overloaded", "the queue is full", {"retry_after_s": 1, "name": None}),
    Table(
        "ready", "", True, [ModelEntry(DESCRIPTION, "ready", "")], [ModelEntry(DESCRIPTION, "unavailable", "unloaded")]
    ),
    Reply(11, {"name": "demo", "version": 4}),
    Gpus([GpuReading("GPU-1", None, 10, 20, 31.5, "cuda:0"), GpuReading("GPU-2", 0.5, 1, 2, None, "cuda:1")]),
]


def same_by_field(sent: msgspec.Struct, received: msgspec.Struct) -> None:
    assert type(received) is type(sent)
    for name in sent.__struct_fields__:
        assert getattr(received, name) == getattr(sent, name), name


@pytest.mark.parametrize(
    ("messages", "decoder"), [(FRONT_MESSAGES, FRONT_TO_ENGINE), (ENGINE_MESSAGES, ENGINE_TO_FRONT)]
)
def test_every_message_round_trips_through_the_wire_by_field_name(
    messages: list[msgspec.Struct], decoder: msgspec.msgpack.Decoder
) -> None:
    received = decoder.decode(encode(messages))
    assert len(received) == len(messages)
    for sent, got in zip(messages, received, strict=True):
        same_by_field(sent, got)
    kinds = {type(m).__name__ for m in messages}
    assert kinds in ({"Hello", "Submit", "Cancel", "Control"}, {"Done", "Failed", "Table", "Reply", "Gpus"})


def test_a_submit_is_a_compact_array_on_the_wire() -> None:
    submit = Submit(
        12345, 7 << 20, 1 << 20, 42, "demo", None, (3, 512), "float32", "float32", None, None, "req-abc", None
    )
    body = encode([submit])
    assert len(body) < 64  # the tag and the values, no field names (a pickled tuple took 82 bytes)
    assert b"ask" not in body and b"submit" in body


async def test_a_frame_of_the_other_side_s_messages_or_of_no_messages_ends_the_connection() -> None:
    for body in (encode([Reply(1, {})]), b"\x93\x01\x02\x03", encode([["submit", 1]])):
        reader = asyncio.StreamReader()
        reader.feed_data(LENGTH.pack(len(body)) + body)
        with pytest.raises(BadFrame):
            await read_frame(reader, FRONT_TO_ENGINE)


def test_an_engine_error_crosses_as_the_engine_raised_it() -> None:
    message = failed(5, 2, Overloaded("the queue is full", retry_after_s=3))
    error = error_of(ENGINE_TO_FRONT.decode(encode([message]))[0])  # type: ignore[arg-type]
    assert isinstance(error, Overloaded) and error.message == "the queue is full" and error.retry_after_s == 3
    bug = failed(5, 2, KeyError("x"))
    assert bug.error == "ModelError" and bug.message == "the engine failed: KeyError"


def test_rides_cross_as_the_engine_recorded_them() -> None:
    recorded = [("batch", (1 << 127) + 5, 99, 1, 2, 3), ("slice", 4, 5, 6, 16)]
    assert rides_as_recorded(rides_of(recorded)) == recorded


def test_the_public_listing_is_made_from_the_engine_s_description_not_sent() -> None:
    listed = listing(DESCRIPTION, READY)
    assert listed["bias"] == {"layer1": True, "layer2": False, "linear_v": None}
    assert listed["ready"] and listed["state"] == READY.state.value and "weight_bytes" not in listed
    assert listing(DESCRIPTION, UNLOADED)["reason"] == UNLOADED.reason
