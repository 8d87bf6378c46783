"""Activation functions by name: a fresh module is built per FFN, never shared."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from torch import nn

# Name -> what builds it: a class, or a class with its arguments bound. The GLU variants are these
# same activations on a gated FFN: ReGLU = relu, GEGLU = gelu, SwiGLU = silu, bilinear = identity.
ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "relu": nn.ReLU,
    "gelu": nn.GELU,  # exact erf form, as BERT uses
    "gelu_tanh": partial(nn.GELU, approximate="tanh"),  # GPT-2's "gelu_new"
    "silu": nn.SiLU,
    "identity": nn.Identity,
}


def get_activation(name: str) -> nn.Module:
    """Build the activation called `name`; an unknown name lists the choices."""
    try:
        factory = ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; choose one of {sorted(ACTIVATIONS)}") from None
    return factory()
