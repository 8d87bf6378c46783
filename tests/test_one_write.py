"""An answer's head and body reach the socket in one write (app/http/transport/protocol.py: OneWriteAnswers).

A process killed between two writes leaves a head without its body, which a proxy has passed
on and can no longer retry elsewhere (deploy/docker_check.py saw it once in 40,000 requests
behind nginx, across a replica's SIGKILL). A transport that records its writes stands in for
the socket's.
"""

from __future__ import annotations

import asyncio

from app.http.transport.protocol import ONE_WRITE_BYTES, OneWriteAnswers


class RecordingTransport(asyncio.Transport):
    """A transport that keeps what is written to it, and whether it was closed."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        assert not self.closed, "written after close"
        self.writes.append(bytes(data))

    def writelines(self, list_of_data) -> None:  # one vectored write (uvloop's writev): one entry
        assert not self.closed, "written after close"
        self.writes.append(b"".join(bytes(data) for data in list_of_data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


async def test_a_head_and_its_body_go_out_in_one_write() -> None:
    transport = RecordingTransport()
    answers = OneWriteAnswers(transport, asyncio.get_running_loop())
    answers.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\n")
    assert transport.writes == [], "the head waits for its body"
    answers.write(b"body")
    assert transport.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nbody"]
    await asyncio.sleep(0)  # the turn's end flushes nothing more
    assert len(transport.writes) == 1 and not answers.is_closing()


async def test_a_write_alone_goes_out_at_the_next_turn_and_before_a_close() -> None:
    transport = RecordingTransport()
    answers = OneWriteAnswers(transport, asyncio.get_running_loop())
    answers.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    await asyncio.sleep(0)
    assert transport.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]
    answers.write(b"HTTP/1.1 503 Service Unavailable\r\nconnection: close\r\n\r\n")
    answers.close()
    assert transport.writes[-1].startswith(b"HTTP/1.1 503") and transport.closed


async def test_a_large_body_goes_out_with_its_head_in_one_vectored_write() -> None:
    transport = RecordingTransport()
    answers = OneWriteAnswers(transport, asyncio.get_running_loop())
    body = b"x" * (ONE_WRITE_BYTES + 1)
    answers.write(b"HTTP/1.1 200 OK\r\n\r\n")
    answers.write(body)
    assert transport.writes == [b"HTTP/1.1 200 OK\r\n\r\n" + body]
    answers.write(body)  # nothing held, and too large to be a head: straight through
    assert transport.writes[-1] == body and len(transport.writes) == 2
