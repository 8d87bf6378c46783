"""Checkpoint families: one layer's FFN out of a BERT, GPT-2 or LLaMA checkpoint, in native names.

The families' table, and the rules on layers, are in ffn_core/families.py (no torch: the command
checks a table and a file's header before it imports torch). From a checkpoint only the chosen
layer's FFN tensors are read; its shapes are checked against the layout first, as stored.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ffn_core.families import FAMILIES, Family, find_layers, layer_problem, table_problem
from ffn_core.layout import FileWeights, WeightsError, check_shapes, config_from_keys, expected_shapes
from ffn_core.readers import open_reader, sniff


def read_layer(path: Path, format: str, layer: int | None, activation: str | None, gated: bool | None) -> FileWeights:
    """Layer `layer`'s FFN from a checkpoint of family `format`, renamed (and transposed) to ours."""
    family = FAMILIES[format]
    refused = table_problem(format, layer, gated)
    if refused is not None or layer is None:
        raise WeightsError(f"{path}: {refused}")
    reader = open_reader(path, sniff(path) or ("safetensors" if path.suffix == ".safetensors" else "torch"))
    prefix, layers = find_layers(reader.keys, family)
    if (missing := layer_problem(format, layer, layers)) is not None:
        raise WeightsError(f"{path}: {missing}")
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
    tensors = {key: _native_tensor(family, reader.get(names[key])) for key in native}
    return FileWeights(config, tensors, {key: names[key] for key in native})


def _native_tensor(family: Family, tensor: torch.Tensor) -> torch.Tensor:
    """A stored tensor in our [out, in] orientation (a view; the copy comes when it is placed)."""
    return tensor.t() if family.transposed and tensor.ndim == 2 else tensor
