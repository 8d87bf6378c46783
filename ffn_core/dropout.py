"""Opt-in Monte Carlo dropout: the spread of an FFN's output under hidden-layer dropout.

Serving's forward pass has no dropout. This mode runs N stochastic passes with dropout on
the hidden layer and returns the per-element mean and standard deviation, as the darts seed
does with MonteCarloDropout. The hidden layer is computed once and only the masked output
projection is repeated, since dropout acts after the activation (and the gate).

`MonteCarloPasses` runs the passes in slices of any size (a server interleaves them with other
work): pass i's mask is the i-th draw of one generator seeded once, so the answer does not depend
on how the passes were sliced. Mean and variance are accumulated per pass (Welford, in float64),
so memory stays at a few copies of the output whatever the number of passes.
"""

from __future__ import annotations

import torch

from ffn_core.model import FeedForward


class MonteCarloPasses:
    """`passes` dropout passes of `model` over `x`, run `run(k)` passes at a time; `result()` at the end."""

    @torch.inference_mode()
    def __init__(self, model: FeedForward, x: torch.Tensor, *, passes: int, p: float, seed: int | None) -> None:
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        if passes < 2:
            raise ValueError(f"passes must be at least 2 to estimate a spread, got {passes}")
        self._model = model
        self._dtype = x.dtype
        self.passes = passes
        self.done = 0
        self._keep = 1.0 - p
        self._generator = torch.Generator(device=x.device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)
        self._hidden = model.hidden(x)  # (..., d_ff)
        self._keep_probs = torch.full_like(self._hidden, self._keep)
        shape = (*x.shape[:-1], model.config.d_model)
        self._mean = torch.zeros(shape, dtype=torch.float64, device=x.device)
        self._m2 = torch.zeros(shape, dtype=torch.float64, device=x.device)  # sum of squared deviations

    @property
    def remaining(self) -> int:
        return self.passes - self.done

    @torch.inference_mode()
    def run(self, passes: int) -> None:
        """Run the next `passes` passes (fewer if fewer remain)."""
        for _ in range(min(passes, self.remaining)):
            mask = torch.bernoulli(self._keep_probs, generator=self._generator)
            y = self._model.layer2(self._hidden * mask / self._keep).double()  # (..., d_model)
            self.done += 1
            delta = y - self._mean
            self._mean += delta / self.done
            self._m2 += delta * (y - self._mean)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and standard deviation (Bessel-corrected) over the passes, in the input's dtype."""
        if self.remaining:
            raise RuntimeError(f"{self.remaining} of {self.passes} passes have not run yet")
        std = (self._m2 / (self.passes - 1)).sqrt()
        return self._mean.to(self._dtype), std.to(self._dtype)


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
    run = MonteCarloPasses(model, x, passes=passes, p=model.config.dropout if p is None else p, seed=seed)
    run.run(passes)
    return run.result()
