"""Annotated dependency aliases for the routes."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.state import ServiceState


async def get_state(request: Request) -> ServiceState:
    # async on purpose: FastAPI runs a sync dependency in a worker thread, a thread hop per request.
    return request.app.state.service


StateDep = Annotated[ServiceState, Depends(get_state)]
