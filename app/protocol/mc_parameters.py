"""Monte Carlo dropout parameters, read by both protocols with the one vocabulary of app/protocol/fields.py.

`mc_passes` (N, 2..max_mc_passes) asks for the mode; `mc_seed` (0..2^63-1) makes it reproducible
(one is drawn and echoed when absent); `mc_dropout` overrides the model's rate, in [0, 1).
V2 sends them as typed JSON request parameters (an integer is a JSON integer, never "3"); the
native route as query parameters, where every value is text (ASCII decimal digits only).
A request whose `mc_passes` is absent or null is a plain one.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

from app.engine.facade import ModelFacade
from app.engine.montecarlo import MonteCarloRequest
from app.protocol.errors import InvalidInput
from app.protocol.fields import int_field, number_field, text_int, text_number

PASSES = "mc_passes"
SEED = "mc_seed"
DROPOUT = "mc_dropout"
NAMES = (PASSES, SEED, DROPOUT)
MAX_SEED = 2**63 - 1


def asks_for_monte_carlo(values: Mapping[str, Any]) -> bool:
    """The one test of "is this a Monte Carlo request": mc_passes present and not null."""
    return values.get(PASSES) is not None


def from_json(parameters: Mapping[str, Any], served: ModelFacade, max_passes: int) -> MonteCarloRequest | None:
    """The request asked for by V2 request parameters (typed JSON), or None for a plain request."""
    where = "request parameter"
    passes = int_field(parameters, PASSES, where, minimum=2, maximum=max(2, max_passes))
    seed = int_field(parameters, SEED, where, minimum=0, maximum=MAX_SEED)
    dropout = number_field(parameters, DROPOUT, where, minimum=0.0, maximum=1.0)
    return _request(passes, seed, dropout, served, max_passes)


def from_query(values: Mapping[str, str], served: ModelFacade, max_passes: int) -> MonteCarloRequest | None:
    """The request asked for by native query parameters (text), or None for a plain request."""
    passes = _text_integer(values, PASSES, 2, max(2, max_passes))
    seed = _text_integer(values, SEED, 0, MAX_SEED)
    dropout = text_number(values.get(DROPOUT), f"query parameter {DROPOUT!r}")
    return _request(passes, seed, dropout, served, max_passes)


def echoed(request: MonteCarloRequest) -> dict[str, int | float]:
    """The parameters a Monte Carlo answer was computed with, by their request names (the seed drawn too)."""
    return {PASSES: request.passes, DROPOUT: request.dropout, SEED: request.seed}


def _request(
    passes: int | None, seed: int | None, dropout: float | None, served: ModelFacade, max_passes: int
) -> MonteCarloRequest | None:
    if passes is None:
        stray = [name for name, value in ((SEED, seed), (DROPOUT, dropout)) if value is not None]
        if stray:
            raise InvalidInput(f"{', '.join(stray)} applies only to Monte Carlo dropout requests: add {PASSES}")
        return None
    if max_passes == 0:
        raise InvalidInput("Monte Carlo dropout is turned off on this server (max_mc_passes = 0)")
    if dropout is not None and not 0.0 <= dropout < 1.0:
        raise InvalidInput(f"{DROPOUT} must be a number in [0, 1), got {dropout:g}")
    if dropout is None:
        if served.dropout == 0.0:
            raise InvalidInput(
                f"model {served.name!r} has no dropout rate: set `dropout` in its [[models]] table, "
                f"or pass {DROPOUT} (for example 0.1)"
            )
        dropout = served.dropout
    return MonteCarloRequest(passes, dropout, secrets.randbits(63) if seed is None else seed)


def _text_integer(values: Mapping[str, str], name: str, low: int, high: int) -> int | None:
    return text_int(values.get(name), f"query parameter {name!r}", minimum=low, maximum=high)
