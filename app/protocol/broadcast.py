"""Changes every serving process applies (app/control.py), as the edge sends them: all or an error.

A route that changes the service (a log level, a shared-memory region) validates the change
first, in its own process, so that a client's mistake is a 400 before anything is applied; then
it broadcasts it. Every reply must be ok: a process that exited meanwhile or refused it is a 503
naming it (Retry-After: 1). A replacement worker gets sticky changes replayed before it serves.
"""

from __future__ import annotations

from typing import Any

from app.control import Control, Reply
from app.protocol.errors import NotApplied


def refusals(replies: list[Reply]) -> list[str]:
    """Why each process that did not apply a change did not: 'worker 2: ...'."""
    return [f"worker {reply.worker}: {reply.error}" for reply in replies if not reply.ok]


async def apply_everywhere(
    control: Control, name: str, args: dict[str, Any], *, sticky: str | None = None, forget: bool = False
) -> list[Reply]:
    """Broadcast `name` and return the replies; NotApplied (503) unless every process applied it."""
    replies = await control.broadcast(name, args, sticky=sticky, forget=forget)
    problems = refusals(replies)
    if problems:
        raise NotApplied(f"{name} was not applied in every server process: {'; '.join(problems)}")
    return replies
