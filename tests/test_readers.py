"""The file readers: keys, shapes and tensors as written, and nothing but a regular file opened."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file as save_numpy

from ffn_core import FORMATS, FFNConfig, WeightsError, build_ffn, load_ffn, save_ffn
from ffn_core.checkpoints import FAMILIES
from ffn_core.readers import open_reader, sniff
from tests.weight_files import D_FF, D_MODEL, write


def _state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "a.weight": rng.normal(size=(3, 4)).astype(np.float32),
        "b.bias": rng.normal(size=5).astype(np.float16),
        "c": rng.normal(size=(2, 1, 3)).astype(np.float64),
    }


@pytest.mark.parametrize(("suffix", "kind"), [(".safetensors", "safetensors"), (".pt", "torch")])
def test_a_reader_gives_back_what_was_written(tmp_path, suffix, kind):
    state = _state()
    path = write(state, tmp_path / f"w{suffix}")
    assert sniff(path) == kind
    reader = open_reader(path, kind)
    assert reader.path == path and reader.keys == set(state) and reader.metadata == {}
    for key, value in state.items():
        assert reader.shape(key) == value.shape
        tensor = reader.get(key)
        assert tensor.numpy().dtype == value.dtype
        np.testing.assert_array_equal(tensor.numpy(), value)


def test_safetensors_metadata_is_read(tmp_path):
    path = tmp_path / "w.safetensors"
    save_numpy(_state(), str(path), metadata={"format": "x", "note": "kept as written"})
    assert open_reader(path, "safetensors").metadata == {"format": "x", "note": "kept as written"}


def test_neither_kind_is_sniffed_as_none(tmp_path):
    path = tmp_path / "w.bin"
    path.write_bytes(b"plain text, no weights")
    assert sniff(path) is None


# --- only regular files ---------------------------------------------------------------------------


def _load_in_a_thread(path: Path, format: str) -> BaseException | None:
    """What load_ffn raised, run in a daemon thread.

    Opening a FIFO for reading blocks until a writer comes and a device may never end, so a loader
    that opens them hangs. The join's limit only turns such a hang into a failure instead of a
    stuck suite; a working loader refuses the path at once.
    """
    outcome: list[BaseException | None] = []

    def load() -> None:
        try:
            load_ffn(path, format=format, layer=0 if format in FAMILIES else None)
        except BaseException as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(timeout=30)
    if thread.is_alive():
        # Left blocked: woken, it would go on to open the path again, perhaps holding the GIL.
        pytest.fail(f"load_ffn({path}, format={format!r}) opened it and blocked")
    return outcome[0]


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("kind", ["directory", "fifo", "device"])
def test_only_a_regular_file_is_opened(tmp_path, format, kind):
    if kind == "directory":
        path, what = tmp_path, "a directory"
    elif kind == "fifo":
        path, what = tmp_path / "weights.safetensors", "a FIFO (named pipe)"
        os.mkfifo(path)
    else:
        path, what = Path("/dev/null"), "a character device"
    error = _load_in_a_thread(path, format)
    assert isinstance(error, WeightsError), error
    assert str(error).startswith(f"{path}: is {what}, not a regular file")


def test_a_link_to_a_regular_file_is_fine(tmp_path):
    # Kubernetes mounts a config map or secret as links to the real files.
    config = FFNConfig(D_MODEL, D_FF)
    save_ffn(build_ffn(config), tmp_path / "real.safetensors")
    (tmp_path / "link.safetensors").symlink_to(tmp_path / "real.safetensors")
    assert load_ffn(tmp_path / "link.safetensors").config == config
