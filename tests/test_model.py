"""FeedForward and GatedFeedForward against the FFN formula written out in float64 numpy."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch import nn

from ffn_core import DEMO_CONFIG, FFNConfig, GatedFeedForward, build_ffn, demo_ffn

D_MODEL, D_FF = 12, 40


def _variants():
    for activation in ("relu", "gelu", "gelu_tanh", "silu"):
        for bias1, bias2 in itertools.product((True, False), repeat=2):
            yield FFNConfig(D_MODEL, D_FF, activation, gated=False, bias1=bias1, bias2=bias2)
    for activation in ("relu", "gelu", "gelu_tanh", "silu", "identity"):
        for bias1, bias2, bias_gate in itertools.product((True, False), repeat=3):
            yield FFNConfig(D_MODEL, D_FF, activation, gated=True, bias1=bias1, bias2=bias2, bias_gate=bias_gate)


VARIANTS = list(_variants())


def _params(model: nn.Module) -> dict[str, np.ndarray]:
    return {key: value.detach().double().numpy() for key, value in model.state_dict().items()}


@pytest.mark.parametrize("shape", [(7, D_MODEL), (3, 5, D_MODEL)], ids=["2d", "3d"])
@pytest.mark.parametrize(
    "config",
    VARIANTS,
    ids=lambda c: f"{c.variant}-b{int(c.bias1)}{int(c.bias2)}{int(c.bias_gate) if c.gated else ''}",
)
def test_forward_matches_the_formula(config, shape, np_ffn, close):
    torch.manual_seed(0)
    model = build_ffn(config)
    # Scale the inputs so pre-activations reach well into every activation's nonlinear range.
    x = torch.randn(shape) * 3.0
    with torch.inference_mode():
        y = model(x)
    assert y.shape == shape and y.dtype == torch.float32
    close(y.numpy(), np_ffn(x.double().numpy(), _params(model), config.activation))


@pytest.mark.parametrize("config", VARIANTS, ids=lambda c: c.variant)
def test_parameter_names_and_shapes_are_the_seeds(config):
    expected = {"layer1.weight": (D_FF, D_MODEL), "layer2.weight": (D_MODEL, D_FF)}
    if config.bias1:
        expected["layer1.bias"] = (D_FF,)
    if config.bias2:
        expected["layer2.bias"] = (D_MODEL,)
    if config.gated:
        expected["linear_v.weight"] = (D_FF, D_MODEL)
        if config.bias_gate:
            expected["linear_v.bias"] = (D_FF,)
    assert {k: tuple(v.shape) for k, v in build_ffn(config).state_dict().items()} == expected


def test_fixed_weights_give_obvious_outputs():
    # layer1 = I, layer2 = 2*I, b2 = 1: y = 2 relu(x) + 1.
    model = build_ffn(FFNConfig(3, 3))
    with torch.no_grad():
        model.layer1.weight.copy_(torch.eye(3))
        model.layer1.bias.zero_()
        model.layer2.weight.copy_(2 * torch.eye(3))
        model.layer2.bias.fill_(1.0)
    y = model(torch.tensor([[-1.0, 0.5, 2.0]]))
    assert y.tolist() == [[1.0, 2.0, 5.0]]


def test_rows_are_independent_of_their_batch():
    torch.manual_seed(1)
    model = demo_ffn()
    x = torch.randn(33, DEMO_CONFIG.d_model)
    with torch.inference_mode():
        batch = model(x)
        alone = torch.cat([model(x[i : i + 1]) for i in range(len(x))])
        pair = torch.cat([model(x[i : i + 2]) for i in range(0, 32, 2)])
    torch.testing.assert_close(alone, batch, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pair, batch[:32], rtol=1e-6, atol=1e-6)


def test_hidden_is_the_pre_projection_layer():
    model = build_ffn(FFNConfig(D_MODEL, D_FF, "silu", gated=True))
    x = torch.randn(2, 3, D_MODEL)
    h = model.hidden(x)
    assert h.shape == (2, 3, D_FF)
    torch.testing.assert_close(model.layer2(h), model(x))


def test_no_dropout_in_the_serving_path():
    model = build_ffn(FFNConfig(D_MODEL, D_FF, "gelu", dropout=0.5))
    assert not any(isinstance(m, nn.Dropout) for m in model.modules())
    model.train()  # even in training mode the forward pass is deterministic
    x = torch.randn(4, D_MODEL)
    assert torch.equal(model(x), model(x))


def test_build_ffn_is_eval_and_gated_class():
    model = build_ffn(FFNConfig(D_MODEL, D_FF, gated=True))
    assert isinstance(model, GatedFeedForward) and not model.training
    assert not isinstance(build_ffn(FFNConfig(D_MODEL, D_FF)), GatedFeedForward)


def test_activations_are_not_shared_between_models():
    a, b = build_ffn(FFNConfig(4, 8, "gelu")), build_ffn(FFNConfig(4, 8, "gelu"))
    assert a.activation is not b.activation


def test_gelu_and_gelu_tanh_differ():
    torch.manual_seed(0)
    exact = build_ffn(FFNConfig(D_MODEL, D_FF, "gelu"))
    approx = build_ffn(FFNConfig(D_MODEL, D_FF, "gelu_tanh"))
    approx.load_state_dict(exact.state_dict())
    x = torch.randn(8, D_MODEL) * 3
    assert not torch.equal(exact(x), approx(x))


def test_demo_is_reproducible_and_seeded():
    a, b, c = demo_ffn(0), demo_ffn(0), demo_ffn(1)
    assert a.config == DEMO_CONFIG == FFNConfig(512, 2048, "relu")
    for key, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[key])
    assert not torch.equal(a.layer1.weight, c.layer1.weight)
