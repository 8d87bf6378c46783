"""ffn-extract: one layer out of a checkpoint into a self-describing native file."""

from __future__ import annotations

import importlib.metadata
import os
import stat
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import save_file

from ffn_core import FFNConfig, load_ffn, save_ffn
from ffn_core.extract import main


def test_minilm_layer(minilm_path, tmp_path, capsys, np_ffn, close):
    out = tmp_path / "layer2.safetensors"
    assert main(["--format", "bert", "--layer", "2", str(minilm_path), str(out)]) == 0
    printed = capsys.readouterr().out
    assert str(out) in printed and "d_model 384" in printed and "d_ff 1536" in printed and "gelu" in printed
    model = load_ffn(out)  # nothing to say: the file describes itself
    assert model.config == FFNConfig(384, 1536, "gelu")
    with safe_open(str(minilm_path), framework="np") as f:
        raw = {
            "layer1.weight": f.get_tensor("encoder.layer.2.intermediate.dense.weight"),
            "layer1.bias": f.get_tensor("encoder.layer.2.intermediate.dense.bias"),
            "layer2.weight": f.get_tensor("encoder.layer.2.output.dense.weight"),
            "layer2.bias": f.get_tensor("encoder.layer.2.output.dense.bias"),
        }
    for key, value in raw.items():
        np.testing.assert_array_equal(model.state_dict()[key].numpy(), value)
    x = np.random.default_rng(0).normal(size=(4, 384)).astype(np.float32)
    with torch.inference_mode():
        close(model(torch.from_numpy(x)).numpy(), np_ffn(x, raw, "gelu"))


def _gpt2(path, d_model=6, d_ff=10, layers=2):
    rng = np.random.default_rng(0)
    state = {"wte.weight": rng.normal(size=(11, d_model)).astype(np.float32)}
    for i in range(layers):
        state |= {
            f"h.{i}.attn.c_attn.weight": rng.normal(size=(d_model, 3 * d_model)).astype(np.float32),
            f"h.{i}.mlp.c_fc.weight": rng.normal(size=(d_model, d_ff)).astype(np.float32),
            f"h.{i}.mlp.c_fc.bias": rng.normal(size=d_ff).astype(np.float32),
            f"h.{i}.mlp.c_proj.weight": rng.normal(size=(d_ff, d_model)).astype(np.float32),
            f"h.{i}.mlp.c_proj.bias": rng.normal(size=d_model).astype(np.float32),
        }
    save_file(state, str(path))
    return state


def test_gpt2_layer_transposed_and_cast(tmp_path, np_ffn, close):
    state = _gpt2(tmp_path / "gpt2.safetensors")
    out = tmp_path / "ffn.safetensors"
    assert (
        main(["--format", "gpt2", "--layer", "1", "--dtype", "bfloat16", str(tmp_path / "gpt2.safetensors"), str(out)])
        == 0
    )
    with safe_open(str(out), framework="pt") as f:
        assert f.get_tensor("layer1.weight").dtype == torch.bfloat16
        assert f.get_tensor("layer1.weight").shape == (10, 6)
    model = load_ffn(out)
    assert model.config == FFNConfig(6, 10, "gelu_tanh")
    for ours, theirs in [("layer1", "c_fc"), ("layer2", "c_proj")]:
        expected = torch.from_numpy(state[f"h.1.mlp.{theirs}.weight"].T.copy()).to(torch.bfloat16)
        assert torch.equal(model.state_dict()[f"{ours}.weight"], expected)
    raw = {
        "layer1.weight": state["h.1.mlp.c_fc.weight"].T,
        "layer1.bias": state["h.1.mlp.c_fc.bias"],
        "layer2.weight": state["h.1.mlp.c_proj.weight"].T,
        "layer2.bias": state["h.1.mlp.c_proj.bias"],
    }
    float_model = load_ffn(out, dtype="float32")
    x = np.random.default_rng(1).normal(size=(3, 6)).astype(np.float32)
    with torch.inference_mode():
        # bfloat16 weights: loose bound.
        close(float_model(torch.from_numpy(x)).numpy(), np_ffn(x, raw, "gelu_tanh"), rtol=3e-2)


def test_activation_override(tmp_path):
    _gpt2(tmp_path / "gpt2.safetensors")
    out = tmp_path / "ffn.safetensors"
    assert (
        main(["--format", "gpt2", "--layer", "0", "--activation", "gelu", str(tmp_path / "gpt2.safetensors"), str(out)])
        == 0
    )
    assert load_ffn(out).config.activation == "gelu"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--format", "gpt2", "--layer", "7"], "no layer 7; the file has 2 layers"),
        (["--format", "gpt2"], "needs a layer index"),
        (["--format", "bert", "--layer", "0"], "no bert layers found"),
    ],
)
def test_weights_errors_exit_2_with_one_line(tmp_path, capsys, args, message):
    _gpt2(tmp_path / "gpt2.safetensors")
    out = tmp_path / "ffn.safetensors"
    assert main([*args, str(tmp_path / "gpt2.safetensors"), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "gpt2.safetensors" in err
    assert not out.exists()


def test_refuses_to_overwrite_its_input(tmp_path, capsys):
    _gpt2(tmp_path / "gpt2.safetensors")
    path = str(tmp_path / "gpt2.safetensors")
    assert main(["--format", "gpt2", "--layer", "0", path, path]) == 2
    assert "overwrite" in capsys.readouterr().err
    assert load_ffn(path, format="gpt2", layer=1).config.d_model == 6  # still the checkpoint


def test_bad_arguments_are_argparse_errors(tmp_path):
    with pytest.raises(SystemExit) as info:
        main(["--format", "onnx", "--layer", "0", "a", "b"])
    assert info.value.code == 2


def _native_file(tmp_path):
    source = tmp_path / "in.safetensors"
    save_file({"layer1.weight": np.ones((4, 2), np.float32), "layer2.weight": np.ones((2, 4), np.float32)}, str(source))
    return source


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600)])
def test_output_mode_is_save_ffns_0644_less_the_umask(tmp_path, umask, mode):
    """The container runs as UID 10001, not the file's owner: under the usual umask it can read the file."""
    source, out = _native_file(tmp_path), tmp_path / "out.safetensors"
    previous = os.umask(umask)
    try:
        assert main(["--format", "native", str(source), str(out)]) == 0
        save_ffn(load_ffn(source), tmp_path / "saved.safetensors")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(out.stat().st_mode) == mode
    assert stat.S_IMODE((tmp_path / "saved.safetensors").stat().st_mode) == mode  # the same as save_ffn's
    assert not list(tmp_path.glob("*.partial"))


@pytest.mark.parametrize(
    ("output", "reason"),
    [
        ("no-such-folder/out.safetensors", "the folder {tmp}/no-such-folder does not exist"),
        ("in.safetensors/out.safetensors", "{tmp}/in.safetensors is not a folder"),
        (".", "it is a directory; name the file to write"),
        ("", "it is a directory; name the file to write"),
        ("fifo", "it is a FIFO (named pipe); only a regular file is replaced"),
        ("loop", "Too many levels of symbolic links"),
    ],
)
def test_an_output_that_cannot_be_written_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch, output, reason):
    source = _native_file(tmp_path)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "loop").symlink_to("loop")
    monkeypatch.chdir(tmp_path)
    before = sorted(tmp_path.iterdir())
    target = output if output in (".", "") else str(tmp_path / output)
    assert main(["--format", "native", str(source), target]) == 2
    err = capsys.readouterr().err
    shown = "." if output == "" else target  # argparse's Path("") is "."
    assert err == f"ffn-extract: error: cannot write {shown}: {reason.format(tmp=tmp_path)}\n"
    assert sorted(tmp_path.iterdir()) == before


def test_a_missing_folder_from_the_command_line_is_one_line_without_a_traceback(tmp_path):
    """The installed command, as a user runs it: one line on stderr, exit 2."""
    source = _native_file(tmp_path)
    command = [sys.executable, "-m", "ffn_core.extract", "--format", "native", str(source), "missing/out.safetensors"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    assert (
        result.stderr == "ffn-extract: error: cannot write missing/out.safetensors: the folder missing does not exist\n"
    )


def test_an_unreadable_input_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "loop").symlink_to("loop")
    assert main(["--format", "native", str(tmp_path / "loop"), str(tmp_path / "out.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ffn-extract: error: {tmp_path}/loop: cannot read weights file") and err.count("\n") == 1


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert (
        info.value.code == 0 and capsys.readouterr().out == f"ffn-extract {importlib.metadata.version('ffn-serve')}\n"
    )
