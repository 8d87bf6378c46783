"""The service state as the HTTP routes reach it: `request.app.state.service`, set by create_app."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.protocol.state import ServiceState


def service_state(request: Request) -> ServiceState:
    """The app's ServiceState (a plain function: the tensor routes skip FastAPI's dependencies)."""
    state: ServiceState = request.app.state.service
    return state


async def _state_dependency(request: Request) -> ServiceState:
    # async on purpose: FastAPI runs a sync dependency in a worker thread, a thread hop per request.
    return service_state(request)


StateDep = Annotated[ServiceState, Depends(_state_dependency)]
