"""FFNConfig: the shape and variant of one position-wise feed-forward network."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ffn_core.activations import ACTIVATIONS


@dataclass(frozen=True)
class FFNConfig:
    """Sizes, activation, gating and bias flags of an FFN, checked on construction.

    `dropout` is the hidden-layer dropout probability; it is used only by the opt-in
    Monte Carlo dropout mode (`ffn_core.mc_dropout`), never by the serving forward pass.
    """

    d_model: int
    d_ff: int
    activation: str = "relu"
    gated: bool = False
    bias1: bool = True
    bias2: bool = True
    bias_gate: bool = True
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("d_model", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.activation!r}; choose one of {sorted(ACTIVATIONS)}")
        if self.activation == "identity" and not self.gated:
            # Without a gate, identity makes the FFN one linear map: almost surely a config mistake.
            raise ValueError("activation 'identity' is only meaningful with gated=True (bilinear)")
        for name in ("gated", "bias1", "bias2", "bias_gate"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def variant(self) -> str:
        """The usual name of this variant: 'relu', 'gelu', ... or 'reglu', 'geglu', 'swiglu', 'bilinear'."""
        if not self.gated:
            return self.activation
        return {
            "relu": "reglu",
            "gelu": "geglu",
            "gelu_tanh": "geglu_tanh",
            "silu": "swiglu",
            "identity": "bilinear",
        }[self.activation]

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict, as save_ffn stores them in a file's metadata."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> FFNConfig:
        """Build from a plain mapping, refusing keys this config does not know."""
        unknown = set(values) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown FFN config keys: {sorted(unknown)}")
        return cls(**values)
