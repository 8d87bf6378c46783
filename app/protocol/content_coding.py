"""Compressed bodies: gzip and deflate request bodies inflated within the body's budgets, and compressed answers.

A request body with `Content-Encoding: gzip` or `deflate` (tritonclient's
`request_compression_algorithm`, as Triton reads it) is inflated as it arrives by an `Inflater`:
zlib's incremental decompressor asked for at most `STEP` bytes at a time (`max_length`), each
piece counted against `max_body_bytes` (413) and taken from the request's hold of the process's
held-bytes budget (429) before it is kept. So a small body that would inflate to gigabytes is
refused once its inflated size passes the limit, having cost at most the limit in memory: it is
never inflated first and checked after. What it inflates to is then read exactly as an
uncompressed body would be (JSON counted before parsing, binary tensors viewed in it).

`deflate` is the zlib format (RFC 9110; what tritonclient sends), and a raw deflate stream, which
some clients send under that name, is read too. Any other coding is a 415 naming the two, before
the body is read (the headers are read by app/protocol/fields.py: request_coding, answer_coding).

An answer is compressed when `Accept-Encoding` asks for gzip or deflate (tritonclient's
`response_compression_algorithm`), at zlib's fastest level: float tensors barely compress (raw
float32: about 8 %), JSON about 2x, and a higher level would cost several times the CPU for a
few percent.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

from app.protocol.admission import Hold
from app.protocol.errors import InvalidInput, PayloadTooLarge
from app.protocol.fields import Coding

STEP = 256 * 1024  # inflated bytes asked of zlib at a time: the most held beyond what was counted
ANSWER_LEVEL = 1  # zlib's fastest


class Inflater:
    """One compressed body, inflated piece by piece and never past `limit` bytes.

    inflater = Inflater("gzip", limit, hold)
    for chunk in chunks:
        for piece in inflater.feed(chunk):   # each piece at most STEP bytes, already counted
            keep(piece)
    inflater.finish()                         # 400 if the stream ended early
    """

    def __init__(self, coding: Coding, limit: int, hold: Hold | None = None) -> None:
        self.coding = coding
        self.limit = limit
        self.size = 0  # inflated bytes so far
        self._hold = hold
        self._zlib: zlib._Decompress | None = zlib.decompressobj(16 + zlib.MAX_WBITS) if coding == "gzip" else None
        self._head = b""  # deflate: its first bytes, until they say zlib or raw

    def feed(self, data: bytes) -> Iterator[bytes]:
        """The inflated pieces of the next compressed bytes: 413 past the limit, 429 past the held budget, 400 if corrupt."""
        inflater = self._zlib
        if inflater is None:
            self._head += data
            if len(self._head) < 2:
                return
            inflater = self._zlib = zlib.decompressobj(zlib.MAX_WBITS if _zlib_header(self._head) else -zlib.MAX_WBITS)
            data, self._head = self._head, b""
        if inflater.eof:
            if data:
                raise self._trailing()
            return
        while True:
            try:
                piece = inflater.decompress(data, STEP)
            except zlib.error as exc:
                raise InvalidInput(f"the body is not valid {self.coding} data: {exc}") from None
            data = inflater.unconsumed_tail
            if piece:
                self._count(len(piece))
                yield piece
            if inflater.eof:
                if data or inflater.unused_data:
                    raise self._trailing()
                return
            # A full piece may leave output pending inside zlib even when all input was taken: ask again.
            if not data and len(piece) < STEP:
                return

    def finish(self) -> None:
        """The body ended: its compressed stream must have ended too (400 otherwise)."""
        if self._zlib is None or not self._zlib.eof:
            raise InvalidInput(f"the {self.coding} body ends before its compressed data does (truncated)")

    def _count(self, size: int) -> None:
        self.size += size
        if self.size > self.limit:
            raise PayloadTooLarge(
                f"the {self.coding} body inflates past the limit of {self.limit} bytes (max_body_bytes)"
            )
        if self._hold is not None and self.size > self._hold.size:
            self._hold.resize(self.size)

    def _trailing(self) -> InvalidInput:
        return InvalidInput(f"the body holds data after the end of its {self.coding} stream")


def _zlib_header(head: bytes) -> bool:
    """Whether two bytes open a zlib stream (RFC 1950: deflate method, header checksum), not raw deflate."""
    return head[0] & 0x0F == 8 and (head[0] << 8 | head[1]) % 31 == 0


def compress(body: bytes | bytearray | memoryview, coding: Coding) -> bytes:
    """`body` compressed in `coding`: a gzip member, or a zlib stream for deflate (RFC 9110)."""
    wbits = 16 + zlib.MAX_WBITS if coding == "gzip" else zlib.MAX_WBITS
    compressor = zlib.compressobj(ANSWER_LEVEL, zlib.DEFLATED, wbits)
    return compressor.compress(body) + compressor.flush()
