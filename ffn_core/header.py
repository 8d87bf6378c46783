"""A safetensors file's tensor names, from its header alone: no torch, no safetensors package.

The format opens with the header's length (8 bytes, little-endian) and the header, a JSON object
from each tensor's name to its dtype, shape and offsets (and `__metadata__`). Reading it takes a
moment, so the command can hold a `[[models]]` table to the file (does layer 9 exist?) before it
imports torch (app/process/preflight.py). Whatever this cannot read is left to the loader, which says
why in full: here a file either gives its names or gives None.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

# Largest header read here; the safetensors package refuses larger ones too (100 MB).
MAX_HEADER_BYTES = 100_000_000


def looks_like_safetensors(head: bytes, size: int) -> bool:
    """Whether a file of `size` bytes that opens with `head` (its first 9 bytes) is a safetensors file:
    a header length that fits the file, then the header's opening brace."""
    return len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") <= size - 8


def safetensors_keys(path: Path) -> frozenset[str] | None:
    """The tensor names in the safetensors file at `path`; None where it is not one that can be read
    (not a regular file, another format, a header past MAX_HEADER_BYTES or not a JSON object)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None  # never opened: a FIFO would block (ffn_core/readers.py says what it is)
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(9)
            length = int.from_bytes(head[:8], "little")
            if not looks_like_safetensors(head, size) or length > MAX_HEADER_BYTES:
                return None
            header = json.loads(head[8:] + f.read(length - 1))
    except (OSError, ValueError):  # ValueError: not UTF-8, not JSON
        return None
    if not isinstance(header, dict):
        return None
    return frozenset(key for key in header if key != "__metadata__")
