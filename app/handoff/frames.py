"""Frames: the control messages of one turn of an event loop, as one write on the Unix socket.

A frame is a little-endian uint32 length and a pickle of a list of tuples (messages.py): strings,
numbers, shapes, and the bytes of rows too large for a slot. Both ends are this service's own
processes, started by one supervisor and connected through a socket in a folder only its user can
open, so pickle's trust in its input is the service's trust in itself; a frame past MAX_FRAME_BYTES
ends the connection all the same (a bug, never a client, could make one).

FrameWriter gathers what a turn sends and writes it in one frame at the end of that turn
(`loop.call_soon`): a front answering a batch of 64 requests, or an engine answering them, pays
one system call and one pickle, not 64.
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from typing import Any

LENGTH = struct.Struct("<I")
MAX_FRAME_BYTES = 1 << 30

Message = tuple[Any, ...]


class FrameTooLarge(Exception):
    """A frame longer than MAX_FRAME_BYTES: the connection is not trusted further."""


async def read_frame(reader: asyncio.StreamReader) -> list[Message]:
    """The next frame's messages; IncompleteReadError at the connection's end."""
    (length,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
    if length > MAX_FRAME_BYTES:
        raise FrameTooLarge(f"a frame of {length} bytes, more than {MAX_FRAME_BYTES}")
    messages: list[Message] = pickle.loads(await reader.readexactly(length))
    return messages


class FrameWriter:
    """Messages queued during a turn of the loop, written as one frame when the turn ends."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._queued: list[Message] = []

    def send(self, message: Message) -> None:
        if not self._queued:
            asyncio.get_running_loop().call_soon(self._flush)
        self._queued.append(message)

    def _flush(self) -> None:
        messages, self._queued = self._queued, []
        if not messages or self._writer.is_closing():
            return
        body = pickle.dumps(messages, protocol=pickle.HIGHEST_PROTOCOL)
        self._writer.write(LENGTH.pack(len(body)) + body)

    async def drain(self) -> None:
        """Wait while the socket's buffer is over its high-water mark (the peer is slow to read)."""
        await self._writer.drain()
