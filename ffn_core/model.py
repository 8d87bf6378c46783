"""The position-wise feed-forward network, plain and gated.

Plain:  y = f(x W1 + b1) W2 + b2
Gated:  y = (f(x W1 + b1) ⊗ (x V + c)) W2 + b2      (ReGLU, GEGLU, SwiGLU, bilinear)

Parameter names are the seeds' (`layer1`, `layer2`, `linear_v`), so a state dict saved from
that FeedForward module loads unchanged. Inputs may have any leading shape [..., d_model].

FusedGatedFeedForward computes x W1 and x V as one GEMM over the concatenation W1‖V (one launch
and one pass over x instead of two); `fuse_gate(model)` builds it from a GatedFeedForward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from ffn_core.activations import get_activation
from ffn_core.config import FFNConfig


class FeedForward(nn.Module):
    """y = f(x W1 + b1) W2 + b2. No dropout in `forward`: serving never pays for it."""

    def __init__(self, config: FFNConfig) -> None:
        super().__init__()
        self.config = config
        self.layer1 = nn.Linear(config.d_model, config.d_ff, bias=config.bias1)
        self.layer2 = nn.Linear(config.d_ff, config.d_model, bias=config.bias2)
        self.activation = get_activation(config.activation)

    # The submodules' weights are applied with F.linear and the activation's `forward` called
    # directly: nn.Module.__call__'s hook dispatch on three submodules was 40 % of a 14-row CPU
    # forward of a small model (30 against 18 µs), paid on every batch. Hooks on the FFN itself
    # still run; the submodules are parameter holders (their names are the checkpoint's).

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The hidden layer, before dropout and the output projection: (..., d_ff)."""
        return self.activation.forward(F.linear(x, self.layer1.weight, self.layer1.bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The FFN of every row of `x`: (..., d_model) -> (..., d_model)."""
        return F.linear(self.hidden(x), self.layer2.weight, self.layer2.bias)  # (..., d_model)


class GatedFeedForward(FeedForward):
    """y = (f(x W1 + b1) ⊗ (x V + c)) W2 + b2, the GLU family."""

    def __init__(self, config: FFNConfig) -> None:
        super().__init__(config)
        self.linear_v = nn.Linear(config.d_model, config.d_ff, bias=config.bias_gate)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The gated hidden layer, f(x W1 + b1) ⊗ (x V + c): (..., d_ff)."""
        gate = F.linear(x, self.linear_v.weight, self.linear_v.bias)
        return self.activation.forward(F.linear(x, self.layer1.weight, self.layer1.bias)) * gate  # (..., d_ff)


class FusedGatedFeedForward(GatedFeedForward):
    """GatedFeedForward with W1‖V concatenated: h = x [W1‖V]ᵀ + [b1‖c], one GEMM, then split in two.

    `layer1` and `linear_v` stay as modules whose parameters are views into the fused weight, so
    the state dict keeps the seeds' names (saving reads the views, loading re-fuses) and
    `unfused_forward` still computes the two projections apart, for checks.
    """

    def __init__(self, config: FFNConfig) -> None:
        super().__init__(config)
        self._fuse()
        # Loading (in place or with assign=True) replaces or rewrites the halves: fuse them again.
        self.register_load_state_dict_post_hook(lambda module, _keys: module._fuse())

    def _fuse(self) -> None:
        """Concatenate W1 and V (and their biases) and point `layer1` and `linear_v` at the halves."""
        d_ff = self.config.d_ff
        w1, v = self.layer1.weight, self.linear_v.weight
        self._w1v = torch.cat([w1.detach(), v.detach()])  # (2 d_ff, d_model)
        self.layer1.weight = nn.Parameter(self._w1v[:d_ff], requires_grad=w1.requires_grad)
        self.linear_v.weight = nn.Parameter(self._w1v[d_ff:], requires_grad=v.requires_grad)
        b1, c = self.layer1.bias, self.linear_v.bias
        if b1 is None and c is None:
            self._b1v: torch.Tensor | None = None
            return
        # A missing bias is zeros in the fused one: adding 0.0 leaves every value as it was.
        zeros = torch.zeros(d_ff, dtype=w1.dtype, device=w1.device)
        self._b1v = torch.cat([zeros if b1 is None else b1.detach(), zeros if c is None else c.detach()])
        if b1 is not None:
            self.layer1.bias = nn.Parameter(self._b1v[:d_ff], requires_grad=b1.requires_grad)
        if c is not None:
            self.linear_v.bias = nn.Parameter(self._b1v[d_ff:], requires_grad=c.requires_grad)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> FusedGatedFeedForward:
        """`.to()`, `.half()`, `.cuda()` convert each parameter apart, breaking the views: fuse again."""
        super()._apply(fn, recurse)
        self._fuse()
        return self

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        a, v = F.linear(x, self._w1v, self._b1v).chunk(2, dim=-1)  # (..., 2 d_ff) -> 2 x (..., d_ff)
        return self.activation.forward(a) * v  # (..., d_ff)

    def unfused_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The same FFN with W1 and V applied apart (GatedFeedForward's way): the reference for the fused one."""
        return self.layer2(GatedFeedForward.hidden(self, x))  # (..., d_model)


def fuse_gate(model: GatedFeedForward) -> FusedGatedFeedForward:
    """`model` with W1‖V fused, on the same device and dtype; the halves are copied once into the fused weight."""
    with torch.device("meta"):  # no memory and no initialisation: every tensor comes from `model`
        fused = FusedGatedFeedForward(model.config)
    fused.load_state_dict(model.state_dict(), assign=True)
    # assign=True keeps the meta module's requires_grad (True); keep the source's instead.
    return fused.requires_grad_(model.layer1.weight.requires_grad).train(model.training)


def build_ffn(config: FFNConfig) -> FeedForward:
    """A freshly initialised FFN of the given config (PyTorch's default init), in eval mode."""
    module = GatedFeedForward(config) if config.gated else FeedForward(config)
    return module.eval()


DEMO_CONFIG = FFNConfig(d_model=512, d_ff=2048, activation="relu")


def demo_ffn(seed: int = 0) -> FeedForward:
    """The built-in `demo` model: the original Transformer's sizes, weights from a fixed seed."""
    generator = torch.Generator().manual_seed(seed)
    model = build_ffn(DEMO_CONFIG)
    with torch.no_grad():
        for param in model.parameters():
            # Same scale as nn.Linear's default init, drawn from our own generator so the
            # weights are identical on every machine and torch version.
            bound = 1.0 / (param.shape[-1] ** 0.5) if param.ndim == 2 else 0.02
            param.copy_(torch.empty(param.shape).uniform_(-bound, bound, generator=generator))
    return model.requires_grad_(False)
