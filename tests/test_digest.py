"""The weights' identity (issue 29 item 1): every served copy's digest, on every surface of both doors.

The digests are checked against `reference_digest`, written here from the construction that
ffn_core/digest.py documents (hashlib over numpy bytes), not against the code under test. One
server (model control on) serves `demo`, `small` (a file the test writes) and `rolled` (reloaded
with new weights by the last test); a second, with two workers, shows a reload in
ffn_model_info.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from safetensors.numpy import load_file

from app.config.settings import ModelSpec
from app.engine.registry import model_digest, read_weights
from ffn_core import demo_ffn, digest
from ffn_testing import ServerProcess, start_server
from tests.model_files import write_ffn

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 16 * 2**20  # the documented piece size
D_MODEL = 16
TABLE_OF_RELU_16 = {  # the table of tests/model_files.py's files, as the digest's header holds it
    "d_model": D_MODEL,
    "d_ff": 64,
    "activation": "relu",
    "gated": False,
    "bias1": True,
    "bias2": True,
    "bias_gate": True,
    "dropout": 0.0,
    "dtype": "float32",
}


def canonical(value: dict[str, Any]) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode() + b"\n"


def reference_digest(arrays: dict[str, np.ndarray], table: dict[str, Any], chunk: int = CHUNK) -> str:
    """The documented construction: a header, then per tensor (name order) its record and its pieces' sha256."""
    outer = hashlib.sha256(canonical({"format": "ffn-weights-digest/1", "chunk_bytes": chunk, "table": table}))
    for name in sorted(arrays):
        array = np.ascontiguousarray(arrays[name])
        outer.update(canonical({"name": name, "dtype": array.dtype.name, "shape": list(array.shape)}))
        data = array.tobytes()
        for start in range(0, len(data), chunk):
            outer.update(hashlib.sha256(data[start : start + chunk]).digest())
    return "sha256:" + outer.hexdigest()


def file_digest(path: Path, table: dict[str, Any] = TABLE_OF_RELU_16) -> str:
    return reference_digest(load_file(str(path)), table)


def demo_digest() -> str:
    arrays = {name: t.numpy() for name, t in demo_ffn().state_dict().items()}
    table = {**TABLE_OF_RELU_16, "d_model": 512, "d_ff": 2048}
    return reference_digest(arrays, table)


# ----- the digest itself ---------------------------------------------------------------------------


def test_the_digest_is_the_documented_construction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_ffn(tmp_path / "a.safetensors", seed=1)
    spec = ModelSpec(name="a", weights=tmp_path / "a.safetensors")
    assert model_digest(spec, read_weights(spec)) == file_digest(tmp_path / "a.safetensors")
    assert model_digest(ModelSpec(name="demo"), read_weights(ModelSpec(name="demo"))) == demo_digest()
    assert demo_digest() in (ROOT / "docs" / "api.md").read_text(), "the demo's digest as docs/api.md shows it"
    # Pieces of 100 bytes: each tensor spans several, the last one shorter (16 x 64 x 4 = 4096 bytes).
    monkeypatch.setattr(digest, "CHUNK_BYTES", 100)
    arrays = load_file(str(tmp_path / "a.safetensors"))
    assert model_digest(spec, read_weights(spec)) == reference_digest(arrays, TABLE_OF_RELU_16, chunk=100)


def test_the_same_weights_anywhere_have_one_digest_and_any_change_another(tmp_path: Path) -> None:
    write_ffn(tmp_path / "a.safetensors", seed=1)
    (tmp_path / "elsewhere").mkdir()
    shutil.copy(tmp_path / "a.safetensors", tmp_path / "elsewhere" / "b.safetensors")

    def of(path: Path, **table: Any) -> str:
        spec = ModelSpec(name=str(table.pop("name", "m")), weights=path, **table)
        return model_digest(spec, read_weights(spec))

    first = of(tmp_path / "a.safetensors")
    assert of(tmp_path / "elsewhere" / "b.safetensors", name="another-name") == first, "path and name: no part"
    assert of(tmp_path / "a.safetensors", dtype="bfloat16") != first, "the dtype is part of the table"
    assert of(tmp_path / "a.safetensors", dropout=0.25) != first, "so is the dropout it serves"
    write_ffn(tmp_path / "a.safetensors", seed=2)
    assert of(tmp_path / "a.safetensors") != first, "other weights"


def test_the_pieces_are_views_of_the_tensors_not_copies() -> None:
    weights = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    (piece,) = digest._pieces("w", weights)
    assert np.shares_memory(piece, weights.numpy()), "hashed in place: no second copy of the weights"
    half = weights.to(torch.bfloat16)
    assert np.shares_memory(digest._pieces("h", half)[0], half.view(torch.int16).numpy())


# ----- every surface of a server ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("digest")
    write_ffn(folder / "small.safetensors", seed=3)
    write_ffn(folder / "rolled.safetensors", seed=4)
    (folder / "ffn.toml").write_text(
        'model_control = "explicit"\nwarmup = false\n\n[[models]]\nname = "demo"\n\n'
        '[[models]]\nname = "small"\nweights = "small.safetensors"\n\n'
        '[[models]]\nname = "rolled"\nweights = "rolled.safetensors"\n'
    )
    return folder


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[ServerProcess]:
    with start_server(config=repository / "ffn.toml") as running:
        yield running


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30, trust_env=False) as client:
        yield client


def expected(repository: Path) -> dict[str, str]:
    return {
        "demo": demo_digest(),
        "small": file_digest(repository / "small.safetensors"),
        "rolled": file_digest(repository / "rolled.safetensors"),
    }


def info_series(page: str) -> dict[tuple[str, str, str], float]:
    """ffn_model_info's samples: (model, version, digest) -> value."""
    found = {}
    for line in page.splitlines():
        if line.startswith("ffn_model_info{"):
            labels = dict(part.split("=", 1) for part in line[len("ffn_model_info{") : line.index("}")].split(","))
            key = tuple(labels[k].strip('"') for k in ("model", "version", "digest"))
            found[key] = float(line.rsplit(" ", 1)[1])
    return found


@pytest.mark.server
def test_every_http_surface_shows_each_models_digest(
    server: ServerProcess, http: httpx.Client, repository: Path
) -> None:
    digests = expected(repository)
    listed = {m["name"]: m["digest"] for m in http.get("/v1/models").json()["models"]}
    assert listed == digests
    index = {m["name"]: m["digest"] for m in http.post("/v2/repository/index", json={}).json()}
    assert index == digests
    stats = {m["name"]: m["digest"] for m in http.get("/v2/models/stats").json()["model_stats"]}
    assert stats == digests
    for name, value in digests.items():
        assert http.get(f"/v2/models/{name}").json()["parameters"] == {"digest": value}
        assert http.get(f"/v2/models/{name}/config").json()["parameters"]["digest"] == {"string_value": value}
    assert info_series(http.get("/metrics").text) == {(name, "1", value): 1.0 for name, value in digests.items()}


@pytest.mark.server
def test_every_answer_names_the_digest_that_computed_it(
    server: ServerProcess, http: httpx.Client, repository: Path
) -> None:
    small = expected(repository)["small"]
    x = np.random.default_rng(0).standard_normal((3, D_MODEL)).astype(np.float32)
    native = http.post("/v1/models/small/transform", json={"inputs": x.tolist()})
    raw = http.post(
        "/v1/models/small/transform",
        content=x.tobytes(),
        headers={"content-type": "application/octet-stream", "x-shape": "3,16", "x-dtype": "float32"},
    )
    body = {"inputs": [{"name": "input", "shape": [3, D_MODEL], "datatype": "FP32", "data": x.ravel().tolist()}]}
    v2 = http.post("/v2/models/small/infer", json=body)
    mc_parameters = {"mc_passes": 2, "mc_seed": 1, "mc_dropout": 0.1}
    mc = http.post("/v2/models/small/infer", json={**body, "parameters": mc_parameters})
    for answer in (native, raw, v2, mc):
        assert answer.status_code == 200 and answer.headers["x-model-digest"] == small, answer.text[:300]
    assert v2.json()["parameters"] == {"model_digest": small}
    assert mc.json()["parameters"]["model_digest"] == small and mc.json()["parameters"]["mc_passes"] == 2


@pytest.mark.server
def test_tritonclient_reads_the_digest_over_http_and_grpc(server: ServerProcess, repository: Path) -> None:
    small = expected(repository)["small"]
    x = np.random.default_rng(0).standard_normal((2, D_MODEL)).astype(np.float32)
    with triton_http.InferenceServerClient(f"127.0.0.1:{server.port}") as client:
        assert client.get_model_metadata("small")["parameters"]["digest"] == small
        assert client.get_model_config("small")["parameters"]["digest"]["string_value"] == small
        tensor = triton_http.InferInput("input", [2, D_MODEL], "FP32")
        tensor.set_data_from_numpy(x)
        assert client.infer("small", [tensor]).get_response()["parameters"]["model_digest"] == small
    with triton_grpc.InferenceServerClient(server.grpc_target) as client:
        config = client.get_model_config("small", as_json=True)["config"]
        assert config["parameters"]["digest"]["string_value"] == small
        tensor = triton_grpc.InferInput("input", [2, D_MODEL], "FP32")
        tensor.set_data_from_numpy(x)
        response = client.infer("small", [tensor]).get_response(as_json=True)
        assert response["parameters"]["model_digest"]["string_param"] == small


@pytest.mark.server
def test_a_reload_with_new_weights_shows_the_new_digest_everywhere(
    server: ServerProcess, http: httpx.Client, repository: Path
) -> None:
    before = expected(repository)["rolled"]
    write_ffn(repository / "rolled.safetensors", seed=5)
    after = file_digest(repository / "rolled.safetensors")
    assert after != before
    loaded = http.post("/v2/repository/models/rolled/load", json={})
    assert loaded.status_code == 200, loaded.text
    x = np.ones((1, D_MODEL), np.float32)
    assert http.post("/v1/models/rolled/transform", json={"inputs": x.tolist()}).headers["x-model-digest"] == after
    assert http.get("/v2/models/rolled").json()["parameters"] == {"digest": after}
    series = {key: value for key, value in info_series(http.get("/metrics").text).items() if key[0] == "rolled"}
    assert series == {("rolled", "2", after): 1.0}, "the old copy's series is gone"


def wait_for_log(server: ServerProcess, text: str, limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s
    while text not in server.logs():
        assert time.monotonic() < deadline, f"no {text!r} in {limit_s:g} s:\n{server.logs()[-3000:]}"
        time.sleep(0.1)


@pytest.mark.server
def test_with_workers_a_reload_moves_ffn_model_info_to_the_new_digest(tmp_path: Path) -> None:
    write_ffn(tmp_path / "m.safetensors", seed=6)
    before = file_digest(tmp_path / "m.safetensors")
    (tmp_path / "ffn.toml").write_text(
        'model_control = "explicit"\nwarmup = false\nworkers = 2\ntorch_threads = 1\n\n'
        '[[models]]\nname = "m"\nweights = "m.safetensors"\n'
    )
    with start_server(config=tmp_path / "ffn.toml") as running, httpx.Client(base_url=running.url, timeout=60) as http:
        # Ready answers once one worker is: the file is rewritten only once both have read it (a worker
        # still loading would read the new file as version 1, a mix the digest shows).
        wait_for_log(running, "ready: 2 workers")
        assert info_series(http.get("/metrics").text) == {("m", "1", before): 1.0}
        write_ffn(tmp_path / "m.safetensors", seed=7)
        after = file_digest(tmp_path / "m.safetensors")
        assert http.post("/v2/repository/models/m/load", json={}).status_code == 200
        # Both workers serve the new copy: 0 for the old digest (the workers' files keep its series).
        seen = info_series(http.get("/metrics").text)
        assert seen == {("m", "1", before): 0.0, ("m", "2", after): 1.0}, (before, after, seen)
        x = np.ones((1, D_MODEL), np.float32)
        for _ in range(8):  # a connection each: the kernel spreads them over both workers
            with httpx.Client(base_url=running.url, timeout=60) as one:
                assert (
                    one.post("/v1/models/m/transform", json={"inputs": x.tolist()}).headers["x-model-digest"] == after
                )
