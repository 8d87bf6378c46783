"""Keep-alive clients that never retry, and what became of each request they wrote.

The load tester retries a request once on a fresh connection when a kept-alive one turns out
closed (an idle timeout), which is right for measuring throughput and wrong for counting losses:
the retry hides a request the server closed the connection under. Here each request has one
fate: answered (by status), refused (the connect failed: nothing was written), or lost (written,
then a reset, an end of stream or no whole answer within the timeout).

    fates = asyncio.run(keep_alive_clients("127.0.0.1", port, request, clients=8, stop=stop))
    assert fates.lost == []
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from ffn_client.http1 import read_response


@dataclass
class Fates:
    """What became of every request the clients wrote, and of the connects that failed."""

    answered: Counter[int] = field(default_factory=Counter)  # status -> requests answered with it
    closing: Counter[int] = field(default_factory=Counter)  # status -> of those, answers with Connection: close
    refused: int = 0  # connects that failed: nothing written
    lost: list[str] = field(default_factory=list)  # one reason per request written and never answered

    @property
    def sent(self) -> int:
        return sum(self.answered.values()) + len(self.lost)

    def to_dict(self) -> dict[str, object]:
        return {
            "sent": self.sent,
            "answered": {str(k): v for k, v in sorted(self.answered.items())},
            "closing": {str(k): v for k, v in sorted(self.closing.items())},
            "refused": self.refused,
            "lost": len(self.lost),
            "lost_reasons": sorted(set(self.lost))[:5],
        }


async def keep_alive_clients(
    host: str,
    port: int,
    request: bytes,
    *,
    clients: int,
    stop: asyncio.Event,
    requests: int | None = None,
    stop_when_refused: bool = True,
    timeout: float = 60.0,
    on_answer: Callable[[Fates], None] | None = None,
) -> Fates:
    """Run `clients` closed loops, each sending `request` on one kept-alive connection at a time.

    A connection is reopened only when the server said `Connection: close` or the request was
    lost. A loop ends when `stop` is set, when `requests` have been written in all, or (with
    `stop_when_refused`) at its first refused connect: the server is gone. `on_answer` sees the
    counts after every answer (to act on the load midway, say).
    """
    fates = Fates()
    written = 0

    async def one_client() -> None:
        nonlocal written
        connection: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while not stop.is_set() and (requests is None or written < requests):
                if connection is None:
                    try:
                        connection = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
                    except (OSError, TimeoutError):
                        fates.refused += 1
                        if stop_when_refused:
                            return
                        await asyncio.sleep(0.05)
                        continue
                reader, writer = connection
                written += 1
                try:
                    writer.write(request)
                    async with asyncio.timeout(timeout):
                        await writer.drain()
                        response = await read_response(reader)
                except (OSError, EOFError, ValueError, TimeoutError) as exc:  # ConnectionClosed included
                    fates.lost.append(f"{type(exc).__name__}: {exc}"[:200])
                    writer.close()
                    connection = None
                    continue
                fates.answered[response.status] += 1
                if not response.keep_alive:
                    fates.closing[response.status] += 1
                    writer.close()
                    connection = None
                if on_answer is not None:
                    on_answer(fates)
        finally:
            if connection is not None:
                connection[1].close()

    await asyncio.gather(*(one_client() for _ in range(clients)))
    return fates
