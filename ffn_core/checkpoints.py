"""Checkpoint families: one layer's FFN out of a BERT, GPT-2 or LLaMA checkpoint, in native names.

One small table per family says where a layer's FFN lives and how its modules map onto ours, as
`transformers` keeps one conversion per architecture. From a checkpoint only the chosen layer's
FFN tensors are read; its shapes are checked against the layout first, as stored.
"""

from __future__ import annotations

import re
from collections.abc import Set
from dataclasses import dataclass
from pathlib import Path

import torch

from ffn_core.layout import FileWeights, Shape, WeightsError, check_shapes, config_from_keys, expected_shapes
from ffn_core.readers import open_reader, sniff


@dataclass(frozen=True)
class Family:
    """Where one layer's FFN lives in a checkpoint family, in our names."""

    layers: str  # key prefix of layer i, with "{i}"
    linears: dict[str, str]  # our linear -> the checkpoint's module under `layers`
    activation: str
    gated: bool
    prefixes: tuple[str, ...] = ("",)  # leading names the model classes with heads add
    transposed: bool = False  # GPT-2's Conv1D stores its weight as [in, out]

    def native_shape(self, shape: Shape) -> Shape:
        """A stored shape in our [out, in] orientation (and back: a transpose is its own inverse)."""
        return shape[::-1] if self.transposed and len(shape) == 2 else shape

    def native_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """A stored tensor in our [out, in] orientation (a view; the copy comes when it is placed)."""
        return tensor.t() if self.transposed and tensor.ndim == 2 else tensor


FAMILIES: dict[str, Family] = {
    "bert": Family(
        layers="encoder.layer.{i}.",
        linears={"layer1": "intermediate.dense", "layer2": "output.dense"},
        activation="gelu",
        gated=False,
        prefixes=("", "bert."),
    ),
    "gpt2": Family(
        layers="h.{i}.",
        linears={"layer1": "mlp.c_fc", "layer2": "mlp.c_proj"},
        activation="gelu_tanh",
        gated=False,
        prefixes=("", "transformer."),
        transposed=True,
    ),
    "llama": Family(
        layers="layers.{i}.",
        # SwiGLU: silu(x gate_proj) * (x up_proj), then down_proj.
        linears={"layer1": "mlp.gate_proj", "linear_v": "mlp.up_proj", "layer2": "mlp.down_proj"},
        activation="silu",
        gated=True,
        prefixes=("model.", ""),
    ),
}


def read_layer(path: Path, format: str, layer: int | None, activation: str | None, gated: bool | None) -> FileWeights:
    """Layer `layer`'s FFN from a checkpoint of family `format`, renamed (and transposed) to ours."""
    family = FAMILIES[format]
    if layer is None:
        raise WeightsError(f"{path}: format {format!r} needs a layer index")
    if gated is not None and gated != family.gated:
        raise WeightsError(
            f"{path}: {format} FFNs are {'' if family.gated else 'not '}gated, but gated={gated} was asked"
        )
    reader = open_reader(path, sniff(path) or ("safetensors" if path.suffix == ".safetensors" else "torch"))
    prefix, layers = _find_layers(reader.keys, family)
    if not layers:
        example = family.prefixes[0] + family.layers.format(i=0) + next(iter(family.linears.values()))
        raise WeightsError(f"{path}: no {format} layers found (no key like {example + '.weight'!r})")
    if layer not in layers:
        raise WeightsError(
            f"{path}: no layer {layer}; the file has {len(layers)} layers ({min(layers)}..{max(layers)})"
        )
    # Our key -> the checkpoint's key, for this layer.
    names = {
        f"{ours}.{kind}": f"{prefix}{family.layers.format(i=layer)}{theirs}.{kind}"
        for ours, theirs in family.linears.items()
        for kind in ("weight", "bias")
    }
    first = names["layer1.weight"]
    if first not in reader.keys:
        raise WeightsError(f"{path}: missing key {first!r} for layer {layer}")
    shape = family.native_shape(reader.shape(first))
    if len(shape) != 2:
        raise WeightsError(f"{path}: key {first!r} has shape {list(shape)}, expected 2 dimensions")
    d_ff, d_model = shape
    config = config_from_keys(
        path,
        d_model=d_model,
        d_ff=d_ff,
        activation=activation or family.activation,
        gated=family.gated,
        present={ours for ours, theirs in names.items() if theirs in reader.keys},
    )
    native = expected_shapes(config)
    # Checked as stored, so a message names the key and the shape that are in the file.
    expected = {names[key]: family.native_shape(shape) for key, shape in native.items()}
    stored = {key: reader.shape(key) for key in expected if key in reader.keys}
    check_shapes(path, stored, expected, f"(d_model {d_model}, d_ff {d_ff} from {first})")
    tensors = {key: family.native_tensor(reader.get(names[key])) for key in native}
    return FileWeights(config, tensors, {key: names[key] for key in native})


def _find_layers(keys: Set[str], family: Family) -> tuple[str, set[int]]:
    """The prefix this file uses, and the layer indices found under it."""
    head, tail = family.layers.split("{i}")
    for prefix in family.prefixes:
        pattern = re.compile(re.escape(prefix + head) + r"(\d+)" + re.escape(tail))
        layers = {int(m.group(1)) for key in keys if (m := pattern.match(key))}
        if layers:
            return prefix, layers
    return "", set()
