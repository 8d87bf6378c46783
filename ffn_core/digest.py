"""The identity of a set of weights: one digest of the tensors and of the table that says how they compute.

    digest = "sha256:" + sha256(header, then for each tensor in name order: its record, then the
             sha256 of each CHUNK_BYTES piece of its bytes)

The header is canonical JSON (sorted keys, no spaces) of {"format", "chunk_bytes", "table"}, and a
tensor's record that of {"name", "dtype", "shape"}, each followed by a newline; a tensor's bytes
are its memory as held (row-major, little-endian), cut into pieces of CHUNK_BYTES, the last one
shorter. Equal digests: the same table and the same bytes under the same names, dtypes and shapes.

The pieces are hashed in parallel threads (hashlib lets go of the GIL for them), on views of the
tensors' own memory: no second copy of the weights is made, and a large model's digest takes its
bytes / (sha256's speed × the cores). Any program that follows the lines above gets the same value.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

DIGEST_FORMAT = "ffn-weights-digest/1"
CHUNK_BYTES = 16 * 2**20
MAX_THREADS = 8


def weights_digest(tensors: Mapping[str, torch.Tensor], table: Mapping[str, Any]) -> str:
    """'sha256:<64 hex digits>' of `table` (plain JSON values) and `tensors` (on the CPU)."""
    names = sorted(tensors)
    pieces = [_pieces(name, tensors[name]) for name in names]
    threads = min(MAX_THREADS, len(os.sched_getaffinity(0)), max(1, sum(len(p) for p in pieces)))
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ffn-digest") as pool:
        hashed = [list(pool.map(_sha256, found)) for found in pieces]
    outer = hashlib.sha256(_record({"format": DIGEST_FORMAT, "chunk_bytes": CHUNK_BYTES, "table": dict(table)}))
    for name, digests in zip(names, hashed, strict=True):
        tensor = tensors[name]
        outer.update(
            _record({"name": name, "dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape)})
        )
        for digest in digests:
            outer.update(digest)
    return "sha256:" + outer.hexdigest()


def short(digest: str) -> str:
    """The digest as logs show it: its first 12 hex digits (the full value is in every API)."""
    return digest.removeprefix("sha256:")[:12]


def _pieces(name: str, tensor: torch.Tensor) -> list[np.ndarray]:
    """The tensor's bytes as views of its memory, CHUNK_BYTES at a time."""
    if tensor.device.type != "cpu":
        raise ValueError(f"{name}: a digest is taken of host tensors, this one is on {tensor.device}")
    data = tensor.detach()
    if not data.is_contiguous():  # never for weights as loaded; a copy of this one tensor if it were
        data = data.contiguous()
    raw = data.reshape(-1).view(torch.uint8).numpy()
    return [raw[start : start + CHUNK_BYTES] for start in range(0, raw.size, CHUNK_BYTES)]


def _sha256(piece: np.ndarray) -> bytes:
    return hashlib.sha256(piece.data).digest()


def _record(value: Mapping[str, Any]) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode() + b"\n"
