"""Frames: the control messages of one turn of an event loop, as one write on the Unix socket.

A frame is a little-endian uint32 length and a MessagePack list of typed messages (messages.py), each
a compact array: its tag, then its fields. A frame is decoded as the types the reading side takes
(`FRONT_TO_ENGINE`, `ENGINE_TO_FRONT`): one that does not decode as them (a bug, never a client,
could make one: both ends are this service's own processes) ends the connection (BadFrame),
as a frame past MAX_FRAME_BYTES does.

FrameWriter gathers what a turn sends and writes it in one frame at the end of that turn
(`loop.call_soon`): a front answering a batch of 64 requests, or an engine answering them, pays
one system call and one encoding, not 64.

Before its first frame, a connection carries the front's shared memory (memory.py): one byte,
MEMORY_BYTE, with the block's descriptor attached (SCM_RIGHTS). It is sent and received on the raw
socket, before asyncio's streams wrap it: they carry bytes, never descriptors. A descriptor cannot
be named or opened by another process; it crosses only this socket, in a folder only the service's
user can open.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
from typing import Generic, TypeVar

import msgspec

from app.handoff.messages import EngineMessage, FrontMessage, Message

LENGTH = struct.Struct("<I")
MAX_FRAME_BYTES = 1 << 30

M = TypeVar("M", bound=Message)

# What each side reads: a front's messages on the engine's side, the engine's on a front's.
FRONT_TO_ENGINE = msgspec.msgpack.Decoder(list[FrontMessage])
ENGINE_TO_FRONT = msgspec.msgpack.Decoder(list[EngineMessage])
_ENCODER = msgspec.msgpack.Encoder()

MEMORY_BYTE = b"M"  # the byte the shared memory's descriptor rides on


class BadFrame(Exception):
    """A frame longer than MAX_FRAME_BYTES, or not of the messages its reader takes: the connection is not
    trusted further."""


async def read_frame(reader: asyncio.StreamReader, decoder: msgspec.msgpack.Decoder[list[M]]) -> list[M]:
    """The next frame's messages, as `decoder`'s types; IncompleteReadError at the connection's end."""
    (length,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
    if length > MAX_FRAME_BYTES:
        raise BadFrame(f"a frame of {length} bytes, more than {MAX_FRAME_BYTES}")
    try:
        return decoder.decode(await reader.readexactly(length))
    except msgspec.DecodeError as exc:
        raise BadFrame(f"a frame that is not the hand-off's messages: {exc}") from None


def encode(messages: list[M]) -> bytes:
    """A frame's body: what `read_frame` decodes."""
    return _ENCODER.encode(messages)


class FrameWriter(Generic[M]):
    """Messages queued during a turn of the loop, written as one frame when the turn ends."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._queued: list[M] = []

    def send(self, message: M) -> None:
        if not self._queued:
            asyncio.get_running_loop().call_soon(self._flush)
        self._queued.append(message)

    def _flush(self) -> None:
        messages, self._queued = self._queued, []
        if not messages or self._writer.is_closing():
            return
        body = _ENCODER.encode(messages)
        self._writer.write(LENGTH.pack(len(body)) + body)

    async def drain(self) -> None:
        """Wait while the socket's buffer is over its high-water mark (the peer is slow to read)."""
        await self._writer.drain()


def send_memory(sock: socket.socket, fd: int) -> None:
    """Hand the descriptor `fd` to the peer of a just-connected socket (a few bytes: its buffer is empty)."""
    if socket.send_fds(sock, [MEMORY_BYTE], [fd]) != len(MEMORY_BYTE):
        raise ConnectionError("the shared memory's descriptor could not be sent")


async def receive_memory(sock: socket.socket) -> int:
    """The descriptor a front handed over on a just-accepted non-blocking socket; ConnectionError if the
    connection ends first, ValueError if its first byte carries no descriptor."""
    loop = asyncio.get_running_loop()
    while True:
        readable: asyncio.Future[None] = loop.create_future()
        loop.add_reader(sock.fileno(), _set_once, readable)
        try:
            await readable
        finally:
            loop.remove_reader(sock.fileno())
        try:
            data, fds, flags, _ = socket.recv_fds(sock, len(MEMORY_BYTE), 1)
        except BlockingIOError:
            continue
        if not data:
            raise ConnectionError("the front closed its connection before it handed over its memory")
        if data != MEMORY_BYTE or len(fds) != 1 or flags & socket.MSG_CTRUNC:
            for fd in fds:
                os.close(fd)
            raise ValueError("a front's connection began without its shared memory")
        return fds[0]


def _set_once(future: asyncio.Future[None]) -> None:
    if not future.done():  # a reader's callback runs at each turn while the socket is readable
        future.set_result(None)
