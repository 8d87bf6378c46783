"""Annotated dependency aliases for the routes."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.state import ServiceState


def get_state(request: Request) -> ServiceState:
    return request.app.state.service


StateDep = Annotated[ServiceState, Depends(get_state)]
