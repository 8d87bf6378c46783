"""The checkpoint families' table, and what a file's keys say about its layers: no torch here.

One small table per family says where a layer's FFN lives and how its modules map onto ours, as
`transformers` keeps one conversion per architecture (ffn_core/checkpoints.py reads the tensors).
The table and the layer rules are apart from the reading so that the command can hold a
`[[models]]` table and a safetensors file's header to them before it imports torch (seconds), and
say "no layer 9" in a moment instead of after the import (app/process/preflight.py).
"""

from __future__ import annotations

import re
from collections.abc import Set
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """Where one layer's FFN lives in a checkpoint family, in our names."""

    layers: str  # key prefix of layer i, with "{i}"
    linears: dict[str, str]  # our linear -> the checkpoint's module under `layers`
    activation: str
    gated: bool
    prefixes: tuple[str, ...] = ("",)  # leading names the model classes with heads add
    transposed: bool = False  # GPT-2's Conv1D stores its weight as [in, out]

    def native_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """A stored shape in our [out, in] orientation (and back: a transpose is its own inverse)."""
        return shape[::-1] if self.transposed and len(shape) == 2 else shape


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


def find_layers(keys: Set[str], family: Family) -> tuple[str, set[int]]:
    """The prefix this file uses, and the layer indices found under it."""
    head, tail = family.layers.split("{i}")
    for prefix in family.prefixes:
        pattern = re.compile(re.escape(prefix + head) + r"(\d+)" + re.escape(tail))
        layers = {int(m.group(1)) for key in keys if (m := pattern.match(key))}
        if layers:
            return prefix, layers
    return "", set()


def layer_problem(format: str, layer: int, layers: Set[int]) -> str | None:
    """Why a file whose `format` layers are `layers` has no layer `layer` to read, or None."""
    if not layers:
        family = FAMILIES[format]
        example = family.prefixes[0] + family.layers.format(i=0) + next(iter(family.linears.values()))
        return f"no {format} layers found (no key like {example + '.weight'!r})"
    if layer not in layers:
        return f"no layer {layer}; the file has {len(layers)} layers ({min(layers)}..{max(layers)})"
    return None


def table_problem(format: str | None, layer: int | None, gated: bool | None) -> str | None:
    """Why a `format` with `layer` and `gated` can never be read, whatever the file, or None.

    `format` None is native. The loaders raise the same (ffn_core/weights.py, checkpoints.py); the
    settings say it at once.
    """
    family = FAMILIES.get(format or "native")
    if family is None:
        if layer is not None:
            return f"layer is only for checkpoint families {list(FAMILIES)}, not {format or 'native'!r}"
        return None
    if layer is None:
        return f"format {format!r} needs a layer index"
    if gated is not None and gated != family.gated:
        return f"{format} FFNs are {'' if family.gated else 'not '}gated, but gated={gated} was asked"
    return None
