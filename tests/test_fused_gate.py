"""The fused gate: one GEMM over W1‖V, equal to the unfused GatedFeedForward, with the seeds' state-dict names."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from app.config.settings import ModelSpec
from app.engine.registry import load_weights
from ffn_core import FFNConfig, FusedGatedFeedForward, GatedFeedForward, build_ffn, fuse_gate, load_ffn, save_ffn
from tests.reference import numpy_weights

D_MODEL, D_FF = 24, 56

GATED = [
    FFNConfig(D_MODEL, D_FF, activation, gated=True, bias1=bias1, bias2=bias2, bias_gate=bias_gate)
    for activation in ("relu", "gelu", "gelu_tanh", "silu", "identity")
    for bias1, bias2, bias_gate in itertools.product((True, False), repeat=3)
]


def gated(config: FFNConfig, seed: int = 0) -> GatedFeedForward:
    torch.manual_seed(seed)
    model = build_ffn(config).requires_grad_(False)
    assert isinstance(model, GatedFeedForward)
    return model


class CountLinear(TorchFunctionMode):
    """Counts F.linear calls (one per GEMM of an nn.Linear or of the fused projection)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear:
            self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("config", GATED, ids=lambda c: f"{c.variant}-b{int(c.bias1)}{int(c.bias2)}{int(c.bias_gate)}")
def test_fused_equals_unfused_and_the_formula(config, np_ffn, close):
    model = gated(config)
    fused = fuse_gate(model)
    x = torch.randn(9, D_MODEL) * 3.0
    with torch.inference_mode():
        ours, theirs = fused(x), model(x)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    close(ours.numpy(), np_ffn(x.double().numpy(), numpy_weights(model), config.activation))


def test_gated_projections_are_one_gemm():
    model = gated(GATED[0])
    fused = fuse_gate(model)
    x = torch.randn(4, D_MODEL)
    with torch.inference_mode(), CountLinear() as fused_count:
        fused(x)
    with torch.inference_mode(), CountLinear() as unfused_count:
        model(x)
    assert (fused_count.calls, unfused_count.calls) == (2, 3)  # W1‖V then W2, against W1, V, W2


def test_state_dict_keeps_the_seeds_names_and_values():
    model = gated(FFNConfig(D_MODEL, D_FF, "silu", gated=True, bias1=True, bias_gate=False))
    fused = fuse_gate(model)
    ours, theirs = fused.state_dict(), model.state_dict()
    assert list(ours) == list(theirs)
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key


def test_halves_are_views_of_the_fused_weight_no_second_copy():
    fused = fuse_gate(gated(GATED[0]))
    assert fused.layer1.weight.data_ptr() == fused._w1v.data_ptr()
    assert fused.linear_v.weight.data_ptr() == fused._w1v.data_ptr() + D_FF * D_MODEL * 4


def test_a_seeds_state_dict_loads_into_a_fused_module(np_ffn, close):
    config = FFNConfig(D_MODEL, D_FF, "gelu", gated=True)
    source = gated(config, seed=3)
    fused = FusedGatedFeedForward(config).requires_grad_(False)
    fused.load_state_dict(source.state_dict())  # in place: the loaded halves must reach the fused weight
    x = torch.randn(5, D_MODEL)
    with torch.inference_mode():
        close(fused(x).numpy(), np_ffn(x.double().numpy(), numpy_weights(source), "gelu"))


def test_saved_fused_model_loads_as_a_plain_gated_one(tmp_path):
    model = gated(FFNConfig(D_MODEL, D_FF, "silu", gated=True, bias1=False, bias2=True, bias_gate=True))
    save_ffn(fuse_gate(model), tmp_path / "fused.safetensors")
    loaded = load_ffn(tmp_path / "fused.safetensors")
    assert type(loaded) is GatedFeedForward
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


@pytest.mark.parametrize(("dtype", "rtol"), [(torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
def test_converting_the_dtype_fuses_again(dtype, rtol, np_ffn, close):
    model = gated(FFNConfig(D_MODEL, D_FF, "relu", gated=True))
    fused = fuse_gate(model).to(dtype)
    assert fused._w1v.dtype == dtype and fused.layer1.weight.data_ptr() == fused._w1v.data_ptr()
    x = torch.randn(6, D_MODEL)
    with torch.inference_mode():
        y = fused(x.to(dtype)).double().numpy()
    close(y, np_ffn(x.double().numpy(), numpy_weights(model), "relu"), rtol=rtol)


def test_fuse_gate_keeps_requires_grad_and_mode():
    model = gated(GATED[0])
    fused = fuse_gate(model.eval())
    assert not fused.training
    assert not any(p.requires_grad for p in fused.parameters())


@pytest.mark.parametrize("fuse", [True, False])
def test_the_fuse_gate_setting_decides_the_served_module(tmp_path, fuse):
    save_ffn(gated(GATED[0]), tmp_path / "g.safetensors")
    model, _ = load_weights(ModelSpec(name="g", weights=tmp_path / "g.safetensors"), torch.device("cpu"), fuse=fuse)
    assert isinstance(model, FusedGatedFeedForward) is fuse
