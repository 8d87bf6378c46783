"""Checkpoint families: one layer's FFN out of a BERT, GPT-2 or LLaMA checkpoint, against numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors import safe_open

from ffn_core import FFNConfig, WeightsError, load_ffn
from tests.weight_files import D_FF, D_MODEL, inputs, run, write


def test_minilm_layers_match_numpy(minilm_path, np_ffn, close):
    x = inputs(6, 384)
    with safe_open(str(minilm_path), framework="np") as f:
        for layer in (0, 5):
            model = load_ffn(minilm_path, format="bert", layer=layer)
            assert model.config == FFNConfig(384, 1536, "gelu")
            raw = {
                "layer1.weight": f.get_tensor(f"encoder.layer.{layer}.intermediate.dense.weight"),
                "layer1.bias": f.get_tensor(f"encoder.layer.{layer}.intermediate.dense.bias"),
                "layer2.weight": f.get_tensor(f"encoder.layer.{layer}.output.dense.weight"),
                "layer2.bias": f.get_tensor(f"encoder.layer.{layer}.output.dense.bias"),
            }
            assert raw["layer1.weight"].shape == (1536, 384)
            close(run(model, x), np_ffn(x, raw, "gelu"))


def test_minilm_layer_out_of_range(minilm_path):
    for layer in (6, -1):
        with pytest.raises(WeightsError, match=rf"no layer {layer}; the file has 6 layers \(0\.\.5\)") as info:
            load_ffn(minilm_path, format="bert", layer=layer)
        assert str(minilm_path) in str(info.value)
    with pytest.raises(WeightsError, match="needs a layer index"):
        load_ffn(minilm_path, format="bert")
    with pytest.raises(WeightsError, match="no gpt2 layers found"):
        load_ffn(minilm_path, format="gpt2", layer=0)


def _gpt2_state(n_layers: int = 3, prefix: str = "") -> dict[str, np.ndarray]:
    """A small GPT-2 state dict in the real layout: Conv1D weights are [in, out]."""
    rng = np.random.default_rng(2)
    state = {f"{prefix}wte.weight": rng.normal(size=(50, D_MODEL)), f"{prefix}ln_f.weight": np.ones(D_MODEL)}
    for i in range(n_layers):
        h = f"{prefix}h.{i}."
        state |= {
            h + "ln_1.weight": np.ones(D_MODEL),
            h + "attn.c_attn.weight": rng.normal(size=(D_MODEL, 3 * D_MODEL)),
            h + "attn.c_attn.bias": rng.normal(size=3 * D_MODEL),
            h + "mlp.c_fc.weight": rng.normal(size=(D_MODEL, D_FF)),
            h + "mlp.c_fc.bias": rng.normal(size=D_FF),
            h + "mlp.c_proj.weight": rng.normal(size=(D_FF, D_MODEL)) / 4,
            h + "mlp.c_proj.bias": rng.normal(size=D_MODEL),
        }
    return {k: v.astype(np.float32) for k, v in state.items()}


@pytest.mark.parametrize("prefix", ["", "transformer."])
@pytest.mark.parametrize("suffix", [".safetensors", ".bin"])
def test_gpt2_layer_matches_numpy(tmp_path, prefix, suffix, close):
    state = _gpt2_state(prefix=prefix)
    path = write(state, tmp_path / f"gpt2{suffix}")
    x = inputs()
    for layer in range(3):
        model = load_ffn(path, format="gpt2", layer=layer)
        assert model.config == FFNConfig(D_MODEL, D_FF, "gelu_tanh")
        h = f"{prefix}h.{layer}.mlp."
        # Conv1D is x @ W + b with W [in, out]; gelu_tanh written out.
        z = x.astype(np.float64) @ state[h + "c_fc.weight"] + state[h + "c_fc.bias"]
        g = 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)))
        expected = g @ state[h + "c_proj.weight"] + state[h + "c_proj.bias"]
        close(run(model, x), expected)


def test_gpt2_wrong_shape_is_named_as_stored(tmp_path):
    state = _gpt2_state()
    state["h.1.mlp.c_proj.weight"] = np.zeros((D_FF, D_MODEL + 1), np.float32)
    path = write(state, tmp_path / "gpt2.safetensors")
    load_ffn(path, format="gpt2", layer=0)  # other layers are not read
    with pytest.raises(
        WeightsError,
        match=rf"'h.1.mlp.c_proj.weight' has shape \[{D_FF}, {D_MODEL + 1}\], expected \[{D_FF}, {D_MODEL}\]",
    ):
        load_ffn(path, format="gpt2", layer=1)
    del state["h.2.mlp.c_proj.bias"]
    path = write(state, tmp_path / "gpt2.safetensors")
    assert load_ffn(path, format="gpt2", layer=2).config.bias2 is False
    with pytest.raises(WeightsError, match="not gated"):
        load_ffn(path, format="gpt2", layer=0, gated=True)


def _bert_state() -> dict[str, np.ndarray]:
    """A small BertModel-with-head state dict: two layers under the "bert." prefix."""
    rng = np.random.default_rng(3)
    state = {"bert.embeddings.word_embeddings.weight": rng.normal(size=(10, D_MODEL)).astype(np.float32)}
    for i in range(2):
        base = f"bert.encoder.layer.{i}."
        state |= {
            base + "attention.self.query.weight": rng.normal(size=(D_MODEL, D_MODEL)).astype(np.float32),
            base + "intermediate.dense.weight": rng.normal(size=(D_FF, D_MODEL)).astype(np.float32),
            base + "intermediate.dense.bias": rng.normal(size=D_FF).astype(np.float32),
            base + "output.dense.weight": rng.normal(size=(D_MODEL, D_FF)).astype(np.float32),
            base + "output.dense.bias": rng.normal(size=D_MODEL).astype(np.float32),
        }
    return state


def test_bert_prefix_and_activation_override(tmp_path, np_ffn, close):
    state = _bert_state()
    path = write(state, tmp_path / "bert.bin")
    model = load_ffn(path, format="bert", layer=1, activation="gelu_tanh", dtype="bfloat16")
    assert model.config.activation == "gelu_tanh" and model.layer1.weight.dtype == torch.bfloat16
    raw = {
        "layer1.weight": state["bert.encoder.layer.1.intermediate.dense.weight"],
        "layer1.bias": state["bert.encoder.layer.1.intermediate.dense.bias"],
        "layer2.weight": state["bert.encoder.layer.1.output.dense.weight"],
        "layer2.bias": state["bert.encoder.layer.1.output.dense.bias"],
    }
    x = inputs()
    # bfloat16 keeps 8 bits of mantissa: a loose bound, but still a real check of the values.
    close(run(model, x), np_ffn(x.astype(np.float64), raw, "gelu_tanh"), rtol=3e-2)


def _llama_state(prefix: str = "model.") -> dict[str, np.ndarray]:
    """A small LLaMA state dict: two layers of SwiGLU FFNs without biases."""
    rng = np.random.default_rng(4)
    state = {f"{prefix}embed_tokens.weight": rng.normal(size=(20, D_MODEL)), f"{prefix}norm.weight": np.ones(D_MODEL)}
    for i in range(2):
        base = f"{prefix}layers.{i}."
        state |= {
            base + "self_attn.q_proj.weight": rng.normal(size=(D_MODEL, D_MODEL)),
            base + "input_layernorm.weight": np.ones(D_MODEL),
            base + "mlp.gate_proj.weight": rng.normal(size=(D_FF, D_MODEL)),
            base + "mlp.up_proj.weight": rng.normal(size=(D_FF, D_MODEL)),
            base + "mlp.down_proj.weight": rng.normal(size=(D_MODEL, D_FF)),
        }
    return {k: v.astype(np.float32) for k, v in state.items()}


@pytest.mark.parametrize("prefix", ["model.", ""])
def test_llama_layer_matches_numpy(tmp_path, prefix, close):
    state = _llama_state(prefix)
    path = write(state, tmp_path / "llama.safetensors")
    model = load_ffn(path, format="llama", layer=1)
    assert model.config == FFNConfig(D_MODEL, D_FF, "silu", gated=True, bias1=False, bias2=False, bias_gate=False)
    x = inputs().astype(np.float64)
    m = f"{prefix}layers.1.mlp."
    gate = x @ state[m + "gate_proj.weight"].T
    expected = (gate / (1 + np.exp(-gate)) * (x @ state[m + "up_proj.weight"].T)) @ state[m + "down_proj.weight"].T
    close(run(model, x.astype(np.float32)), expected)
    del state[m + "up_proj.weight"]
    path = write(state, tmp_path / "llama.safetensors")
    with pytest.raises(WeightsError, match=rf"missing key '{m}up_proj.weight' \(expected shape \[{D_FF}, {D_MODEL}\]"):
        load_ffn(path, format="llama", layer=1)


# --- non-finite weights, named as stored -----------------------------------------------------------

# A family's state dict, and one FFN key of its layer 1 as the checkpoint names it.
STATES = {
    "bert": (_bert_state, "bert.encoder.layer.1.output.dense.weight"),
    "gpt2": (_gpt2_state, "h.1.mlp.c_fc.weight"),
    "llama": (_llama_state, "model.layers.1.mlp.up_proj.weight"),
}


@pytest.mark.parametrize("suffix", [".safetensors", ".bin"])
@pytest.mark.parametrize("format", sorted(STATES))
def test_non_finite_weights_are_refused(tmp_path, format, suffix):
    make_state, key = STATES[format]
    state = make_state()
    state[key][0, 1], state[key][2, 3], state[key][4, 5] = np.nan, np.inf, -np.inf
    path = write(state, tmp_path / f"{format}{suffix}")
    load_ffn(path, format=format, layer=0)  # only the chosen layer is read
    with pytest.raises(WeightsError) as info:
        load_ffn(path, format=format, layer=1)
    assert str(info.value).startswith(
        f"{path}: key {key!r} holds 3 non-finite values (NaN or ±inf) among {D_MODEL * D_FF}"
    )


@pytest.mark.parametrize("format", sorted(STATES))
def test_a_conversion_that_overflows_is_refused(tmp_path, format):
    make_state, key = STATES[format]
    state = make_state()
    state[key][1, 1] = state[key][2, 2] = -1e5  # finite in float32, beyond float16's 65504
    path = write(state, tmp_path / f"{format}.safetensors")
    load_ffn(path, format=format, layer=1, dtype="float32")  # finite as stored
    with pytest.raises(WeightsError) as info:
        load_ffn(path, format=format, layer=1, dtype="float16")
    assert str(info.value).startswith(f"{path}: key {key!r}: converting float32 to float16 overflowed: 2 values")
