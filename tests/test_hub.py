"""Models straight from the Hugging Face Hub (`hf_model`), offline, from a cache laid out as huggingface_hub's.

This machine cannot reach the Hub. The cache is built from the all-MiniLM-L6-v2 checkpoint the tests
already install (tests/hub_cache.py), checked with huggingface_hub's own readers, then served by a
real ffn-serve with HF_HOME and HF_HUB_OFFLINE=1: the answers equal transformers' own FFN of that
layer (BertModel loaded offline from the same cache: intermediate, then output.dense), and float64
numpy on the checkpoint's tensors. A sharded copy whose cache holds only one shard serves a layer of
that shard. The failures (a repository or revision the cache lacks, a shard it lacks, an unknown
model_type, huggingface_hub missing) are one line each, naming the repository and why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
from pydantic import ValidationError
from safetensors.numpy import load_file, save_file

from app.config.settings import ModelSpec
from app.engine.errors import LoadFailed
from app.engine.repository import spec_from_config
from ffn_core import WeightsError
from ffn_testing import ServerFailed, ServerProcess, start_server
from tests.hub_cache import add_repo, repo_folder
from tests.reference import numpy_ffn
from tests.wire import raw_headers

hub = pytest.importorskip("huggingface_hub")
# By name: the package loads its submodules lazily, and `hub.constants` is an attribute only once some
# other import has loaded it (in a run where none had, the fixture below failed).
hub_constants = pytest.importorskip("huggingface_hub.constants")

REPO = "sentence-transformers/all-MiniLM-L6-v2"
SHARDED = "test-org/minilm-sharded"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")  # layers 0-2, 3-5
D_MODEL, D_FF = 384, 1536


@dataclass(frozen=True)
class Cache:
    home: Path  # HF_HOME
    commit: str  # what main points to in REPO

    @property
    def hub(self) -> Path:  # HF_HUB_CACHE, HF_HOME's hub/ as huggingface_hub places it
        return self.home / "hub"


@pytest.fixture(scope="module")
def cache(minilm_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Cache:
    """HF_HOME holding REPO whole, and SHARDED as two shards and an index of which only the second is cached."""
    home = tmp_path_factory.mktemp("hf-home")
    folder = minilm_path.parent
    commit = add_repo(home / "hub", REPO, {"config.json": folder / "config.json", "model.safetensors": minilm_path})
    tensors = load_file(str(minilm_path))
    first = {k: v for k, v in tensors.items() if any(f"encoder.layer.{i}." in k for i in range(3))}
    parts = home / "parts"
    parts.mkdir()
    save_file(first, str(parts / SHARDS[0]))
    save_file({k: v for k, v in tensors.items() if k not in first}, str(parts / SHARDS[1]))
    index = {"metadata": {}, "weight_map": {k: SHARDS[0] if k in first else SHARDS[1] for k in tensors}}
    (parts / "index.json").write_text(json.dumps(index))
    add_repo(
        home / "hub",
        SHARDED,
        {
            "config.json": folder / "config.json",
            "model.safetensors.index.json": parts / "index.json",
            SHARDS[1]: parts / SHARDS[1],  # the first shard was never fetched
        },
    )
    return Cache(home, commit)


@pytest.fixture
def offline(cache: Cache, monkeypatch: pytest.MonkeyPatch) -> Cache:
    """huggingface_hub in this process reading `cache`, offline (it reads HF_HOME once, at import)."""
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache.hub))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    return cache


def rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, D_MODEL)).astype(np.float32)


@pytest.fixture(scope="module")
def transformers_ffn(cache: Cache) -> Iterator[object]:
    """layer, x -> transformers' own FFN of that BertModel layer: output.dense(intermediate(x)), float32."""
    # Not in the test extra (tests/test_packaging.py keeps transformers out of it): where it is installed
    # (`pip install transformers`, no torch of its own), the served answers are checked against it too.
    transformers = pytest.importorskip("transformers")
    import torch

    model = transformers.BertModel.from_pretrained(REPO, cache_dir=str(cache.hub), local_files_only=True).eval()

    def ffn(layer: int, x: np.ndarray) -> np.ndarray:
        block = model.encoder.layer[layer]
        with torch.no_grad():
            return block.output.dense(block.intermediate(torch.from_numpy(x))).double().numpy()

    yield ffn


def numpy_layer(minilm_path: Path, layer: int, x: np.ndarray) -> np.ndarray:
    """The layer's FFN in float64 numpy, from the checkpoint's own tensors."""
    t = load_file(str(minilm_path))
    prefix = f"encoder.layer.{layer}."
    params = {
        "layer1.weight": t[prefix + "intermediate.dense.weight"],
        "layer1.bias": t[prefix + "intermediate.dense.bias"],
        "layer2.weight": t[prefix + "output.dense.weight"],
        "layer2.bias": t[prefix + "output.dense.bias"],
    }
    return numpy_ffn(x.astype(np.float64), params, "gelu")


# ----- the cache, as huggingface_hub reads it ------------------------------------------------------


def test_the_cache_is_laid_out_as_huggingface_hub_reads_it(cache: Cache) -> None:
    info = hub.scan_cache_dir(cache.hub)
    assert info.warnings == []
    repos = {repo.repo_id: repo for repo in info.repos}
    assert set(repos) == {REPO, SHARDED}
    (revision,) = repos[REPO].revisions
    assert revision.commit_hash == cache.commit and set(revision.refs) == {"main"}
    assert {f.file_name for f in revision.files} == {"config.json", "model.safetensors"}
    snapshot = repo_folder(cache.hub, REPO) / "snapshots" / cache.commit
    for revision_asked in (None, "main", cache.commit):
        found = hub.try_to_load_from_cache(REPO, "model.safetensors", cache_dir=cache.hub, revision=revision_asked)
        assert found == str(snapshot / "model.safetensors")
        downloaded = hub.hf_hub_download(
            REPO, "config.json", revision=revision_asked, cache_dir=cache.hub, local_files_only=True
        )
        assert downloaded == str(snapshot / "config.json")


# ----- served by a real server ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(cache: Cache, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """ffn-serve with three Hub models, HF_HOME and HF_HUB_OFFLINE=1 in its environment."""
    folder = tmp_path_factory.mktemp("hub-config")
    (folder / "ffn.toml").write_text(
        f'[[models]]\nname = "minilm-l3"\nhf_model = "{REPO}"\nlayer = 3\n\n'  # format from config.json
        f'[[models]]\nname = "pinned"\nhf_model = "{REPO}"\nrevision = "{cache.commit}"\nformat = "bert"\nlayer = 0\n\n'
        f'[[models]]\nname = "sharded"\nhf_model = "{SHARDED}"\nlayer = 4\n'
    )
    env = {"HF_HOME": str(cache.home), "HF_HUB_OFFLINE": "1", "FFN_LOG_LEVEL": "info"}
    with start_server(env=env, config=folder / "ffn.toml") as server:
        yield server


def transform(server: ServerProcess, model: str, x: np.ndarray) -> np.ndarray:
    response = httpx.post(
        f"{server.url}/v1/models/{model}/transform", content=x.tobytes(), headers=raw_headers(x.shape), timeout=60
    )
    assert response.status_code == 200, response.text
    return np.frombuffer(response.content, "<f4").reshape(x.shape).astype(np.float64)


SERVED = [("minilm-l3", 3), ("pinned", 0), ("sharded", 4)]


@pytest.mark.parametrize(("model", "layer"), SERVED)
@pytest.mark.server
def test_a_hub_model_answers_as_numpy_on_the_checkpoints_tensors(
    served: ServerProcess, minilm_path: Path, model: str, layer: int
) -> None:
    x = rows(5, layer)
    np.testing.assert_allclose(transform(served, model, x), numpy_layer(minilm_path, layer, x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("model", "layer"), SERVED)
@pytest.mark.server
def test_a_hub_model_answers_as_transformers_own_layer(
    served: ServerProcess, transformers_ffn, model: str, layer: int
) -> None:
    x = rows(5, 100 + layer)
    np.testing.assert_allclose(transform(served, model, x), transformers_ffn(layer, x), rtol=1e-4, atol=1e-4)


@pytest.mark.server
def test_the_hub_models_are_described_and_logged_with_their_repository(served: ServerProcess, cache: Cache) -> None:
    listed = {m["name"]: m for m in httpx.get(f"{served.url}/v1/models").json()["models"]}
    for name in ("minilm-l3", "pinned", "sharded"):
        assert (listed[name]["format"], listed[name]["d_model"], listed[name]["d_ff"]) == ("bert", D_MODEL, D_FF)
        assert listed[name]["activation"] == "gelu"
    snapshot = repo_folder(cache.hub, REPO) / "snapshots" / cache.commit
    logs = served.logs()
    assert f"from {REPO}@main (Hugging Face Hub), {snapshot / 'model.safetensors'}" in logs
    assert f"from {REPO}@{cache.commit} (Hugging Face Hub)" in logs
    assert "/snapshots/" in logs and SHARDS[1] in logs and SHARDS[0] not in logs


# ----- what cannot be served: one line each -----------------------------------------------------------


@pytest.mark.parametrize(
    ("table", "fragment"),
    [
        ({"hf_model": "nobody/nothing", "layer": 0}, "nobody/nothing@main: config.json is not in the cache"),
        ({"hf_model": REPO, "revision": "v9", "layer": 0}, f"{REPO}@v9: config.json is not in the cache"),
        ({"hf_model": REPO, "layer": 6}, "no layer 6; the file has 6 layers (0..5)"),
        ({"hf_model": SHARDED, "layer": 1}, f"{SHARDS[0]} is not in the cache"),
        ({"hf_model": REPO, "format": "gpt2", "layer": 0}, "no gpt2 layers found"),
    ],
)
def test_what_the_cache_cannot_give_is_refused_naming_the_repository(
    offline: Cache, table: dict, fragment: str
) -> None:
    from app.engine.registry import read_weights

    with pytest.raises(WeightsError) as refused:
        read_weights(ModelSpec(name="m", **table))
    message = str(refused.value)
    assert fragment in message and "\n" not in message, message
    if "not in the cache" in message:
        assert f"({offline.hub}) and HF_HUB_OFFLINE is set" in message


# main() in a real process, which then says whether torch was imported (as tests/test_preflight.py).
MAIN_THEN_SAY = (
    "import sys; from app.cli import main; code = main(sys.argv[1:]); "
    "print('torch imported' if 'torch' in sys.modules else 'no torch'); sys.exit(code)"
)


@pytest.mark.parametrize(
    ("table", "offline_env"),
    [("", True), ('revision = "{commit}"', False)],
    ids=["HF_HUB_OFFLINE", "at a commit"],
)
def test_a_layer_the_cached_hub_checkpoint_lacks_is_refused_before_torch(
    cache: Cache, tmp_path: Path, table: str, offline_env: bool
) -> None:
    """Where the cache holds the very file a load would read, its header says there is no layer 6: one
    line, exit 2, torch never imported. Online at main the Hub may have moved on: left to the load."""
    config = tmp_path / "ffn.toml"
    config.write_text(f'[[models]]\nname = "m"\nhf_model = "{REPO}"\nlayer = 6\n{table.format(commit=cache.commit)}\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FFN_", "HF_"))} | {"HF_HOME": str(cache.home)}
    if offline_env:
        env["HF_HUB_OFFLINE"] = "1"
    result = subprocess.run(
        [sys.executable, "-c", MAIN_THEN_SAY, "--config", str(config), "--port", "0", "--grpc-port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 2, result.stderr
    assert result.stdout == "no torch\n", result.stderr
    weights = cache.hub / f"models--{REPO.replace('/', '--')}" / "snapshots" / cache.commit / "model.safetensors"
    assert result.stderr.splitlines() == [f"ffn-serve: model 'm': {weights}: no layer 6; the file has 6 layers (0..5)"]


def test_an_hf_model_the_cache_may_not_hold_as_loaded_is_left_to_the_load(offline: Cache, monkeypatch) -> None:
    from app.config.settings import load_settings
    from app.process.preflight import missing_layers

    settings = load_settings(models=[{"name": "m", "hf_model": REPO, "layer": 6}])
    assert missing_layers(settings) != []  # offline: the cache is what loads
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    assert missing_layers(settings) == []  # online at main: the Hub may hold another file by now
    sharded = load_settings(models=[{"name": "m", "hf_model": SHARDED, "layer": 9}])
    assert missing_layers(sharded) == []  # no model.safetensors: a shard is chosen as it loads


def test_a_model_type_of_no_known_family_asks_for_the_format(offline: Cache, tmp_path: Path) -> None:
    from app.engine.registry import read_weights

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "t5"}))
    add_repo(offline.hub, "test-org/t5ish", {"config.json": config})
    with pytest.raises(
        WeightsError, match=r"model_type 't5' is not one of \['bert', 'gpt2', 'llama'\]; name the format"
    ):
        read_weights(ModelSpec(name="m", hf_model="test-org/t5ish", layer=0))


@pytest.mark.server
def test_a_server_that_cannot_find_its_hub_model_stops_naming_it(cache: Cache, tmp_path: Path) -> None:
    (tmp_path / "ffn.toml").write_text('[[models]]\nname = "m"\nhf_model = "nobody/nothing"\nlayer = 0\n')
    env = {"HF_HOME": str(cache.home), "HF_HUB_OFFLINE": "1"}
    with pytest.raises(ServerFailed) as failed:
        start_server(env=env, config=tmp_path / "ffn.toml", ready_timeout=120)
    assert "server exited with 1" in str(failed.value)
    assert "model 'm': nobody/nothing@main: config.json is not in the cache" in str(failed.value)
    assert "HF_HUB_OFFLINE is set" in str(failed.value)


def test_without_huggingface_hub_the_start_is_one_line_naming_the_extra(tmp_path: Path) -> None:
    (tmp_path / "ffn.toml").write_text(f'[[models]]\nname = "m"\nhf_model = "{REPO}"\nlayer = 3\n')
    hidden = "import sys; sys.modules['huggingface_hub'] = None; from app.cli import main; sys.exit(main(sys.argv[1:]))"
    result = subprocess.run(
        [sys.executable, "-c", hidden, "--config", str(tmp_path / "ffn.toml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("ffn-serve: invalid setting models[0]") and "pip install 'ffn-serve[hub]'" in line, line


# ----- the table's rules ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("table", "fragment"),
    [
        ({"hf_model": REPO, "weights": "/w/m.safetensors"}, "weights or hf_model, not both"),
        ({"revision": "main"}, "revision is the revision of an hf_model"),
        ({"hf_model": REPO, "format": "torch"}, "format 'torch' is for local files"),
        ({"hf_model": "a/b/c"}, "should match pattern"),
        ({"hf_model": REPO, "revision": "main branch"}, "should match pattern"),
    ],
)
def test_a_table_with_a_hub_mistake_is_refused(table: dict, fragment: str) -> None:
    with pytest.raises(ValidationError, match=fragment):
        ModelSpec(name="m", **table)


def test_a_loads_config_parameter_cannot_name_a_hub_model(tmp_path: Path) -> None:
    with pytest.raises(LoadFailed, match="a model from the Hub \\(hf_model\\) is a \\[\\[models\\]\\] table"):
        spec_from_config("m", json.dumps({"hf_model": REPO, "layer": 3}), tmp_path)


async def test_a_load_reads_the_hub_model_again_through_the_cache(
    offline: Cache, start_app, minilm_path: Path, tmp_path: Path
) -> None:
    """Model control: a load of a config file's hf_model table finds its file once and every worker reads it."""
    from app.config.settings import load_settings

    (tmp_path / "ffn.toml").write_text(f'[[models]]\nname = "m"\nhf_model = "{REPO}"\nlayer = 2\n')
    app = await start_app(load_settings(config=tmp_path / "ffn.toml", model_control="explicit", warmup=False))
    loaded = await app.client.post("/v2/repository/models/m/load")
    assert loaded.status_code == 200 and loaded.json()["version"] == 2, loaded.text
    x = rows(3, 7)
    answer = await app.client.post("/v1/models/m/transform", content=x.tobytes(), headers=raw_headers(x.shape))
    assert answer.status_code == 200
    y = np.frombuffer(answer.content, "<f4").reshape(x.shape).astype(np.float64)
    np.testing.assert_allclose(y, numpy_layer(minilm_path, 2, x), rtol=1e-4, atol=1e-4)
    # A table naming what the cache lacks is a load refused, counted, and the copy serving keeps serving.
    (tmp_path / "ffn.toml").write_text(f'[[models]]\nname = "m"\nhf_model = "{REPO}"\nrevision = "v9"\nlayer = 2\n')
    refused = await app.client.post("/v2/repository/models/m/load")
    assert refused.status_code == 400 and refused.json()["error_type"] == "load_failed"
    assert f"{REPO}@v9: config.json is not in the cache" in refused.json()["error"]
    page = (await app.client.get("/metrics")).text
    assert 'ffn_model_loads_total{model="m",outcome="failed"} 1.0' in page
