"""Monte Carlo dropout over HTTP, natively and as V2 parameters, against a numpy reference of the same masks.

The reference re-derives each pass's mask from the same torch.Generator seed (torch.bernoulli
over the hidden layer's shape, as the server draws them) and applies it in float64 numpy to
an independently computed hidden layer: mean and Bessel-corrected std over the passes.
"""

from __future__ import annotations

import asyncio
import io
import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
import pytest_asyncio
import torch
import tritonclient.http as triton

from app.config.settings import ModelSpec, Settings
from ffn_core import FFNConfig, build_ffn, save_ffn
from ffn_testing import ServerProcess
from tests.in_process import InProcessApp, serve_in_process
from tests.reference import assert_close, demo_weights, numpy_ffn, numpy_hidden, numpy_weights

D_MODEL, D_FF = 16, 64
FILE_RATE = 0.25
URL = "/v1/models/mc/transform"


def reference(
    x: np.ndarray,
    weights: dict[str, np.ndarray],
    activation: str,
    *,
    passes: int,
    p: float,
    seed: int,
    device: str = "cpu",
) -> tuple[np.ndarray, np.ndarray]:
    """Mean and std over `passes` masked passes, the masks drawn as the server draws them, in float64.

    `device`: the served model's; the masks come from a generator there (CUDA draws other bits).
    """
    shape = x.shape
    hidden = numpy_hidden(x.reshape(-1, shape[-1]), weights, activation)  # (rows, d_ff)
    generator = torch.Generator(device=device).manual_seed(seed)
    # float32, as torch.full_like over the server's float32 hidden layer
    keep_probs = torch.full(hidden.shape, 1.0 - p, device=device)
    outputs = []
    for _ in range(passes):
        mask = torch.bernoulli(keep_probs, generator=generator).double().cpu().numpy()
        outputs.append((hidden * mask / (1.0 - p)) @ weights["layer2.weight"].T + weights["layer2.bias"])
    stacked = np.stack(outputs)
    return stacked.mean(axis=0).reshape(shape), stacked.std(axis=0, ddof=1).reshape(shape)


def inputs(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("mc")
    torch.manual_seed(0)
    rated = build_ffn(FFNConfig(D_MODEL, D_FF, "gelu", gated=True, dropout=FILE_RATE))
    unrated = build_ffn(FFNConfig(D_MODEL, D_FF, "relu"))
    save_ffn(rated, folder / "rated.safetensors")
    save_ffn(unrated, folder / "unrated.safetensors")
    return {"rated": folder / "rated.safetensors", "unrated": folder / "unrated.safetensors"}


@pytest.fixture(scope="module")
def weights(files: dict[str, Path]) -> dict[str, np.ndarray]:
    from ffn_core import load_ffn

    return numpy_weights(load_ffn(files["rated"]))


# One in-process app for the file, on the module's event loop (the tests marked so run there): the
# tests only send requests (the statistics test counts what moved).
in_module_loop = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def service(files: dict[str, Path]) -> AsyncIterator[InProcessApp]:
    settings = Settings(
        max_batch_rows=32,
        max_mc_passes=64,
        warmup=False,
        models=[
            ModelSpec(name="mc", weights=files["rated"]),
            ModelSpec(name="unrated", weights=files["unrated"]),
        ],
    )
    async with serve_in_process(settings) as app:
        yield app


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def device(service: InProcessApp) -> str:
    """Where the model runs (auto: CUDA where there is one)."""
    return (await service.client.get("/v1/models")).json()["models"][0]["device"]


@pytest.fixture
def expected(weights, device: str):
    """expected(x, passes=, seed=[, p=]) -> the reference mean and std for the `mc` model."""
    return lambda x, **asked: reference(x, weights, "gelu", device=device, **{"p": FILE_RATE, **asked})


# ----- native ----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(4, D_MODEL), (2, 3, D_MODEL)])
@in_module_loop
async def test_native_json_is_mean_and_std_of_the_same_masks(service: InProcessApp, expected, shape) -> None:
    x = inputs(*shape)
    r = await service.client.post(f"{URL}?mc_passes=16&mc_seed=5", json={"inputs": x.tolist()})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert (answer["mc_passes"], answer["mc_dropout"], answer["mc_seed"]) == (16, FILE_RATE, 5)
    assert (r.headers["x-mc-passes"], r.headers["x-mc-dropout"], r.headers["x-mc-seed"]) == ("16", "0.25", "5")
    assert answer["shape"] == list(shape) and "outputs" not in answer
    mean, std = expected(x, passes=16, seed=5)
    assert_close(np.array(answer["mean"]), mean)
    assert_close(np.array(answer["std"]), std, rtol=1e-4)
    assert (std > 0).mean() > 0.9  # a real spread: GELU's hidden units are almost never exactly 0


@pytest.mark.parametrize("accept", ["application/octet-stream", "application/x-npy"])
@in_module_loop
async def test_native_binary_answers_stack_mean_then_std(service: InProcessApp, expected, accept: str) -> None:
    x = inputs(3, D_MODEL, seed=1)
    r = await service.client.post(
        f"{URL}?mc_passes=8&mc_seed=9&mc_dropout=0.5",
        content=x.tobytes(),
        headers={"content-type": "application/octet-stream", "x-shape": f"3,{D_MODEL}", "accept": accept},
    )
    assert r.status_code == 200, r.text
    if accept == "application/x-npy":
        stacked = np.load(io.BytesIO(r.content), allow_pickle=False)
    else:
        assert (r.headers["x-shape"], r.headers["x-dtype"]) == (f"2,3,{D_MODEL}", "float32")
        stacked = np.frombuffer(r.content, dtype="<f4").reshape(2, 3, D_MODEL)
    assert stacked.shape == (2, 3, D_MODEL)
    mean, std = expected(x, passes=8, seed=9, p=0.5)
    assert_close(stacked[0], mean)
    assert_close(stacked[1], std, rtol=1e-4)


@in_module_loop
async def test_a_drawn_seed_is_answered_and_repeats_the_answer(service: InProcessApp, expected) -> None:
    x = inputs(2, D_MODEL, seed=2)
    first = await service.client.post(f"{URL}?mc_passes=4", json={"inputs": x.tolist()})
    seed = first.json()["mc_seed"]
    again = await service.client.post(f"{URL}?mc_passes=4&mc_seed={seed}", json={"inputs": x.tolist()})
    assert again.content == first.content
    other = await service.client.post(f"{URL}?mc_passes=4&mc_seed={seed ^ 1}", json={"inputs": x.tolist()})
    assert other.json()["std"] != first.json()["std"]
    mean, _ = expected(x, passes=4, seed=seed)
    assert_close(np.array(first.json()["mean"]), mean)


@in_module_loop
async def test_without_query_string_the_answer_is_the_plain_ffn(service: InProcessApp, weights) -> None:
    x = inputs(2, D_MODEL, seed=3)
    r = await service.client.post(URL, json={"inputs": x.tolist()})
    assert set(r.json()) == {"model", "shape", "dtype", "outputs"} and "x-mc-seed" not in r.headers
    assert_close(np.array(r.json()["outputs"]), numpy_ffn(x, weights, "gelu"))


@pytest.mark.parametrize(
    ("query", "needle"),
    [
        ("mc_passes=1", "'mc_passes' must be an integer in [2, 64]"),
        ("mc_passes=65", "'mc_passes' must be an integer in [2, 64]"),
        ("mc_passes=four", "'mc_passes' must be an integer"),
        ("mc_passes=", "'mc_passes' must be an integer"),
        ("mc_passes=%E2%91%A3", "'mc_passes' must be an integer"),  # ④: a digit to str.isdigit, not to us
        ("mc_passes=%D9%A3", "'mc_passes' must be an integer"),  # Arabic-Indic three
        ("mc_passes=%204", "'mc_passes' must be an integer"),  # a space is not part of a number
        ("mc_passes=1_0", "'mc_passes' must be an integer"),
        ("mc_seed=3", "mc_seed applies only to Monte Carlo dropout requests"),
        ("mc_dropout=0.1", "mc_dropout applies only"),
        ("mc_passes=4&mc_passes=5", "given twice"),
        ("mc_passes=4&normalize=true", "unknown query parameter 'normalize'"),
        ("mc_passes=4&mc_dropout=1", "mc_dropout must be a number in [0, 1)"),
        ("mc_passes=4&mc_dropout=nan", "'mc_dropout' must be a finite decimal number"),
        ("mc_passes=4&mc_dropout=%D9%A0.1", "'mc_dropout' must be a finite decimal number"),
        ("mc_passes=4&mc_dropout=0_1", "'mc_dropout' must be a finite decimal number"),
        ("mc_passes=4&mc_dropout=%200.1", "'mc_dropout' must be a finite decimal number"),
        ("mc_passes=4&mc_seed=-1", "'mc_seed' must be an integer in [0, 9223372036854775807]"),
        ("mc_passes=4&mc_seed=9223372036854775808", "'mc_seed' must be an integer"),
        ("mc_passes", "malformed query string"),
    ],
)
@in_module_loop
async def test_bad_monte_carlo_queries_are_400(service: InProcessApp, query: str, needle: str) -> None:
    r = await service.client.post(f"{URL}?{query}", json={"inputs": inputs(1, D_MODEL).tolist()})
    assert r.status_code == 400, r.text
    assert r.json()["error_type"] == "invalid_input" and needle in r.json()["error"], r.text


@in_module_loop
async def test_a_model_without_a_rate_needs_one_in_the_request(service: InProcessApp) -> None:
    body = {"inputs": inputs(1, D_MODEL).tolist()}
    r = await service.client.post("/v1/models/unrated/transform?mc_passes=4", json=body)
    assert r.status_code == 400 and "has no dropout rate" in r.json()["error"], r.text
    r = await service.client.post("/v1/models/unrated/transform?mc_passes=4&mc_dropout=0.1", json=body)
    assert r.status_code == 200 and r.json()["mc_dropout"] == 0.1


@pytest.mark.parametrize("accept", ["application/json", "application/octet-stream"])
@in_module_loop
async def test_an_output_that_overflows_is_422_in_every_encoding(service: InProcessApp, files, accept: str) -> None:
    from ffn_core import load_ffn

    w = numpy_weights(load_ffn(files["unrated"]))
    x = np.full((1, D_MODEL), 3e38, dtype=np.float32)  # finite inputs
    # At rate 0.9 the kept hidden values are scaled by 10: dozens of them pass float32's range.
    assert (np.abs(numpy_hidden(x, w)) / 0.1 > np.finfo(np.float32).max).sum() >= 16
    r = await service.client.post(
        "/v1/models/unrated/transform?mc_passes=2&mc_dropout=0.9&mc_seed=1",
        json={"inputs": x.tolist()},
        headers={"accept": accept},
    )
    assert r.status_code == 422 and r.json()["error_type"] == "non_finite_output", r.text


@in_module_loop
async def test_more_rows_than_one_forward_pass_is_413(service: InProcessApp) -> None:
    r = await service.client.post(f"{URL}?mc_passes=2", json={"inputs": inputs(33, D_MODEL).tolist()})
    assert r.status_code == 413 and "at most 32 rows" in r.json()["error"], r.text


async def test_turned_off_with_max_mc_passes_zero(files) -> None:
    settings = Settings(max_mc_passes=0, warmup=False, models=[ModelSpec(name="mc", weights=files["rated"])])
    async with serve_in_process(settings) as app:
        r = await app.client.post(f"{URL}?mc_passes=2", json={"inputs": inputs(1, D_MODEL).tolist()})
    assert r.status_code == 400 and "turned off" in r.json()["error"], r.text


@in_module_loop
async def test_never_batched_with_plain_requests(service: InProcessApp, weights, expected) -> None:
    """Plain and Monte Carlo requests sent at once: each answer is its own, exactly."""
    client = service.client
    xs = [inputs(3, D_MODEL, seed=10 + i) for i in range(12)]

    async def send(i: int) -> tuple[int, httpx.Response]:
        query = f"?mc_passes=6&mc_seed={i}" if i % 3 == 0 else ""
        return i, await client.post(URL + query, json={"inputs": xs[i].tolist()})

    for i, r in await asyncio.gather(*(send(i) for i in range(12))):
        assert r.status_code == 200, r.text
        if i % 3 == 0:
            mean, std = expected(xs[i], passes=6, seed=i)
            assert_close(np.array(r.json()["mean"]), mean)
            assert_close(np.array(r.json()["std"]), std, rtol=1e-4)
        else:
            assert_close(np.array(r.json()["outputs"]), numpy_ffn(xs[i], weights, "gelu"))


@in_module_loop
async def test_counted_in_the_statistics_as_one_execution(service: InProcessApp) -> None:
    async def counts() -> tuple[int, int, int, int]:
        (stat,) = (await service.client.get("/v2/models/mc/stats")).json()["model_stats"]
        inference = stat["inference_stats"]
        return (
            stat["execution_count"],
            stat["inference_count"],
            inference["success"]["count"],
            inference["compute_infer"]["count"],
        )

    before = await counts()
    r = await service.client.post(f"{URL}?mc_passes=5", json={"inputs": inputs(4, D_MODEL).tolist()})
    assert r.status_code == 200
    moved = tuple(now - then for now, then in zip(await counts(), before, strict=True))
    assert moved == (1, 4, 1, 1)  # executions, rows, successes, forward passes: 5 passes are one execution


# ----- V2 --------------------------------------------------------------------------------------


def v2_document(x: np.ndarray, parameters: dict, outputs: list | None = None) -> dict:
    document = {
        "inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}],
        "parameters": parameters,
    }
    if outputs is not None:
        document["outputs"] = outputs
    return document


@in_module_loop
async def test_v2_outputs_are_output_and_output_std(service: InProcessApp, expected) -> None:
    x = inputs(2, 2, D_MODEL, seed=4)
    r = await service.client.post("/v2/models/mc/infer", json=v2_document(x, {"mc_passes": 12, "mc_seed": 3}))
    assert r.status_code == 200, r.text
    answer = r.json()
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", answer["parameters"].pop("model_digest")), "which weights answered"
    assert answer["parameters"] == {"mc_passes": 12, "mc_dropout": FILE_RATE, "mc_seed": 3}
    by_name = {o["name"]: o for o in answer["outputs"]}
    assert list(by_name) == ["output", "output_std"]
    assert all(o["shape"] == [2, 2, D_MODEL] and o["datatype"] == "FP32" for o in by_name.values())
    mean, std = expected(x, passes=12, seed=3)
    assert_close(np.array(by_name["output"]["data"]).reshape(x.shape), mean)
    assert_close(np.array(by_name["output_std"]["data"]).reshape(x.shape), std, rtol=1e-4)


@in_module_loop
async def test_v2_binary_output_std_alone(service: InProcessApp, expected) -> None:
    x = inputs(3, D_MODEL, seed=6)
    document = v2_document(
        x,
        {"mc_passes": 5, "mc_seed": 8, "mc_dropout": 0.1},
        outputs=[{"name": "output_std", "parameters": {"binary_data": True}}],
    )
    r = await service.client.post("/v2/models/mc/infer", json=document)
    assert r.status_code == 200, r.text
    length = int(r.headers["inference-header-content-length"])
    header = orjson.loads(r.content[:length])
    assert [o["name"] for o in header["outputs"]] == ["output_std"]
    _, std = expected(x, passes=5, seed=8, p=0.1)
    assert_close(np.frombuffer(r.content[length:], dtype="<f4").reshape(x.shape), std, rtol=1e-4)


@pytest.mark.parametrize(
    ("parameters", "needle"),
    [
        ({"mc_passes": 2.5}, "'mc_passes' must be an integer"),
        ({"mc_passes": True}, "'mc_passes' must be an integer"),
        ({"mc_passes": "3"}, "'mc_passes' must be an integer, got the string '3'"),  # as strict as 'timeout'
        ({"mc_passes": 100}, "'mc_passes' must be an integer in [2, 64]"),
        ({"mc_seed": 4}, "add mc_passes"),
        ({"mc_passes": None, "mc_seed": 4}, "add mc_passes"),
        ({"mc_passes": 4, "mc_seed": "4"}, "'mc_seed' must be an integer"),
        ({"mc_passes": 4, "mc_dropout": "lots"}, "'mc_dropout' must be a finite number"),
        ({"mc_passes": 4, "mc_dropout": "0.1"}, "'mc_dropout' must be a finite number"),
        ({"mc_passes": 4, "mc_dropout": -0.1}, "'mc_dropout' must be a finite number in [0.0, 1.0]"),
        ({"mc_passes": 4, "mc_dropout": 1.0}, "mc_dropout must be a number in [0, 1)"),
    ],
)
@in_module_loop
async def test_v2_bad_parameters_are_400(service: InProcessApp, parameters: dict, needle: str) -> None:
    r = await service.client.post("/v2/models/mc/infer", json=v2_document(inputs(1, D_MODEL), parameters))
    assert r.status_code == 400 and needle in r.json()["error"], r.text


@pytest.mark.parametrize("parameters", [{}, {"mc_passes": None}], ids=["none", "null"])
@in_module_loop
async def test_v2_plain_answer_has_no_parameters(service: InProcessApp, weights, parameters: dict) -> None:
    """A null mc_passes is no mc_passes: one test decides "is this Monte Carlo", in the decoder and the route alike."""
    x = inputs(1, D_MODEL)
    r = await service.client.post("/v2/models/mc/infer", json=v2_document(x, parameters))
    assert r.status_code == 200, r.text
    assert list(r.json()["parameters"]) == ["model_digest"], "no Monte Carlo parameters: only the weights' digest"
    assert [o["name"] for o in r.json()["outputs"]] == ["output"]
    assert_close(np.array(r.json()["outputs"][0]["data"]).reshape(x.shape), numpy_ffn(x, weights, "gelu"))


# ----- a real server and NVIDIA's tritonclient -------------------------------------------------


@pytest.mark.parametrize("binary", [False, True])
def test_tritonclient_asks_with_parameters(demo_server: ServerProcess, binary: bool) -> None:
    x = inputs(3, 512, seed=7)
    client = triton.InferenceServerClient(demo_server.url.removeprefix("http://"))
    try:
        tensor = triton.InferInput("input", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x, binary_data=binary)
        result = client.infer(
            "demo",
            [tensor],
            parameters={"mc_passes": 8, "mc_seed": 21, "mc_dropout": 0.2},
            outputs=[triton.InferRequestedOutput(name, binary_data=binary) for name in ("output", "output_std")],
        )
    finally:
        client.close()
    echoed = result.get_response()["parameters"]
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", echoed.pop("model_digest")), "which weights answered"
    assert echoed == {"mc_passes": 8, "mc_dropout": 0.2, "mc_seed": 21}
    device = httpx.get(f"{demo_server.url}/v1/models").json()["models"][0]["device"]
    mean, std = reference(x, demo_weights(), "relu", passes=8, p=0.2, seed=21, device=device)
    assert_close(result.as_numpy("output"), mean)
    assert_close(result.as_numpy("output_std"), std, rtol=1e-4)
