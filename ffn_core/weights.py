"""Load and save FFN weights: native safetensors, PyTorch state dicts, and one layer of a checkpoint.

Loading is strict, as nanoGPT's `from_pretrained` asserts, made real errors: a key that is not
expected, a missing key or a wrong shape raises `WeightsError` naming the file, the key and both
shapes. Weights that are NaN or ±inf, in the file or after the conversion to the asked dtype,
are refused too. The files themselves are read by `readers`, the checkpoint families (BERT,
GPT-2, LLaMA) by `checkpoints`; this module picks between them, checks native files, and builds
the module.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from ffn_core.checkpoints import read_layer
from ffn_core.config import FFNConfig
from ffn_core.dtypes import dtype_named
from ffn_core.families import FAMILIES, table_problem
from ffn_core.files import file_kind
from ffn_core.layout import (
    FileWeights,
    Shape,
    WeightsError,
    brief,
    check_shapes,
    config_from_keys,
    expected_shapes,
)
from ffn_core.model import FeedForward, build_ffn
from ffn_core.readers import open_reader, sniff
from ffn_core.torch_dtypes import TORCH

__all__ = ["CONFIG_KEY", "FORMATS", "FORMAT_TAG", "WeightsError", "expected_shapes", "load_ffn", "save_ffn"]

FORMATS = ("native", "torch", *FAMILIES)

# The mode of a written weights file, less the umask, as any new file: readable by others, because
# weights are mounted into containers whose user is not the file's owner.
SAVED_FILE_MODE = 0o644

# Safetensors metadata entries that make a native file describe itself.
FORMAT_TAG = "ffn-serve"
CONFIG_KEY = "ffn_config"

# What json.loads returns, in JSON's words, for a message about a value that is not an object.
_JSON_TYPES = {
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "true or false",
    type(None): "null",
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
        weights = read_layer(path, format, layer, activation, gated)
    else:
        if (refused := table_problem(format, layer, gated)) is not None:
            raise WeightsError(f"{path}: {refused}")
        weights = _read_state_dict(path, format, activation, gated)
    return _build(path, weights, torch_dtype, device)


def save_ffn(model: FeedForward, path: str | Path) -> None:
    """Write `model` as native safetensors, its whole FFNConfig in the metadata.

    The file gets mode 0644 less the umask, as an ordinary new file. A target that cannot be
    written raises OSError, its `strerror` saying why: no such folder, a directory or a device
    where the file would go (only a regular file is replaced), no permission.
    """
    path = Path(path)
    _check_target(path)
    state = {key: t.detach().to("cpu").contiguous() for key, t in model.state_dict().items()}
    metadata = {"format": FORMAT_TAG, CONFIG_KEY: json.dumps(model.config.to_dict())}
    # Written beside the target and renamed, so a crash never leaves a half-written weight file.
    partial = path.with_name(path.name + ".partial")
    partial.unlink(missing_ok=True)  # left by a crash
    # Created here as any new file, so that the kernel applies the umask to the mode, and a folder
    # that cannot be written fails with its own reason. safetensors then writes a private (0600)
    # temporary file and renames it over this one: the mode is put back before the final rename.
    os.close(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, SAVED_FILE_MODE))
    mode = stat.S_IMODE(partial.stat().st_mode)
    try:
        save_file(state, str(partial), metadata=metadata)
        os.chmod(partial, mode)
        os.replace(partial, path)
    except SafetensorError as exc:  # its I/O errors (a full disk) are not OSErrors
        raise OSError(errno.EIO, f"safetensors could not write it ({exc})", str(path)) from exc
    finally:
        partial.unlink(missing_ok=True)  # gone after the rename; after a failure, no leftover


def _check_target(path: Path) -> None:
    """Refuse a path save_ffn cannot write, before any work: a missing folder, or no regular file there."""
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        if path.parent.exists() and not path.parent.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, f"{path.parent} is not a folder", str(path)) from None
        if not path.parent.exists():
            raise FileNotFoundError(errno.ENOENT, f"the folder {path.parent} does not exist", str(path)) from None
        return
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, "it is a directory; name the file to write", str(path))
    if not stat.S_ISREG(mode):
        raise FileExistsError(errno.EEXIST, f"it is {file_kind(mode)}; only a regular file is replaced", str(path))


def _read_state_dict(path: Path, format: str, activation: str | None, gated: bool | None) -> FileWeights:
    """A native safetensors file or a PyTorch state dict, with our parameter names."""
    kind = sniff(path)
    if format == "native" and kind == "torch":
        raise WeightsError(f"{path}: this looks like a PyTorch file, not safetensors; load it with format 'torch'")
    if format == "torch" and kind == "safetensors":
        raise WeightsError(f"{path}: this is a safetensors file, not a PyTorch one; load it with format 'native'")
    reader = open_reader(path, "safetensors" if format == "native" else "torch")
    file_config = _config_from_metadata(path, reader.metadata)
    shapes = {key: reader.shape(key) for key in reader.keys}
    if file_config is None:
        config, why = _infer_config(path, shapes, activation, gated)
    else:
        for name, asked in (("activation", activation), ("gated", gated)):
            stored = getattr(file_config, name)
            if asked is not None and asked != stored:
                raise WeightsError(f"{path}: the file says {name}={stored!r}, but {name}={asked!r} was asked")
        config, why = file_config, "from the file's ffn_config"
    expected = expected_shapes(config)
    unexpected = sorted(reader.keys - set(expected))
    if unexpected:
        raise WeightsError(
            f"{path}: unexpected key{'s' if len(unexpected) > 1 else ''} {', '.join(map(repr, unexpected))}; "
            f"an FFN of this config has only {sorted(expected)}"
        )
    check_shapes(path, shapes, expected, why)
    return FileWeights(config, {key: reader.get(key) for key in expected}, {key: key for key in expected})


def _config_from_metadata(path: Path, metadata: dict[str, str]) -> FFNConfig | None:
    """The FFNConfig a native file stores as JSON in its metadata; None where it stores none.

    The metadata is the file's to choose: anything but a JSON object of FFNConfig fields is a
    WeightsError, including JSON nested too deep to parse and values too long to quote whole.
    """
    if CONFIG_KEY not in metadata:
        return None
    invalid = f"{path}: invalid {CONFIG_KEY} in the file's metadata"
    try:
        values = json.loads(metadata[CONFIG_KEY])
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError; "[[[[..." recurses
        raise WeightsError(f"{invalid}: cannot be parsed as JSON ({brief(exc)})") from exc
    if not isinstance(values, dict):
        raise WeightsError(f"{invalid}: {_JSON_TYPES[type(values)]}, not a JSON object of FFNConfig fields")
    try:
        return FFNConfig.from_dict(values)
    except (ValueError, TypeError) as exc:  # unknown or missing fields, values of the wrong type
        raise WeightsError(f"{invalid} ({brief(exc)})") from exc


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
    # relu when nothing says otherwise: the seeds' default.
    config = config_from_keys(
        path, d_model=d_model, d_ff=d_ff, activation=activation or "relu", gated=has_gate, present=shapes
    )
    return config, f"(d_model {d_model}, d_ff {d_ff} from {key})"


def _build(path: Path, weights: FileWeights, dtype: torch.dtype, device: str | torch.device) -> FeedForward:
    try:
        device = torch.device(device)
        # Fresh contiguous copies: the module never shares memory with a (memory-mapped) file.
        state = {
            key: t.to(device=device, dtype=dtype, copy=True, memory_format=torch.contiguous_format)
            for key, t in weights.tensors.items()
        }
    except (RuntimeError, AssertionError) as exc:  # unknown device, or CUDA not available
        raise WeightsError(f"{path}: cannot place weights on device {device!r} ({brief(exc)})") from exc
    for key, tensor in state.items():
        _check_finite(path, weights.stored_keys[key], weights.tensors[key], tensor)
    with torch.device("meta"):  # no random init: every parameter comes from the file
        model = build_ffn(weights.config)
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
    return model.eval()


def _check_finite(path: Path, key: str, stored: torch.Tensor, loaded: torch.Tensor) -> None:
    """Refuse NaN and ±inf: one of them silently turns every output row it touches into NaN.

    They come from the file, or from the conversion: float32's 1e5 is inf in float16. Only the
    loaded tensor is scanned where all is well; the stored one only to tell the two apart.
    """
    bad = _count_non_finite(loaded)
    if not bad:
        return
    in_file = _count_non_finite(stored)
    if in_file:
        raise WeightsError(
            f"{path}: key {key!r} holds {in_file} non-finite value{'s' if in_file > 1 else ''} "
            f"(NaN or ±inf) among {stored.numel()}"
        )
    source, target = (str(t.dtype).removeprefix("torch.") for t in (stored, loaded))
    raise WeightsError(
        f"{path}: key {key!r}: converting {source} to {target} overflowed: {bad} value{'s' if bad > 1 else ''} "
        f"beyond {target}'s range (±{torch.finfo(loaded.dtype).max:.5g}) became ±inf; load it as a wider dtype"
    )


def _count_non_finite(tensor: torch.Tensor) -> int:
    return tensor.numel() - int(torch.isfinite(tensor).sum())


def _parse_dtype(dtype: torch.dtype | str, path: Path) -> torch.dtype:
    try:
        return TORCH[dtype_named(dtype if isinstance(dtype, str) else str(dtype)).name]
    except ValueError as exc:
        raise WeightsError(f"{path}: {exc}") from None
