"""Monte Carlo dropout requests, as the engine takes and answers them.

A request asks for N stochastic passes over its rows and gets their mean and standard deviation.
It is never batched with others (its masks are drawn for its own rows from its own seed, so
company would change its answer): the Batcher queues it with the plain rows, counted as rows ×
passes, and runs its passes in slices on the model's device thread, between plain batches, so
that it never holds the device for long (app/engine/batcher.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MonteCarloRequest:
    """What a request asked for, checked at the edge: passes >= 2, 0 <= dropout < 1, a seed."""

    passes: int
    dropout: float
    seed: int


@dataclass(frozen=True)
class MonteCarloResult:
    """Per-element mean and standard deviation (Bessel-corrected) over the passes, on the host."""

    mean: torch.Tensor  # (rows, d_model)
    std: torch.Tensor  # (rows, d_model)
