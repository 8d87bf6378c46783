"""load_ffn / save_ffn: every format checked against numpy on the raw tensors, and strictness."""

from __future__ import annotations

import json
import os
import pickle
import stat
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import save_file
from torch import nn

from ffn_core import ACTIVATIONS, FORMATS, FFNConfig, WeightsError, build_ffn, load_ffn, save_ffn
from tests.weight_files import D_FF, D_MODEL, inputs, run, write


def _model(config: FFNConfig, seed: int = 0):
    torch.manual_seed(seed)
    return build_ffn(config)


def _native_numpy(model) -> dict[str, np.ndarray]:
    return {k: v.double().numpy() for k, v in model.state_dict().items()}


# --- native safetensors -------------------------------------------------------------------------

VARIANTS = [
    FFNConfig(D_MODEL, D_FF),
    FFNConfig(D_MODEL, D_FF, "gelu", bias1=False),
    FFNConfig(D_MODEL, D_FF, "gelu_tanh", bias2=False),
    FFNConfig(D_MODEL, D_FF, "silu", gated=True, bias1=False, bias2=False, bias_gate=False),
    FFNConfig(D_MODEL, D_FF, "gelu", gated=True, bias_gate=False, dropout=0.2),
    FFNConfig(D_MODEL, D_FF, "identity", gated=True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("config", VARIANTS, ids=lambda c: c.variant)
def test_round_trip(tmp_path, config, dtype):
    model = _model(config).to(dtype)
    path = tmp_path / "ffn.safetensors"
    save_ffn(model, path)
    loaded = load_ffn(path, dtype=dtype)
    assert loaded.config == config
    assert not loaded.training
    for key, value in model.state_dict().items():
        param = loaded.state_dict()[key]
        assert param.dtype == dtype and torch.equal(param, value), key
    assert all(not p.requires_grad for p in loaded.parameters())
    x = inputs()
    np.testing.assert_array_equal(run(loaded, x), run(model, x))


def test_saved_file_describes_itself(tmp_path):
    config = FFNConfig(D_MODEL, D_FF, "silu", gated=True, bias_gate=False)
    path = tmp_path / "ffn.safetensors"
    save_ffn(_model(config), path)
    with safe_open(str(path), framework="np") as f:
        metadata = f.metadata()
        assert set(f.keys()) == {"layer1.weight", "layer1.bias", "layer2.weight", "layer2.bias", "linear_v.weight"}
        assert f.get_tensor("layer1.weight").shape == (D_FF, D_MODEL)
        assert f.get_tensor("layer2.weight").shape == (D_MODEL, D_FF)
    assert metadata["format"] == "ffn-serve"
    assert json.loads(metadata["ffn_config"]) == config.to_dict()
    assert not list(tmp_path.glob("*.partial"))
    # Nothing to say at load time: the file knows it is a SwiGLU.
    assert load_ffn(path).config == config


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o002, 0o644), (0o000, 0o644), (0o077, 0o600)])
def test_saved_file_mode_is_0644_less_the_umask(tmp_path, umask, mode):
    """As any new file: readable by a container's user under the usual umask (safetensors alone writes 0600)."""
    path = tmp_path / "ffn.safetensors"
    path.write_bytes(b"an older file, replaced")
    os.chmod(path, 0o600)
    previous = os.umask(umask)
    try:
        save_ffn(_model(FFNConfig(D_MODEL, D_FF)), path)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == mode
    assert load_ffn(path).config == FFNConfig(D_MODEL, D_FF)


@pytest.mark.parametrize(
    ("target", "error", "reason"),
    [
        ("no-folder/ffn.safetensors", FileNotFoundError, "the folder {tmp}/no-folder does not exist"),
        ("a-file/ffn.safetensors", NotADirectoryError, "{tmp}/a-file is not a folder"),
        ("a-folder", IsADirectoryError, "it is a directory; name the file to write"),
        ("a-fifo", FileExistsError, "it is a FIFO (named pipe); only a regular file is replaced"),
    ],
)
def test_saving_where_no_file_can_go_is_an_os_error_naming_why(tmp_path, target, error, reason):
    (tmp_path / "a-file").write_bytes(b"")
    (tmp_path / "a-folder").mkdir()
    os.mkfifo(tmp_path / "a-fifo")
    before = sorted(tmp_path.iterdir())
    with pytest.raises(error) as info:
        save_ffn(_model(FFNConfig(D_MODEL, D_FF)), tmp_path / target)
    assert info.value.strerror == reason.format(tmp=tmp_path)
    assert info.value.filename == str(tmp_path / target)
    assert sorted(tmp_path.iterdir()) == before  # nothing written, no .partial left
    assert stat.S_ISFIFO((tmp_path / "a-fifo").stat().st_mode)


def test_cast_to_other_dtype_and_string_dtypes(tmp_path, np_ffn, close):
    model = _model(FFNConfig(D_MODEL, D_FF, "gelu"))
    save_ffn(model, tmp_path / "f.safetensors")
    for dtype, expected in [("bfloat16", torch.bfloat16), ("float16", torch.float16), ("torch.float32", torch.float32)]:
        loaded = load_ffn(tmp_path / "f.safetensors", dtype=dtype, device=torch.device("cpu"))
        assert {p.dtype for p in loaded.parameters()} == {expected}
        assert {p.device.type for p in loaded.parameters()} == {"cpu"}
    x = inputs()
    close(run(loaded, x), np_ffn(x, _native_numpy(model), "gelu"))


def test_without_metadata_the_keys_say_what_they_can(tmp_path, np_ffn, close):
    rng = np.random.default_rng(0)
    params = {
        "layer1.weight": rng.normal(size=(D_FF, D_MODEL)).astype(np.float32),
        "layer2.weight": rng.normal(size=(D_MODEL, D_FF)).astype(np.float32),
        "layer2.bias": rng.normal(size=D_MODEL).astype(np.float32),
        "linear_v.weight": rng.normal(size=(D_FF, D_MODEL)).astype(np.float32),
        "linear_v.bias": rng.normal(size=D_FF).astype(np.float32),
    }
    path = tmp_path / "bare.safetensors"
    save_numpy(params, str(path))
    model = load_ffn(path, activation="silu")
    assert model.config == FFNConfig(D_MODEL, D_FF, "silu", gated=True, bias1=False, bias2=True, bias_gate=True)
    x = inputs()
    close(run(model, x), np_ffn(x, params, "silu"))
    assert load_ffn(path, gated=True).config.activation == "relu"  # the seeds' default
    with pytest.raises(WeightsError, match="gated=False was asked, but the file has gate weights"):
        load_ffn(path, gated=False)


def test_arguments_that_contradict_the_file(tmp_path):
    path = tmp_path / "f.safetensors"
    save_ffn(_model(FFNConfig(D_MODEL, D_FF, "gelu")), path)
    assert load_ffn(path, activation="gelu", gated=False).config.activation == "gelu"
    with pytest.raises(WeightsError, match=r"says activation='gelu', but activation='relu' was asked"):
        load_ffn(path, activation="relu")
    with pytest.raises(WeightsError, match=r"says gated=False, but gated=True was asked"):
        load_ffn(path, gated=True)


# --- strictness ------------------------------------------------------------------------------------


def _saved(
    tmp_path: Path, edit: Callable[[dict[str, torch.Tensor]], object] | None = None, config_json: str | None = None
) -> Path:
    """A native relu file, its state dict changed by `edit`, its ffn_config by default the true one."""
    model = _model(FFNConfig(D_MODEL, D_FF))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    if edit is not None:
        edit(state)
    path = tmp_path / "edited.safetensors"
    config_json = json.dumps(model.config.to_dict()) if config_json is None else config_json
    save_file(state, str(path), metadata={"format": "ffn-serve", "ffn_config": config_json})
    return path


def test_missing_key_names_it_and_its_shape(tmp_path):
    path = _saved(tmp_path, lambda s: s.pop("layer2.bias"))
    with pytest.raises(WeightsError) as info:
        load_ffn(path)
    assert str(path) in str(info.value) and "missing key 'layer2.bias'" in str(info.value)
    assert f"[{D_MODEL}]" in str(info.value)


def test_extra_key_is_named(tmp_path):
    path = _saved(tmp_path, lambda s: s.update({"layer3.weight": torch.zeros(2, 2)}))
    with pytest.raises(WeightsError, match=r"unexpected key 'layer3.weight'") as info:
        load_ffn(path)
    assert str(path) in str(info.value)


def test_wrong_shape_names_key_and_both_shapes(tmp_path):
    path = _saved(tmp_path, lambda s: s.update({"layer2.weight": torch.zeros(D_MODEL, D_FF + 1)}))
    with pytest.raises(WeightsError) as info:
        load_ffn(path)
    message = str(info.value)
    assert str(path) in message and "'layer2.weight'" in message
    assert f"[{D_MODEL}, {D_FF + 1}]" in message and f"[{D_MODEL}, {D_FF}]" in message


def test_weights_must_agree_without_metadata(tmp_path):
    path = tmp_path / "bare.safetensors"
    save_file({"layer1.weight": torch.zeros(D_FF, D_MODEL), "layer2.weight": torch.zeros(D_MODEL + 2, D_FF)}, str(path))
    with pytest.raises(
        WeightsError, match=rf"'layer2.weight' has shape \[{D_MODEL + 2}, {D_FF}\], expected \[{D_MODEL}, {D_FF}\]"
    ):
        load_ffn(path)
    save_file({"layer1.weight": torch.zeros(D_FF, D_MODEL)}, str(path))
    with pytest.raises(WeightsError, match=rf"missing key 'layer2.weight' \(expected shape \[{D_MODEL}, {D_FF}\]"):
        load_ffn(path)


def test_non_floating_tensors_are_refused(tmp_path):
    path = _saved(tmp_path, lambda s: s.update({"layer2.bias": torch.zeros(D_MODEL, dtype=torch.int64)}))
    with pytest.raises(WeightsError, match=r"'layer2.bias' holds torch.int64"):
        load_ffn(path)


@pytest.mark.parametrize("keep", [0.5, 0.99, 5], ids=["half", "all-but-the-end", "inside-the-header"])
def test_truncated_safetensors(tmp_path, keep):
    path = tmp_path / "f.safetensors"
    save_ffn(_model(FFNConfig(D_MODEL, D_FF)), path)
    data = path.read_bytes()
    path.write_bytes(data[: keep if isinstance(keep, int) else int(len(data) * keep)])
    with pytest.raises(WeightsError, match="truncated or corrupt") as info:
        load_ffn(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("content", [b"", b"not weights at all", b"\x00" * 64])
def test_garbage_files(tmp_path, content):
    path = tmp_path / "junk.safetensors"
    path.write_bytes(content)
    for format in ("native", "torch"):
        with pytest.raises(WeightsError, match=r"junk.safetensors"):
            load_ffn(path, format=format)


def test_missing_file(tmp_path):
    with pytest.raises(WeightsError, match=r"nope.safetensors"):
        load_ffn(tmp_path / "nope.safetensors")


def test_arguments_are_checked(tmp_path):
    path = tmp_path / "f.safetensors"
    save_ffn(_model(FFNConfig(D_MODEL, D_FF)), path)
    with pytest.raises(WeightsError, match="unknown format 'onnx'") as info:
        load_ffn(path, format="onnx")
    assert all(name in str(info.value) for name in FORMATS)
    with pytest.raises(WeightsError, match=r"unsupported dtype.*float32.*float16.*bfloat16"):
        load_ffn(path, dtype=torch.float64)
    with pytest.raises(WeightsError, match="layer is only for checkpoint families"):
        load_ffn(path, layer=0)
    with pytest.raises(WeightsError, match="cannot place weights on device"):
        load_ffn(path, device="no-such-device")
    bare = tmp_path / "bare.safetensors"
    save_file({"layer1.weight": torch.zeros(4, 2), "layer2.weight": torch.zeros(2, 4)}, str(bare))
    with pytest.raises(WeightsError, match=r"bare.safetensors: unknown activation 'swish'"):
        load_ffn(bare, activation="swish")
    with pytest.raises(WeightsError, match=r"bare.safetensors: activation 'identity' is only meaningful"):
        load_ffn(bare, activation="identity")


def test_formats_mixed_up_get_a_hint(tmp_path):
    model = _model(FFNConfig(D_MODEL, D_FF))
    torch.save(model.state_dict(), tmp_path / "f.pt")
    save_ffn(model, tmp_path / "f.safetensors")
    with pytest.raises(WeightsError, match="format 'torch'"):
        load_ffn(tmp_path / "f.pt")
    with pytest.raises(WeightsError, match="format 'native'"):
        load_ffn(tmp_path / "f.safetensors", format="torch")


# --- metadata: the file's to choose, so anything may be in it ----------------------------------------

DEEP = 100_000


@pytest.mark.parametrize(
    ("config_json", "reason"),
    [
        ("[" * DEEP + "]" * DEEP, "cannot be parsed as JSON (RecursionError"),
        ('{"a": ' * DEEP + "1" + "}" * DEEP, "cannot be parsed as JSON (RecursionError"),
        ("\x00\xff{garbage", "cannot be parsed as JSON"),
        ("9" * 5000, "cannot be parsed as JSON"),  # more digits than Python converts to an int
        ("null", "null, not a JSON object"),
        ("[8, 24]", "an array, not a JSON object"),
        ('"relu"', "a string, not a JSON object"),
        ("false", "true or false, not a JSON object"),
        ("1e400", "a number, not a JSON object"),
        ('{"d_model": 8}', "missing 1 required positional argument: 'd_ff'"),
        ('{"d_model": 8, "d_ff": 24, "activation": ["relu"]}', "unhashable type: 'list'"),
        ('{"d_model": 8, "d_ff": 24, "dropout": NaN}', "dropout must be in [0, 1)"),
        ('{"d_model": 8, "d_ff": 24, "is_gated": true}', "unknown FFN config keys: ['is_gated']"),
    ],
    ids=[
        "deep-array",
        "deep-object",
        "garbage",
        "long-int",
        "null",
        "array",
        "string",
        "bool",
        "number",
        "missing-field",
        "unhashable",
        "nan",
        "unknown-field",
    ],
)
def test_malformed_ffn_config_is_a_weights_error(tmp_path, config_json, reason):
    path = _saved(tmp_path, config_json=config_json)
    with pytest.raises(WeightsError) as info:
        load_ffn(path)
    assert str(info.value).startswith(f"{path}: invalid ffn_config in the file's metadata")
    assert reason in str(info.value)


def test_a_huge_value_is_not_quoted_whole(tmp_path):
    activation = "x" * 10_000_000
    path = _saved(tmp_path, config_json=json.dumps({"d_model": D_MODEL, "d_ff": D_FF, "activation": activation}))
    with pytest.raises(WeightsError, match="unknown activation 'xxxx") as info:
        load_ffn(path)
    assert len(str(info.value)) < 1000


def _json_values() -> st.SearchStrategy[object]:
    """Any JSON value, small."""
    scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
        max_leaves=8,
    )


# Every FFNConfig field, with values that fit the file's relu weights mixed among any JSON at all,
# so that some configs load and most fail somewhere in the checks.
_CONFIGS = st.fixed_dictionaries(
    {"d_model": st.just(D_MODEL) | _json_values(), "d_ff": st.just(D_FF) | _json_values()},
    optional={
        "activation": st.sampled_from(sorted(ACTIVATIONS)) | _json_values(),
        "gated": st.booleans() | _json_values(),
        "bias1": st.just(True) | _json_values(),
        "bias2": st.just(True) | _json_values(),
        "bias_gate": st.booleans() | _json_values(),
        "dropout": st.floats(0, 1) | _json_values(),
        "extra": _json_values(),
    },
)


# No deadline (nothing here is timed); derandomized so that CI runs the same examples every time.
@settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],  # one file, rewritten per example
)
@given(config_json=st.text() | _json_values().map(json.dumps) | _CONFIGS.map(json.dumps))
def test_any_ffn_config_loads_or_is_a_weights_error(tmp_path, config_json):
    path = _saved(tmp_path, config_json=config_json)
    try:
        model = load_ffn(path)
    except WeightsError as exc:
        assert str(exc).startswith(f"{path}: ")
    else:
        values = json.loads(config_json)
        assert (values["d_model"], values["d_ff"]) == (D_MODEL, D_FF) == (model.config.d_model, model.config.d_ff)


# --- PyTorch state dicts -----------------------------------------------------------------------------


class SeedFeedForward(nn.Module):
    """The seeds' FeedForward (labml / darts), as small as it gets: its state dict must load as is."""

    def __init__(
        self, d_model, d_ff, dropout=0.1, activation=None, is_gated=False, bias1=True, bias2=True, bias_gate=True
    ):
        super().__init__()
        self.layer1 = nn.Linear(d_model, d_ff, bias=bias1)
        self.layer2 = nn.Linear(d_ff, d_model, bias=bias2)
        self.dropout = nn.Dropout(dropout)
        self.activation = activation if activation is not None else nn.ReLU()
        self.is_gated = is_gated
        if is_gated:
            self.linear_v = nn.Linear(d_model, d_ff, bias=bias_gate)

    def forward(self, x):
        g = self.activation(self.layer1(x))
        x = g * self.linear_v(x) if self.is_gated else g
        return self.layer2(self.dropout(x))


@pytest.mark.parametrize(
    ("kwargs", "activation"),
    [
        ({}, None),
        ({"activation": nn.GELU(), "bias2": False}, "gelu"),
        ({"activation": nn.SiLU(), "is_gated": True, "bias_gate": False, "bias1": False}, "silu"),
    ],
    ids=["relu", "gelu-nobias2", "swiglu"],
)
def test_seed_state_dict_loads_unchanged(tmp_path, kwargs, activation, np_ffn, close):
    torch.manual_seed(0)
    seed = SeedFeedForward(D_MODEL, D_FF, **kwargs).eval()
    path = tmp_path / "seed.pt"
    torch.save(seed.state_dict(), path)
    model = load_ffn(path, format="torch", activation=activation)
    assert model.config.gated == kwargs.get("is_gated", False)
    assert model.config.bias1 == kwargs.get("bias1", True) and model.config.bias2 == kwargs.get("bias2", True)
    x = inputs()
    expected = np_ffn(x, {k: v.numpy() for k, v in seed.state_dict().items()}, activation or "relu")
    close(run(model, x), expected)
    with torch.inference_mode():
        close(seed(torch.from_numpy(x)).numpy(), expected)


def test_torch_state_dict_is_strict(tmp_path):
    state = SeedFeedForward(D_MODEL, D_FF).state_dict()
    path = tmp_path / "sd.pt"
    torch.save({**state, "extra.weight": torch.zeros(3)}, path)
    with pytest.raises(WeightsError, match=r"unexpected key 'extra.weight'"):
        load_ffn(path, format="torch")
    torch.save({**state, "layer1.bias": torch.zeros(D_FF + 1)}, path)
    with pytest.raises(WeightsError, match=rf"'layer1.bias' has shape \[{D_FF + 1}\], expected \[{D_FF}\]"):
        load_ffn(path, format="torch")
    torch.save(state, path)
    with pytest.raises(WeightsError, match="gated=True was asked, but the file has no gate weights"):
        load_ffn(path, format="torch", gated=True)
    torch.save([state["layer1.weight"]], path)
    with pytest.raises(WeightsError, match="holds a list, not a state dict"):
        load_ffn(path, format="torch")
    torch.save({**state, "layer2.bias": torch.zeros(D_MODEL, dtype=torch.int32)}, path)
    with pytest.raises(WeightsError, match="not floating-point"):
        load_ffn(path, format="torch")


def test_truncated_torch_file(tmp_path):
    path = tmp_path / "sd.pt"
    torch.save(SeedFeedForward(D_MODEL, D_FF).state_dict(), path)
    path.write_bytes(path.read_bytes()[:300])
    with pytest.raises(WeightsError, match=r"sd.pt: not a readable PyTorch file"):
        load_ffn(path, format="torch")


class _RunsCode:
    """Unpickling this would run a shell command creating the sentinel file."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self):
        return (os.system, (f"touch {self.sentinel}",))


@pytest.mark.parametrize("how", ["zip", "legacy", "plain-pickle"])
@pytest.mark.parametrize("format", ["torch", "gpt2"])
def test_a_pickle_that_runs_code_is_refused_not_run(tmp_path, how, format):
    sentinel = tmp_path / "SENTINEL"
    payload = {
        "layer1.weight": torch.zeros(D_FF, D_MODEL),
        "h.0.mlp.c_fc.weight": torch.zeros(2, 2),
        "x": _RunsCode(sentinel),
    }
    path = tmp_path / "evil.bin"
    if how == "plain-pickle":
        path.write_bytes(pickle.dumps(payload))
    else:
        torch.save(payload, path, _use_new_zipfile_serialization=how == "zip")
    with pytest.raises(WeightsError, match=r"evil.bin: refused") as info:
        load_ffn(path, format=format, layer=0 if format == "gpt2" else None)
    assert "weights_only=False" not in str(info.value)  # no advice to load it unsafely
    assert not sentinel.exists()


# --- non-finite weights ----------------------------------------------------------------------------


def _relu_state(dtype: type = np.float32) -> dict[str, np.ndarray]:
    """A relu FFN's native state dict as numpy arrays of `dtype`."""
    return {k: v.numpy().astype(dtype) for k, v in _model(FFNConfig(D_MODEL, D_FF)).state_dict().items()}


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize(("format", "suffix"), [("native", ".safetensors"), ("torch", ".pt")])
def test_non_finite_weights_are_refused(tmp_path, format, suffix, bad):
    state = _relu_state()
    state["layer2.weight"][1, 2] = state["layer2.weight"][3, 4] = bad
    path = write(state, tmp_path / f"f{suffix}")
    for dtype in ("float32", "float16", "bfloat16"):
        with pytest.raises(WeightsError) as info:
            load_ffn(path, format=format, dtype=dtype)
        assert str(info.value).startswith(
            f"{path}: key 'layer2.weight' holds 2 non-finite values (NaN or ±inf) among {D_MODEL * D_FF}"
        )


@pytest.mark.parametrize(
    ("stored", "value", "dtype", "limit"),
    [
        (np.float32, 1e5, "float16", "65504"),
        (np.float32, np.finfo(np.float32).max, "bfloat16", "3.3895e+38"),  # bfloat16 rounds it up to inf
        (np.float64, 1e300, "float32", "3.4028e+38"),
    ],
)
@pytest.mark.parametrize(("format", "suffix"), [("native", ".safetensors"), ("torch", ".pt")])
def test_a_conversion_that_overflows_is_refused(tmp_path, format, suffix, stored, value, dtype, limit):
    state = _relu_state(stored)
    state["layer1.bias"][0] = value
    path = write(state, tmp_path / f"f{suffix}")
    with pytest.raises(WeightsError) as info:
        load_ffn(path, format=format, dtype=dtype)
    source = np.dtype(stored).name
    assert str(info.value).startswith(
        f"{path}: key 'layer1.bias': converting {source} to {dtype} overflowed: 1 value beyond {dtype}'s range (±{limit})"
    )
    # The largest finite value of the dtype itself loads.
    state["layer1.bias"][0] = float(torch.finfo(getattr(torch, dtype)).max)
    write(state, path)
    assert load_ffn(path, format=format, dtype=dtype).layer1.bias[0].item() == torch.finfo(getattr(torch, dtype)).max
