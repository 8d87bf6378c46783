"""A lean request's large body, read straight into its own buffer (an asyncio.BufferedProtocol).

A plain protocol's reads come as bytes objects: uvloop (or asyncio) reads into a buffer of its
own and copies each read into a new object, and the lean request then joined a body's reads into
one more copy. While a body of at least DIRECT_BODY_BYTES is still to come, the connection's
transport reads through a DirectBody instead (`transport.set_protocol`): the kernel writes each
read into the request's own buffer, where its rows will be viewed, up to the body's last byte and
never past it, so the next request's bytes still reach the parser.

The connection's protocol (the `BodyOwner`) keeps every rule: it counts each read against the
body's budgets and clocks, and takes its transport back once the body is whole, or as soon as it
no longer wants the body read this way (a refusal, a hang-up). Whatever else the transport tells
its protocol (a hang-up, an end of input, writes paused and resumed) goes to the owner.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

import numpy as np

# A lean body with at least this many bytes still to come after a read is read directly: below
# it, the two switches of the transport's protocol (each a stop and a start of its reading) cost
# about what the copies they save do.
DIRECT_BODY_BYTES = 64 * 1024
SPARE_BYTES = 64 * 1024  # a read the owner no longer wants in the body lands here and goes to data_received


class BodyOwner(Protocol):
    """What a DirectBody asks of the connection's protocol."""

    def reads_directly(self, reader: DirectBody) -> bool:
        """Whether the next read still belongs in `reader`'s body."""
        ...

    def body_read(self, reader: DirectBody, nbytes: int) -> None:
        """`nbytes` more of the body are in `reader.buffer`."""
        ...

    def take_transport_back(self, reader: DirectBody) -> None:
        """Read as the owner again (set_protocol back), before any more bytes are read."""
        ...

    def data_received(self, data: bytes) -> None: ...

    def eof_received(self) -> bool | None: ...

    def connection_lost(self, exc: Exception | None) -> None: ...

    def pause_writing(self) -> None: ...

    def resume_writing(self) -> None: ...


class DirectBody(asyncio.BufferedProtocol):
    """Reads the rest of one body into `buffer`, which holds what came before it too."""

    def __init__(self, owner: BodyOwner, received: Sequence[bytes | memoryview], total: int) -> None:
        """`received`: the body's bytes read so far; `total`: its declared length (at least theirs)."""
        self.owner = owner
        # np.empty: no bytes are zeroed that the reads will write anyway (a bytearray is zeroed).
        self.buffer = np.empty(total, dtype=np.uint8)
        self._view = self.buffer.data  # a writable memoryview of it
        self.filled = 0
        for chunk in received:
            self._view[self.filled : self.filled + len(chunk)] = chunk
            self.filled += len(chunk)
        self._into_body = False  # where the last get_buffer pointed: the body, or the spare buffer
        self._spare: bytearray | None = None

    def take_body(self) -> memoryview:
        """The whole body, once read: a view of the buffer, which it keeps alive; this reader keeps neither."""
        view = self._view
        self._view = memoryview(b"")
        self.buffer = np.empty(0, dtype=np.uint8)
        return view

    def get_buffer(self, sizehint: int) -> memoryview | bytearray:
        self._into_body = self.owner.reads_directly(self)
        if self._into_body:
            return self._view[self.filled :]  # the body's rest: a read never takes the next request's bytes
        if self._spare is None:
            self._spare = bytearray(SPARE_BYTES)
        return self._spare

    def buffer_updated(self, nbytes: int) -> None:
        if self._into_body:
            self.filled += nbytes
            self.owner.body_read(self, nbytes)
            return
        assert self._spare is not None, "get_buffer handed out the spare buffer; this is a bug."
        data = bytes(self._spare[:nbytes])
        self.owner.take_transport_back(self)
        self.owner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.owner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.owner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.owner.pause_writing()

    def resume_writing(self) -> None:
        self.owner.resume_writing()
