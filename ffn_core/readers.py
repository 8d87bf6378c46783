"""Weight files as keys, shapes and tensors: one reader per kind of file.

Only a regular file is ever opened. `os.stat` looks first, because opening a FIFO for reading
blocks until a writer comes and a device such as /dev/zero never ends: either would hang the
start instead of failing it. PyTorch files are only read with `torch.load(weights_only=True)`, so
a pickle that would run code is refused, never run.
"""

from __future__ import annotations

import os
import pickle
import stat
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from ffn_core.files import file_kind
from ffn_core.header import looks_like_safetensors
from ffn_core.layout import Shape, WeightsError, brief


class Reader(Protocol):
    """What loading needs of a weight file: its keys, its metadata, and each tensor on demand."""

    path: Path
    keys: frozenset[str]
    metadata: dict[str, str]

    def shape(self, key: str) -> Shape:
        """A tensor's shape, without reading its data where the format allows."""
        ...

    def get(self, key: str) -> torch.Tensor:
        """A tensor of floating-point weights, as stored."""
        ...


class SafetensorsReader:
    """A safetensors file: the header is read at once, a tensor's data only when asked for."""

    def __init__(self, path: Path) -> None:
        regular_file_size(path)
        self.path = path
        try:
            self._file = safe_open(str(path), framework="pt")
            self.keys = frozenset(self._file.keys())
            self.metadata: dict[str, str] = self._file.metadata() or {}
        except Exception as exc:  # safetensors raises its own error types, and OSError
            raise WeightsError(f"{path}: not a readable safetensors file, truncated or corrupt ({brief(exc)})") from exc

    def shape(self, key: str) -> Shape:
        """A tensor's shape from the header alone."""
        return tuple(self._file.get_slice(key).get_shape())

    def get(self, key: str) -> torch.Tensor:
        """A tensor of floating-point weights, as stored."""
        try:
            tensor = self._file.get_tensor(key)
        except Exception as exc:
            raise WeightsError(f"{self.path}: cannot read tensor {key!r} ({brief(exc)})") from exc
        return _floating(self.path, key, tensor)


class TorchStateDictReader:
    """A PyTorch state dict file, loaded whole, memory-mapped where it is a zip archive."""

    def __init__(self, path: Path) -> None:
        regular_file_size(path)
        self.path = path
        self._state = _torch_load(path)
        self.keys = frozenset(self._state)
        self.metadata: dict[str, str] = {}  # torch.save has no place for any

    def shape(self, key: str) -> Shape:
        """A tensor's shape."""
        return tuple(self._state[key].shape)

    def get(self, key: str) -> torch.Tensor:
        """A tensor of floating-point weights, as stored."""
        return _floating(self.path, key, self._state[key])


READERS: dict[str, Callable[[Path], Reader]] = {
    "safetensors": SafetensorsReader,
    "torch": TorchStateDictReader,
}


def open_reader(path: Path, kind: str) -> Reader:
    """The reader of `kind` ('safetensors' or 'torch') over the file at `path`."""
    return READERS[kind](path)


def regular_file_size(path: Path) -> int:
    """The size of the regular file at `path`; anything else is refused before it is opened.

    os.stat follows links, so a symlink to a regular file (as Kubernetes mounts them) is fine.
    """
    try:
        info = os.stat(path)
    except OSError as exc:
        raise WeightsError(f"{path}: cannot read weights file ({brief(exc)})") from exc
    if not stat.S_ISREG(info.st_mode):
        raise WeightsError(
            f"{path}: is {file_kind(info.st_mode)}, not a regular file; weights must be in a regular file"
        )
    return info.st_size


def sniff(path: Path) -> str | None:
    """'safetensors', 'torch' or None (neither), from the first bytes of the file.

    A safetensors file opens with its header's length and then the JSON header; torch.save
    writes a zip archive, or in its legacy form a pickle (protocol 2+ opens with 0x80).
    """
    size = regular_file_size(path)
    try:
        with path.open("rb") as f:
            head = f.read(9)
    except OSError as exc:
        raise WeightsError(f"{path}: cannot read weights file ({brief(exc)})") from exc
    if looks_like_safetensors(head, size):
        return "safetensors"
    if head[:4] == b"PK\x03\x04" or head[:1] == b"\x80":
        return "torch"
    return None


def _floating(path: Path, key: str, tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_floating_point():
        raise WeightsError(f"{path}: key {key!r} holds {tensor.dtype}, not floating-point weights")
    return tensor


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
        raise WeightsError(f"{path}: not a readable PyTorch file, truncated or corrupt ({brief(exc)})") from exc
    if not isinstance(state, dict):
        raise WeightsError(f"{path}: holds a {type(state).__name__}, not a state dict")
    for key, value in state.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise WeightsError(
                f"{path}: entry {key!r} is a {type(value).__name__}, not a tensor; expected a state dict"
            )
    return state


def _unpickling_reason(exc: pickle.UnpicklingError) -> str:
    """What weights_only refused, without torch's advice to load the file unsafely instead."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    reasons = [
        line.split("WeightsUnpickler error:")[-1].strip()
        for line in lines[1:]
        if not line.startswith("Check the documentation")
    ]
    return " ".join(r for r in reasons if r) or "UnpicklingError"
