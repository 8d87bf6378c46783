"""Opt-in Monte Carlo dropout: the spread of an FFN's output under hidden-layer dropout.

Serving's forward pass has no dropout. This mode runs N stochastic passes with dropout on
the hidden layer and returns the per-element mean and standard deviation, as the darts seed
does with MonteCarloDropout. The hidden layer is computed once and only the masked output
projection is repeated, since dropout acts after the activation (and the gate).
"""

from __future__ import annotations

import torch

from ffn_core.model import FeedForward


@torch.inference_mode()
def mc_dropout(
    model: FeedForward,
    x: torch.Tensor,
    *,
    passes: int = 32,
    p: float | None = None,
    seed: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and standard deviation (Bessel-corrected) over `passes` dropout passes.

    `p` defaults to the model config's dropout; the same `seed` gives the same result.
    """
    p = model.config.dropout if p is None else p
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    if passes < 2:
        raise ValueError(f"passes must be at least 2 to estimate a spread, got {passes}")
    generator = torch.Generator(device=x.device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    hidden = model.hidden(x)  # (..., d_ff)
    keep = 1.0 - p
    keep_probs = torch.full_like(hidden, keep)
    outputs = torch.empty((passes, *x.shape[:-1], model.config.d_model), dtype=x.dtype, device=x.device)
    for i in range(passes):
        mask = torch.bernoulli(keep_probs, generator=generator)
        outputs[i] = model.layer2(hidden * mask / keep)
    std, mean = torch.std_mean(outputs, dim=0)
    return mean, std
