"""Load and save FFN weights: native safetensors, PyTorch state dicts, and one layer of a checkpoint.

Loading is strict, as nanoGPT's `from_pretrained` asserts, made real errors: a key that is not
expected, a missing key or a wrong shape raises `WeightsError` naming the file, the key and both
shapes. PyTorch files are only ever read with `torch.load(weights_only=True)`, so a pickle that
would run code is refused, never executed. Checkpoint families (BERT, GPT-2, LLaMA) map onto our
parameter names through one small table each, as `transformers` keeps one conversion per
architecture; from a checkpoint only the chosen layer's FFN tensors are read.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ffn_core.config import FFNConfig
from ffn_core.dtypes import dtype_named
from ffn_core.model import FeedForward, build_ffn

FORMATS = ("native", "torch", "bert", "gpt2", "llama")


# Safetensors metadata entries that make a native file describe itself.
FORMAT_TAG = "ffn-serve"
CONFIG_KEY = "ffn_config"

Shape = tuple[int, ...]


class WeightsError(ValueError):
    """A weight file that cannot be loaded as asked; the message names the file and the reason."""


@dataclass(frozen=True)
class _Family:
    """Where one layer's FFN lives in a checkpoint family, in our names."""

    layers: str  # key prefix of layer i, with "{i}"
    linears: dict[str, str]  # our linear -> the checkpoint's module under `layers`
    activation: str
    gated: bool
    prefixes: tuple[str, ...] = ("",)  # leading names the model classes with heads add
    transposed: bool = False  # GPT-2's Conv1D stores its weight as [in, out]


FAMILIES: dict[str, _Family] = {
    "bert": _Family(
        layers="encoder.layer.{i}.",
        linears={"layer1": "intermediate.dense", "layer2": "output.dense"},
        activation="gelu",
        gated=False,
        prefixes=("", "bert."),
    ),
    "gpt2": _Family(
        layers="h.{i}.",
        linears={"layer1": "mlp.c_fc", "layer2": "mlp.c_proj"},
        activation="gelu_tanh",
        gated=False,
        prefixes=("", "transformer."),
        transposed=True,
    ),
    "llama": _Family(
        layers="layers.{i}.",
        # SwiGLU: silu(x gate_proj) * (x up_proj), then down_proj.
        linears={"layer1": "mlp.gate_proj", "linear_v": "mlp.up_proj", "layer2": "mlp.down_proj"},
        activation="silu",
        gated=True,
        prefixes=("model.", ""),
    ),
}


def load_ffn(
    path: str | Path,
    *,
    format: str = "native",
    layer: int | None = None,
    activation: str | None = None,
    gated: bool | None = None,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
) -> FeedForward:
    """Load an FFN in eval mode, without gradients, on `device` in `dtype`.

    `activation` and `gated` fill in what the file does not say and must agree with what it
    does; `layer` picks the layer of a checkpoint family. Any problem raises `WeightsError`.
    """
    path = Path(path)
    if format not in FORMATS:
        raise WeightsError(f"{path}: unknown format {format!r}; choose one of {list(FORMATS)}")
    torch_dtype = _parse_dtype(dtype, path)
    if format in FAMILIES:
        config, state = _read_family(path, format, layer, activation, gated)
    else:
        if layer is not None:
            raise WeightsError(f"{path}: layer is only for checkpoint families {list(FAMILIES)}, not {format!r}")
        config, state = _read_state_dict(path, format, activation, gated)
    return _build(path, config, state, torch_dtype, device)


def save_ffn(model: FeedForward, path: str | Path) -> None:
    """Write `model` as native safetensors, its whole FFNConfig in the metadata."""
    path = Path(path)
    state = {key: t.detach().to("cpu").contiguous() for key, t in model.state_dict().items()}
    metadata = {"format": FORMAT_TAG, CONFIG_KEY: json.dumps(model.config.to_dict())}
    # Write beside the target and rename, so a crash never leaves a half-written weight file.
    partial = path.with_name(path.name + ".partial")
    save_file(state, str(partial), metadata=metadata)
    os.replace(partial, path)


def expected_shapes(config: FFNConfig) -> dict[str, Shape]:
    """The native state dict of an FFN of this config: key -> shape."""
    d_model, d_ff = config.d_model, config.d_ff
    shapes: dict[str, Shape] = {"layer1.weight": (d_ff, d_model), "layer2.weight": (d_model, d_ff)}
    if config.bias1:
        shapes["layer1.bias"] = (d_ff,)
    if config.bias2:
        shapes["layer2.bias"] = (d_model,)
    if config.gated:
        shapes["linear_v.weight"] = (d_ff, d_model)
        if config.bias_gate:
            shapes["linear_v.bias"] = (d_ff,)
    return shapes


class _Checkpoint:
    """The keys of a safetensors file or a PyTorch state dict file, and its tensors on demand."""

    def __init__(self, path: Path, kind: str) -> None:
        self.path = path
        self.kind = kind
        if kind == "safetensors":
            try:
                self._file = safe_open(str(path), framework="pt")
                self.keys = set(self._file.keys())
                self.metadata: dict[str, str] = self._file.metadata() or {}
            except Exception as exc:  # safetensors raises its own error types, and OSError
                raise WeightsError(f"{path}: not a readable safetensors file, truncated or corrupt ({_brief(exc)})") from exc
        else:
            self._state = _torch_load(path)
            self.keys = set(self._state)
            self.metadata = {}

    def get(self, key: str) -> torch.Tensor:
        if self.kind == "safetensors":
            try:
                tensor = self._file.get_tensor(key)
            except Exception as exc:
                raise WeightsError(f"{self.path}: cannot read tensor {key!r} ({_brief(exc)})") from exc
        else:
            tensor = self._state[key]
        if not tensor.is_floating_point():
            raise WeightsError(f"{self.path}: key {key!r} holds {tensor.dtype}, not floating-point weights")
        return tensor

    def shape(self, key: str) -> Shape:
        """A tensor's shape, without reading its data where the format allows."""
        if self.kind == "safetensors":
            return tuple(self._file.get_slice(key).get_shape())
        return tuple(self._state[key].shape)


def _sniff(path: Path) -> str | None:
    """'safetensors', 'torch' or None (neither), from the first bytes of the file.

    A safetensors file opens with its header's length and then the JSON header; torch.save
    writes a zip archive, or in its legacy form a pickle (protocol 2+ opens with 0x80).
    """
    try:
        with path.open("rb") as f:
            head = f.read(9)
        size = path.stat().st_size
    except OSError as exc:
        raise WeightsError(f"{path}: cannot read weights file ({_brief(exc)})") from exc
    if len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") <= size - 8:
        return "safetensors"
    if head[:4] == b"PK\x03\x04" or head[:1] == b"\x80":
        return "torch"
    return None


def _torch_load(path: Path) -> dict[str, torch.Tensor]:
    """A PyTorch state dict, read with weights_only=True: tensors and plain containers only."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            # mmap keeps a large checkpoint out of memory until the few tensors we need are copied.
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as exc:
        raise WeightsError(
            f"{path}: refused: not a plain PyTorch state dict of tensors; "
            f"torch.load(weights_only=True) rejected it: {_unpickling_reason(exc)}"
        ) from exc
    except Exception as exc:  # torch reports truncated or foreign files as RuntimeError, EOFError, ...
        raise WeightsError(f"{path}: not a readable PyTorch file, truncated or corrupt ({_brief(exc)})") from exc
    if not isinstance(state, dict):
        raise WeightsError(f"{path}: holds a {type(state).__name__}, not a state dict")
    for key, value in state.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise WeightsError(f"{path}: entry {key!r} is a {type(value).__name__}, not a tensor; expected a state dict")
    return state


def _read_state_dict(
    path: Path, format: str, activation: str | None, gated: bool | None
) -> tuple[FFNConfig, dict[str, torch.Tensor]]:
    """A native safetensors file or a PyTorch state dict, with our parameter names."""
    kind = _sniff(path)
    if format == "native" and kind == "torch":
        raise WeightsError(f"{path}: this looks like a PyTorch file, not safetensors; load it with format 'torch'")
    if format == "torch" and kind == "safetensors":
        raise WeightsError(f"{path}: this is a safetensors file, not a PyTorch one; load it with format 'native'")
    ckpt = _Checkpoint(path, "safetensors" if format == "native" else "torch")
    file_config = _config_from_metadata(path, ckpt.metadata)
    shapes = {key: ckpt.shape(key) for key in ckpt.keys}
    if file_config is None:
        config, why = _infer_config(path, shapes, activation, gated)
    else:
        for name, asked in (("activation", activation), ("gated", gated)):
            stored = getattr(file_config, name)
            if asked is not None and asked != stored:
                raise WeightsError(f"{path}: the file says {name}={stored!r}, but {name}={asked!r} was asked")
        config, why = file_config, "from the file's ffn_config"
    expected = expected_shapes(config)
    unexpected = sorted(ckpt.keys - set(expected))
    if unexpected:
        raise WeightsError(
            f"{path}: unexpected key{'s' if len(unexpected) > 1 else ''} {', '.join(map(repr, unexpected))}; "
            f"an FFN of this config has only {sorted(expected)}"
        )
    _check_shapes(path, shapes, expected, why)
    return config, {key: ckpt.get(key) for key in expected}


def _read_family(
    path: Path, format: str, layer: int | None, activation: str | None, gated: bool | None
) -> tuple[FFNConfig, dict[str, torch.Tensor]]:
    """One layer's FFN from a checkpoint of a family, renamed (and transposed) to our names."""
    family = FAMILIES[format]
    if layer is None:
        raise WeightsError(f"{path}: format {format!r} needs a layer index")
    if gated is not None and gated != family.gated:
        raise WeightsError(f"{path}: {format} FFNs are {'' if family.gated else 'not '}gated, but gated={gated} was asked")
    ckpt = _Checkpoint(path, _sniff(path) or ("safetensors" if path.suffix == ".safetensors" else "torch"))
    prefix, layers = _find_layers(ckpt.keys, family)
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

    def native_shape(shape: Shape) -> Shape:
        return shape[::-1] if family.transposed and len(shape) == 2 else shape

    first = names["layer1.weight"]
    if first not in ckpt.keys:
        raise WeightsError(f"{path}: missing key {first!r} for layer {layer}")
    shape = native_shape(ckpt.shape(first))
    if len(shape) != 2:
        raise WeightsError(f"{path}: key {first!r} has shape {list(shape)}, expected 2 dimensions")
    d_ff, d_model = shape
    try:
        config = FFNConfig(
            d_model=d_model,
            d_ff=d_ff,
            activation=activation or family.activation,
            gated=family.gated,
            bias1=names["layer1.bias"] in ckpt.keys,
            bias2=names["layer2.bias"] in ckpt.keys,
            bias_gate=names["linear_v.bias"] in ckpt.keys if family.gated else True,
        )
    except ValueError as exc:
        raise WeightsError(f"{path}: {exc}") from exc
    expected = {names[key]: native_shape(s) for key, s in expected_shapes(config).items()}
    shapes = {key: ckpt.shape(key) for key in expected if key in ckpt.keys}
    _check_shapes(path, shapes, expected, f"(d_model {d_model}, d_ff {d_ff} from {first})")
    state = {}
    for ours, theirs in names.items():
        if theirs in expected:
            tensor = ckpt.get(theirs)
            state[ours] = tensor.t() if family.transposed and tensor.ndim == 2 else tensor
    return config, state


def _find_layers(keys: set[str], family: _Family) -> tuple[str, set[int]]:
    """The prefix this file uses, and the layer indices found under it."""
    head, tail = family.layers.split("{i}")
    for prefix in family.prefixes:
        pattern = re.compile(re.escape(prefix + head) + r"(\d+)" + re.escape(tail))
        layers = {int(m.group(1)) for key in keys if (m := pattern.match(key))}
        if layers:
            return prefix, layers
    return "", set()


def _config_from_metadata(path: Path, metadata: dict[str, str]) -> FFNConfig | None:
    if CONFIG_KEY not in metadata:
        return None
    try:
        return FFNConfig.from_dict(json.loads(metadata[CONFIG_KEY]))
    except (ValueError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
        raise WeightsError(f"{path}: invalid {CONFIG_KEY} in the file's metadata ({exc})") from exc


def _infer_config(
    path: Path, shapes: dict[str, Shape], activation: str | None, gated: bool | None
) -> tuple[FFNConfig, str]:
    """Sizes, gate and bias flags from the keys and shapes of a file that does not describe itself."""
    has_gate = "linear_v.weight" in shapes
    if gated is not None and gated != has_gate:
        raise WeightsError(
            f"{path}: gated={gated} was asked, but the file {'has' if has_gate else 'has no'} gate weights (linear_v.weight)"
        )
    for key, flip in (("layer1.weight", False), ("layer2.weight", True)):
        if key in shapes:
            shape = shapes[key]
            if len(shape) != 2:
                raise WeightsError(f"{path}: key {key!r} has shape {list(shape)}, expected 2 dimensions")
            d_ff, d_model = shape[::-1] if flip else shape
            break
    else:
        raise WeightsError(f"{path}: missing key 'layer1.weight' (expected shape [d_ff, d_model])")
    try:
        config = FFNConfig(
            d_model=d_model,
            d_ff=d_ff,
            activation=activation or "relu",  # the seeds' default
            gated=has_gate,
            bias1="layer1.bias" in shapes,
            bias2="layer2.bias" in shapes,
            bias_gate="linear_v.bias" in shapes if has_gate else True,
        )
    except ValueError as exc:
        raise WeightsError(f"{path}: {exc}") from exc
    return config, f"(d_model {d_model}, d_ff {d_ff} from {key})"


def _check_shapes(path: Path, shapes: dict[str, Shape], expected: dict[str, Shape], why: str) -> None:
    for key, shape in expected.items():
        if key not in shapes:
            raise WeightsError(f"{path}: missing key {key!r} (expected shape {list(shape)} {why})")
        if shapes[key] != shape:
            raise WeightsError(
                f"{path}: key {key!r} has shape {list(shapes[key])}, expected {list(shape)} {why}"
            )


def _build(
    path: Path, config: FFNConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, device: str | torch.device
) -> FeedForward:
    try:
        device = torch.device(device)
        # Fresh contiguous copies: the module never shares memory with a (memory-mapped) file.
        state = {
            key: t.to(device=device, dtype=dtype, copy=True, memory_format=torch.contiguous_format)
            for key, t in state.items()
        }
    except (RuntimeError, AssertionError) as exc:  # unknown device, or CUDA not available
        raise WeightsError(f"{path}: cannot place weights on device {device!r} ({_brief(exc)})") from exc
    with torch.device("meta"):  # no random init: every parameter comes from the file
        model = build_ffn(config)
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
    return model.eval()


def _parse_dtype(dtype: torch.dtype | str, path: Path) -> torch.dtype:
    try:
        return dtype_named(dtype if isinstance(dtype, str) else str(dtype)).torch
    except ValueError as exc:
        raise WeightsError(f"{path}: {exc}") from None


def _unpickling_reason(exc: pickle.UnpicklingError) -> str:
    """What weights_only refused, without torch's advice to load the file unsafely instead."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    reasons = [
        line.split("WeightsUnpickler error:")[-1].strip()
        for line in lines[1:]
        if not line.startswith("Check the documentation")
    ]
    return " ".join(r for r in reasons if r) or "UnpicklingError"


def _brief(exc: BaseException) -> str:
    """The first line of an exception: torch's messages run to many lines of advice."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
