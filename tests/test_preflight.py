"""Every model setting that can be checked without torch is checked before torch is imported (issue 41).

A bert table without a layer, a layer past the checkpoint's last, a GPU asked of a torch built
without CUDA: each was found 10-120 s into a start, after torch was imported and the models
began to load, and said in a log record. Each is now one `ffn-serve: ...` line and exit 2 in a
fraction of a second, from the real command, which then says whether it imported torch. The
words are the loader's own, so a table refused here would be refused there the same way.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from app.config.settings import load_settings
from app.config.settings_problems import SettingsError
from app.process.preflight import missing_gpus, missing_layers, torch_build
from ffn_core import WeightsError, load_ffn
from ffn_core.header import safetensors_keys

ROOT = Path(__file__).resolve().parents[1]
# main() in a real process, which then says whether torch was imported.
MAIN_THEN_SAY = (
    "import sys; from app.cli import main; code = main(sys.argv[1:]); "
    "print('torch imported' if 'torch' in sys.modules else 'no torch'); sys.exit(code)"
)
CPU_BUILD = torch.version.cuda is None and getattr(torch.version, "hip", None) is None


def refused_before_torch(*args: str) -> str:
    """ffn-serve with `args`: it must exit 2 with one line on stderr, never having imported torch; that line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FFN_")}
    result = subprocess.run(
        [sys.executable, "-c", MAIN_THEN_SAY, *args], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stdout == "no torch\n", result.stderr[-3000:]
    (line,) = result.stderr.splitlines()
    return line


def config(folder: Path, table: str) -> Path:
    path = folder / "ffn.toml"
    path.write_text(f'[[models]]\nname = "m"\n{table}\n')
    return path


def test_a_checkpoint_table_without_a_layer_is_refused_before_torch(tmp_path: Path, minilm_path: Path) -> None:
    path = config(tmp_path, f'weights = "{minilm_path}"\nformat = "bert"')
    line = refused_before_torch("--config", str(path), "--port", "0", "--grpc-port", "0")
    assert line.startswith(
        f"ffn-serve: invalid setting models[0] (config file {path}): format 'bert' needs a layer index: "
        "add layer = N to its table, 0 for the first"
    ), line


@pytest.mark.parametrize(
    ("table", "says"),
    [
        ('format = "bert"\nlayer = 6', "no layer 6; the file has 6 layers (0..5)"),
        ('format = "gpt2"\nlayer = 0', "no gpt2 layers found (no key like 'h.0.mlp.c_fc.weight')"),
    ],
    ids=["a layer past the last", "another family's file"],
)
def test_a_layer_the_checkpoint_lacks_is_refused_before_torch_in_the_loaders_words(
    tmp_path: Path, minilm_path: Path, table: str, says: str
) -> None:
    weights = minilm_path.resolve()
    path = config(tmp_path, f'weights = "{weights}"\n{table}')
    line = refused_before_torch("--config", str(path), "--port", "0", "--grpc-port", "0")
    assert line == f"ffn-serve: model 'm': {weights}: {says}"
    # --check refuses it the same way, before torch too.
    assert refused_before_torch("--config", str(path), "--check") == f"ffn-serve --check: model 'm': {weights}: {says}"
    # The loader, once torch is there, says the same words: one rule.
    format, layer = (value.split(" = ")[1].strip('"') for value in table.splitlines())
    with pytest.raises(WeightsError) as loaded:
        load_ffn(weights, format=format, layer=int(layer))
    assert str(loaded.value) == f"{weights}: {says}"


@pytest.mark.skipif(not CPU_BUILD, reason="this torch is built with CUDA: only torch can tell whether a GPU is there")
def test_a_gpu_asked_of_a_torch_built_without_cuda_is_refused_before_torch(tmp_path: Path) -> None:
    version = importlib.metadata.version("torch")
    fix = 'choose device "cpu" (or "auto": a GPU when there is one), or install a build of torch with CUDA'
    path = config(tmp_path, 'device = "cuda"')
    line = refused_before_torch("--config", str(path), "--port", "0", "--grpc-port", "0")
    assert line == f"ffn-serve: model 'm': device 'cuda' needs CUDA, and torch {version} is built without it: {fix}"
    line = refused_before_torch("--shared-engine", "--devices", "cuda:1", "--port", "0", "--grpc-port", "0")
    assert (
        line
        == f"ffn-serve: setting devices: device 'cuda:1' needs CUDA, and torch {version} is built without it: {fix}"
    )


def test_auto_and_cpu_are_never_refused_and_devices_override_the_tables() -> None:
    settings = load_settings(models=[{"name": "a", "device": "auto"}, {"name": "c", "device": "cpu"}])
    assert missing_gpus(settings) == []
    on_cpu = load_settings(models=[{"name": "g", "device": "cuda"}], shared_engine=True, devices=["cpu"])
    assert missing_gpus(on_cpu) == []  # each engine places every model on its own device


def test_the_torch_build_is_read_as_torch_itself_says() -> None:
    build = torch_build()
    assert build is not None
    assert build.version == importlib.metadata.version("torch")
    assert build.gpu == (not CPU_BUILD)


@pytest.mark.parametrize(
    ("table", "says"),
    [
        ({"weights": "w.safetensors", "layer": 2}, "layer is only for checkpoint families ['bert', 'gpt2', 'llama'], not 'native'"),
        ({"weights": "w.pt", "format": "torch", "layer": 0}, "layer is only for checkpoint families"),
        ({"weights": "w.safetensors", "format": "llama"}, "format 'llama' needs a layer index: add layer = N"),
        ({"weights": "w.safetensors", "format": "bert", "layer": 0, "gated": True}, "bert FFNs are not gated, but gated=True was asked"),
        ({"weights": "w.safetensors", "format": "llama", "layer": 0, "gated": False}, "llama FFNs are gated, but gated=False was asked"),
    ],
)  # fmt: skip
def test_a_table_no_file_could_satisfy_is_a_settings_error(table: dict[str, object], says: str) -> None:
    with pytest.raises(SettingsError) as refused:
        load_settings(models=[{"name": "m", **table}])
    (problem,) = refused.value.problems
    assert problem.startswith("invalid setting models[0] (flag --models): "), problem
    assert says in problem, problem


def test_an_hf_model_without_a_format_needs_a_layer() -> None:
    pytest.importorskip("huggingface_hub")
    with pytest.raises(SettingsError, match="an hf_model is one layer of its checkpoint family: give layer"):
        load_settings(models=[{"name": "m", "hf_model": "org/name"}])
    assert load_settings(models=[{"name": "m", "hf_model": "org/name", "layer": 3}]).models[0].layer == 3
    assert load_settings(models=[{"name": "m", "hf_model": "org/name", "format": "native"}]).models[0].layer is None


def test_tables_that_load_today_still_pass() -> None:
    settings = load_settings(
        models=[
            {"name": "b", "weights": "b.safetensors", "format": "bert", "layer": 0, "gated": False},
            {"name": "l", "weights": "l.safetensors", "format": "llama", "layer": 1, "gated": True},
            {"name": "n", "weights": "n.safetensors", "gated": True},
            {"name": "demo", "layer": 3},  # the demo reads no file: format and layer are not looked at
        ]
    )
    assert [m.name for m in settings.models] == ["b", "l", "n", "demo"]


def test_a_torch_state_dict_is_left_to_the_loader(tmp_path: Path) -> None:
    """Its keys need torch to be read: not refused here (nor read), refused by the loader in the same words."""
    weights = tmp_path / "bert.bin"
    torch.save({"encoder.layer.0.intermediate.dense.weight": torch.zeros(8, 4)}, weights)
    settings = load_settings(models=[{"name": "m", "weights": str(weights), "format": "bert", "layer": 5}])
    assert missing_layers(settings) == []
    with pytest.raises(WeightsError, match=r"no layer 5; the file has 1 layers \(0\.\.0\)"):
        load_ffn(weights, format="bert", layer=5)


def test_the_header_gives_the_names_or_none_and_never_opens_a_fifo(tmp_path: Path) -> None:
    good = tmp_path / "good.safetensors"
    save_file({"a.weight": torch.zeros(2, 2), "b": torch.ones(1)}, str(good), metadata={"k": "v"})
    assert safetensors_keys(good) == {"a.weight", "b"}
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    assert safetensors_keys(fifo) is None  # opened, it would wait for a writer
    (tmp_path / "text.safetensors").write_text("not a header")
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[:20])
    for path in (tmp_path / "text.safetensors", truncated, tmp_path / "missing.safetensors", tmp_path):
        assert safetensors_keys(path) is None, path
