"""Monte Carlo dropout parameters, read alike from native query strings and V2 request parameters.

`mc_passes` (N, 2..max_mc_passes) asks for the mode; `mc_seed` (0..2^63-1) makes it reproducible
(one is drawn and echoed when absent); `mc_dropout` overrides the model's rate, in [0, 1).
A request without `mc_passes` is a plain one and never reaches this module's checks.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping

from app.engine.montecarlo import MonteCarloRequest
from app.engine.registry import ServedModel
from app.web.errors import InvalidInput

PASSES = "mc_passes"
SEED = "mc_seed"
DROPOUT = "mc_dropout"
NAMES = (PASSES, SEED, DROPOUT)
MAX_SEED = 2**63 - 1


def monte_carlo_request(values: Mapping[str, object], served: ServedModel, max_passes: int) -> MonteCarloRequest | None:
    """The checked request, or None when `mc_passes` is absent; InvalidInput names what is wrong."""
    passes = values.get(PASSES)
    if passes is None:
        refuse_without_passes(values)
        return None
    if max_passes == 0:
        raise InvalidInput("Monte Carlo dropout is turned off on this server (max_mc_passes = 0)")
    passes = _integer(passes, PASSES, 2, max_passes)
    seed_value = values.get(SEED)
    seed = secrets.randbits(63) if seed_value is None else _integer(seed_value, SEED, 0, MAX_SEED)
    return MonteCarloRequest(passes, _dropout(values.get(DROPOUT), served), seed)


def refuse_without_passes(values: Mapping[str, object]) -> None:
    """mc_seed or mc_dropout without mc_passes is a mistake, not a plain request: say so."""
    stray = [name for name in (SEED, DROPOUT) if values.get(name) is not None]
    if stray:
        raise InvalidInput(f"{', '.join(stray)} applies only to Monte Carlo dropout requests: add {PASSES}")


def echoed(request: MonteCarloRequest) -> dict[str, int | float]:
    """The parameters a Monte Carlo answer was computed with, by their request names (the seed drawn too)."""
    return {PASSES: request.passes, DROPOUT: request.dropout, SEED: request.seed}


def _integer(value: object, name: str, low: int, high: int) -> int:
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 20:
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise InvalidInput(f"{name} must be an integer from {low} to {high}, got {str(value)[:32]!r}")
    return value


def _dropout(value: object, served: ServedModel) -> float:
    if value is None:
        if served.dropout == 0.0:
            raise InvalidInput(
                f"model {served.name!r} has no dropout rate: set `dropout` in its [[models]] table, "
                f"or pass {DROPOUT} (for example 0.1)"
            )
        return served.dropout
    rate = value
    if isinstance(value, str):
        try:
            rate = float(value)
        except ValueError:
            rate = value
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not (math.isfinite(rate) and 0 <= rate < 1):
        raise InvalidInput(f"{DROPOUT} must be a number in [0, 1), got {str(value)[:32]!r}")
    return float(rate)
