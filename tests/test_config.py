"""FFNConfig: checked on construction, names its variant, round-trips through a dict."""

from __future__ import annotations

import dataclasses

import pytest

from ffn_core import ACTIVATIONS, FFNConfig


def test_defaults_are_the_seeds():
    config = FFNConfig(d_model=512, d_ff=2048)
    assert (config.activation, config.gated, config.bias1, config.bias2, config.bias_gate) == (
        "relu",
        False,
        True,
        True,
        True,
    )
    assert config.dropout == 0.0


@pytest.mark.parametrize(
    ("activation", "gated", "variant"),
    [
        ("relu", False, "relu"),
        ("gelu", False, "gelu"),
        ("gelu_tanh", False, "gelu_tanh"),
        ("silu", False, "silu"),
        ("relu", True, "reglu"),
        ("gelu", True, "geglu"),
        ("gelu_tanh", True, "geglu_tanh"),
        ("silu", True, "swiglu"),
        ("identity", True, "bilinear"),
    ],
)
def test_variant_names(activation, gated, variant):
    assert FFNConfig(8, 16, activation=activation, gated=gated).variant == variant


@pytest.mark.parametrize(
    ("field", "value"),
    [("d_model", 0), ("d_model", -4), ("d_ff", 0), ("d_ff", 2.5), ("d_model", True), ("d_ff", "16")],
)
def test_bad_sizes(field, value):
    sizes = {"d_model": 8, "d_ff": 16, field: value}
    with pytest.raises(ValueError, match=f"{field} must be a positive integer"):
        FFNConfig(**sizes)


def test_unknown_activation_lists_the_choices():
    with pytest.raises(ValueError, match="unknown activation 'swish'") as info:
        FFNConfig(8, 16, activation="swish")
    for name in ACTIVATIONS:
        assert name in str(info.value)


def test_identity_needs_a_gate():
    with pytest.raises(ValueError, match="identity"):
        FFNConfig(8, 16, activation="identity")
    assert FFNConfig(8, 16, activation="identity", gated=True).variant == "bilinear"


@pytest.mark.parametrize("field", ["gated", "bias1", "bias2", "bias_gate"])
def test_flags_must_be_bools(field):
    with pytest.raises(ValueError, match=f"{field} must be a bool"):
        FFNConfig(8, 16, **{field: 1})


@pytest.mark.parametrize("dropout", [-0.1, 1.0, 1.5, "0.1"])
def test_bad_dropout(dropout):
    with pytest.raises(ValueError, match="dropout"):
        FFNConfig(8, 16, dropout=dropout)


def test_frozen():
    config = FFNConfig(8, 16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.d_ff = 32  # type: ignore[misc]


def test_dict_round_trip():
    config = FFNConfig(8, 16, activation="silu", gated=True, bias1=False, bias_gate=False, dropout=0.1)
    assert FFNConfig.from_dict(config.to_dict()) == config


def test_from_dict_refuses_unknown_keys():
    with pytest.raises(ValueError, match="unknown FFN config keys: \\['is_gated'\\]"):
        FFNConfig.from_dict({"d_model": 8, "d_ff": 16, "is_gated": True})
