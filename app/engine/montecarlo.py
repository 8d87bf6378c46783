"""Monte Carlo dropout requests and results, as the engine's facade takes and answers them (no torch here).

A request asks for N stochastic passes over its rows and gets their mean and standard deviation.
It is never batched with others (its masks are drawn for its own rows from its own seed, so
company would change its answer): the Batcher queues it with the plain rows, counted as rows ×
passes, and runs its passes in slices on the model's device thread, between plain batches, so
that it never holds the device for long (app/engine/batcher.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MonteCarloRequest:
    """What a request asked for, checked at the edge: passes >= 2, 0 <= dropout < 1, a seed."""

    passes: int
    dropout: float
    seed: int


@dataclass(frozen=True)
class MonteCarloResult:
    """Per-element mean and standard deviation (Bessel-corrected) over the passes, as the facade answers
    them: numpy arrays in the answer's dtype (bfloat16 as its uint16 patterns: ffn_core/dtypes.py)."""

    mean: np.ndarray  # (rows, d_model)
    std: np.ndarray  # (rows, d_model)
