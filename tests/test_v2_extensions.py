"""V2 extensions in Triton's JSON shapes: model configuration, statistics, repository index, and
a named 400 for every extension not implemented. In-process (start_app), by plain HTTP."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from app.config.settings import ModelSpec, Settings
from ffn_core import FFNConfig, build_ffn, save_ffn
from ffn_core.dtypes import DTYPES
from ffn_testing import metric_value
from tests.in_process import InProcessApp

D_MODEL, D_FF = 16, 64


@pytest.fixture
def swiglu_file(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    path = tmp_path / "swiglu.safetensors"
    save_ffn(build_ffn(FFNConfig(D_MODEL, D_FF, "silu", gated=True, dropout=0.2)), path)
    return path


@pytest.fixture
async def service(start_app, swiglu_file: Path) -> InProcessApp:
    settings = Settings(
        max_batch_rows=64,
        max_wait_ms=2.5,
        default_timeout_ms=1500,
        max_queue_rows=256,
        warmup=False,
        models=[
            ModelSpec(name="swiglu", weights=swiglu_file, dtype="float16"),
            ModelSpec(name="plain", weights=swiglu_file, dropout=0.3),
        ],
    )
    return await start_app(settings)


def body(rows: int, name: str = "input") -> dict:
    x = np.random.default_rng(rows).standard_normal((rows, D_MODEL)).astype(np.float32)
    return {"inputs": [{"name": name, "shape": [rows, D_MODEL], "datatype": "FP32", "data": x.ravel().tolist()}]}


async def test_server_metadata_lists_exactly_the_extensions_implemented(service: InProcessApp) -> None:
    r = await service.client.get("/v2")
    # system_shared_memory only when the setting turns it on (tests/test_system_shared_memory.py)
    assert r.json()["extensions"] == [
        "binary_tensor_data",
        "model_configuration",
        "statistics",
        "parameters",
        "trace",
        "logging",
    ]


# ----- model configuration ---------------------------------------------------------------------


async def test_model_config_in_triton_shape(service: InProcessApp) -> None:
    r = await service.client.get("/v2/models/swiglu/config")
    assert r.status_code == 200, r.text
    config = r.json()
    assert config["name"] == "swiglu" and config["platform"] == "pytorch_ffn" and config["backend"] == "pytorch"
    assert config["max_batch_size"] == 64
    assert config["version_policy"] == {"latest": {"num_versions": 1}}
    (tensor_in,), (tensor_out,) = config["input"], config["output"]
    assert (tensor_in["name"], tensor_in["data_type"], tensor_in["dims"]) == ("input", "TYPE_FP16", [D_MODEL])
    assert (tensor_out["name"], tensor_out["data_type"], tensor_out["dims"]) == ("output", "TYPE_FP16", [D_MODEL])
    batching = config["dynamic_batching"]
    assert batching["max_queue_delay_microseconds"] == 2500
    assert batching["default_queue_policy"]["default_timeout_microseconds"] == 1_500_000
    assert config["instance_group"] == [{"name": "swiglu", "kind": "KIND_CPU", "count": 1, "gpus": []}]
    parameters = {key: value["string_value"] for key, value in config["parameters"].items()}
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", parameters.pop("digest")), "the weights' digest (tests/test_digest.py)"
    assert parameters == {
        "d_ff": "64",
        "activation": "silu",
        "gated": "true",
        "variant": "swiglu",
        "dropout": "0.2",
        "max_mc_passes": "64",
        "max_queue_rows": "256",
    }
    assert (await service.client.get("/v2/models/swiglu/versions/1/config")).json() == config


async def test_model_config_dropout_from_the_table_over_the_file(service: InProcessApp) -> None:
    config = (await service.client.get("/v2/models/plain/config")).json()
    assert config["parameters"]["dropout"] == {"string_value": "0.3"}
    assert config["input"][0]["data_type"] == "TYPE_FP32"


@pytest.mark.parametrize(
    "path",
    [
        "/v2/models/nope/config",
        "/v2/models/swiglu/versions/2/config",
        "/v2/models/nope/stats",
        "/v2/models/swiglu/versions/2/stats",
    ],
)
async def test_unknown_model_or_version_is_404(service: InProcessApp, path: str) -> None:
    r = await service.client.get(path)
    assert r.status_code == 404 and r.json()["error_type"] == "model_not_found", r.text


# ----- statistics ------------------------------------------------------------------------------


async def stats_of(client: httpx.AsyncClient, path: str) -> dict:
    r = await client.get(path)
    assert r.status_code == 200, r.text
    (stat,) = r.json()["model_stats"]
    return stat


async def test_statistics_count_what_was_sent(service: InProcessApp) -> None:
    client = service.client
    zero = await stats_of(client, "/v2/models/swiglu/stats")
    assert zero["inference_count"] == zero["execution_count"] == zero["last_inference"] == 0
    for rows in (2, 3, 4):  # one at a time: each is its own forward pass
        assert (await client.post("/v2/models/swiglu/infer", json=body(rows))).status_code == 200
    # More rows than the queue can ever hold (256): refused by the batcher, a failed request.
    assert (await client.post("/v2/models/swiglu/infer", json=body(300))).status_code == 413

    stat = await stats_of(client, "/v2/models/swiglu/stats")
    assert (stat["name"], stat["version"]) == ("swiglu", "1")
    assert stat["inference_count"] == 2 + 3 + 4
    assert stat["execution_count"] == 3
    inference = stat["inference_stats"]
    assert inference["success"]["count"] == inference["queue"]["count"] == inference["compute_infer"]["count"] == 3
    assert inference["fail"]["count"] == 1
    assert all(inference[key]["ns"] > 0 for key in ("success", "queue", "compute_infer", "fail"))
    assert inference["compute_infer"]["ns"] < inference["success"]["ns"]  # compute is part of each request's time
    # perf_analyzer needs the three compute counts equal; the copies are timed inside compute_infer.
    for key in ("compute_input", "compute_output"):
        assert inference[key] == {"count": 3, "ns": 0}
    for key in ("cache_hit", "cache_miss"):
        assert inference[key] == {"count": 0, "ns": 0}
    assert stat["batch_stats"] == [] and stat["response_stats"] == {}
    parameters = D_FF * D_MODEL * 3 + D_FF * 2 + D_MODEL  # layer1, linear_v, layer2 and their biases
    assert stat["memory_usage"] == [{"type": "CPU", "id": 0, "byte_size": parameters * 2}]  # float16

    # The same numbers as /metrics: read from the same series.
    page = (await client.get("/metrics")).text
    for key, series in (
        ("success", "ffn_request_seconds"),
        ("queue", "ffn_queue_seconds"),
        ("fail", "ffn_failed_request_seconds"),
    ):
        assert inference[key]["count"] == metric_value(page, f"{series}_count", model="swiglu")
        assert inference[key]["ns"] == round(metric_value(page, f"{series}_sum", model="swiglu") * 1e9)
    assert inference["compute_infer"]["ns"] == round(
        metric_value(page, "ffn_request_compute_seconds_total", model="swiglu") * 1e9
    )
    assert stat["last_inference"] == round(
        metric_value(page, "ffn_last_inference_timestamp_seconds", model="swiglu") * 1000
    )

    # The other model saw none of it; the versioned path and the all-models list agree.
    assert (await stats_of(client, "/v2/models/plain/stats"))["inference_count"] == 0
    assert await stats_of(client, "/v2/models/swiglu/versions/1/stats") == stat
    every = (await client.get("/v2/models/stats")).json()["model_stats"]
    assert [s["name"] for s in every] == ["swiglu", "plain"] and every[0] == stat


async def test_a_batch_counts_once_as_an_execution_and_per_request_in_compute(service: InProcessApp) -> None:
    """Three requests queued in one tick run as one batch: one execution, three requests' computes."""
    served = service.app.state.service.engine.model("plain")
    parts = [np.random.default_rng(n).standard_normal((n, D_MODEL), dtype=np.float32) for n in (1, 2, 3)]
    # gather starts the three submits before the collector task runs again: one batch of 6 rows.
    await asyncio.gather(*(served.infer(part, DTYPES["float32"], deadline=None) for part in parts))
    stat = await stats_of(service.client, "/v2/models/plain/stats")
    assert stat["execution_count"] == 1 and stat["inference_count"] == 6
    inference = stat["inference_stats"]
    assert inference["compute_infer"]["count"] == inference["success"]["count"] == inference["queue"]["count"] == 3
    page = (await service.client.get("/metrics")).text
    one_pass = metric_value(page, "ffn_compute_seconds_sum", model="plain")
    assert abs(inference["compute_infer"]["ns"] - 3 * one_pass * 1e9) <= 1


# ----- repository index ------------------------------------------------------------------------


def without_digests(entries: list[dict[str, str]]) -> list[dict[str, str]]:
    """The entries without their weights' digest, each checked to be one (tests/test_digest.py checks the values)."""
    for entry in entries:
        assert re.fullmatch(r"sha256:[0-9a-f]{64}", entry["digest"]), entry
    return [{k: v for k, v in entry.items() if k != "digest"} for entry in entries]


async def test_repository_index(service: InProcessApp) -> None:
    client = service.client
    everything = [
        {"name": "swiglu", "version": "1", "state": "READY", "reason": ""},
        {"name": "plain", "version": "1", "state": "READY", "reason": ""},
    ]
    index = (await client.post("/v2/repository/index")).json()  # tritonclient sends no body
    assert without_digests(index) == everything
    assert (await client.post("/v2/repository/index", json={"ready": True})).json() == index
    bad = await client.post("/v2/repository/index", json={"ready": "maybe"})
    assert bad.status_code == 400 and bad.json()["error_type"] == "invalid_input"
    await service.app.state.service.engine.drain()
    assert (await client.post("/v2/repository/index", json={"ready": True})).json() == []
    draining = (await client.post("/v2/repository/index")).json()
    assert [(e["state"], e["reason"]) for e in draining] == [("UNAVAILABLE", "draining before shutdown")] * 2


# ----- extensions not implemented ---------------------------------------------------------------

# Every route of the extensions in Triton's protocol documents that this server does not implement,
# and system shared memory's while it is off (as it is by default).
UNSUPPORTED_ROUTES = [
    ("GET", "/v2/systemsharedmemory/status", "system_shared_memory"),
    ("GET", "/v2/systemsharedmemory/region/r0/status", "system_shared_memory"),
    ("POST", "/v2/systemsharedmemory/region/r0/register", "system_shared_memory"),
    ("POST", "/v2/systemsharedmemory/region/r0/unregister", "system_shared_memory"),
    ("POST", "/v2/systemsharedmemory/unregister", "system_shared_memory"),
    ("POST", "/v2/cudasharedmemory/region/r0/register", "cuda_shared_memory"),
    ("POST", "/v2/models/plain/generate", "generate"),
    ("POST", "/v2/models/plain/generate_stream", "generate"),
    ("POST", "/v2/models/plain/versions/1/generate", "generate"),
    ("POST", "/v1/models/plain:explain", "explain"),  # KServe V1's explainer (issue 41: it met a bare 405)
]


def assert_unsupported(r: httpx.Response, extension: str) -> None:
    assert r.status_code == 400, r.text
    assert r.json()["error_type"] == "unsupported_extension"
    assert r.json()["error"].startswith(f"the {extension} extension is not supported by this server: ")


@pytest.mark.parametrize(("method", "path", "extension"), UNSUPPORTED_ROUTES)
async def test_unsupported_extension_route_is_a_named_400(
    service: InProcessApp, method: str, path: str, extension: str
) -> None:
    assert_unsupported(await service.client.request(method, path, json={}), extension)


async def test_cuda_regions_are_none_so_status_lists_none_and_unregistering_has_nothing_to_do(
    service: InProcessApp,
) -> None:
    """As Triton answers with no CUDA region registered; perf_analyzer's clean-up unregisters them all."""
    client = service.client
    status = await client.get("/v2/cudasharedmemory/status")
    assert (status.status_code, status.json()) == (200, [])
    for path in ("/v2/cudasharedmemory/unregister", "/v2/cudasharedmemory/region/r0/unregister"):
        done = await client.post(path)
        assert (done.status_code, done.content) == (200, b""), path
    named = await client.get("/v2/cudasharedmemory/region/r0/status")
    assert named.status_code == 404 and named.json()["error_type"] == "region_not_found"
    assert named.json()["error"].startswith("no cuda shared memory region named 'r0' is registered: ")
    bad = await client.post("/v2/cudasharedmemory/region/%20bad/unregister")
    assert bad.status_code == 400 and bad.json()["error_type"] == "invalid_input"
    assert "cuda_shared_memory" not in [e for e in (await client.get("/v2")).json()["extensions"]]


SHARED_MEMORY = {"shared_memory_region": "r0", "shared_memory_byte_size": 64}


@pytest.mark.parametrize(
    ("change", "extension"),
    [
        (lambda b: b["inputs"][0].update(parameters=SHARED_MEMORY), "system_shared_memory"),  # while it is off
        (lambda b: b.update(outputs=[{"name": "output", "parameters": SHARED_MEMORY}]), "system_shared_memory"),
        (lambda b: b.update(parameters={"sequence_id": 7, "sequence_start": True}), "sequence"),
        (lambda b: b.update(parameters={"priority": 1}), "schedule_policy"),
        (lambda b: b.update(outputs=[{"name": "output", "parameters": {"classification": 3}}]), "classification"),
    ],
    ids=["input-shared-memory", "output-shared-memory", "sequence", "priority", "classification"],
)
async def test_infer_relying_on_an_unsupported_extension_is_a_named_400(
    service: InProcessApp, change, extension: str
) -> None:
    document = body(1)
    change(document)
    assert_unsupported(await service.client.post("/v2/models/plain/infer", json=document), extension)


async def test_output_std_without_monte_carlo_is_refused(service: InProcessApp) -> None:
    document = {**body(1), "outputs": [{"name": "output_std"}]}
    r = await service.client.post("/v2/models/plain/infer", json=document)
    assert r.status_code == 400 and "mc_passes" in r.json()["error"], r.text


async def test_outputs_named_pick_the_answer_and_an_empty_list_means_all(service: InProcessApp) -> None:
    r = await service.client.post("/v2/models/plain/infer", json={**body(2), "outputs": []})
    assert [o["name"] for o in r.json()["outputs"]] == ["output"]


async def test_a_wrong_method_on_a_known_path_names_the_method_to_send(service: InProcessApp) -> None:
    # Issue 41: GET /v2/repository/index answered "Method Not Allowed" and nothing more.
    r = await service.client.get("/v2/repository/index")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error_type"] == "method_not_allowed"
    assert r.json()["error"] == "GET is not served on '/v2/repository/index': send POST"
    r = await service.client.delete("/v2/models/plain/infer")
    assert r.status_code == 405 and r.json()["error"] == "DELETE is not served on '/v2/models/plain/infer': send POST"
