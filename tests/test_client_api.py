"""Every route of the HTTP API through ffn_client, sync and async, against a real ffn-serve process.

Monte Carlo dropout in all five encodings, the server and model metadata, the model
configuration, statistics, the repository index and a model's readiness; values checked against
numpy (tests/reference.py), the config the server was given, and arithmetic written here.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from ffn_client import AsyncClient, BadRequest, Client, ModelNotFound, MonteCarloResult
from ffn_client import encodings as enc
from ffn_core import FFNConfig, build_ffn, save_ffn
from ffn_testing import ServerProcess, start_server
from tests.reference import assert_close, demo_reference, numpy_ffn, numpy_weights

DEMO_RATE = 0.1  # the [[models]] table's dropout for demo
SMALL = FFNConfig(d_model=8, d_ff=24, activation="gelu")
MAX_BATCH_ROWS = 256


@pytest.fixture(scope="module")
def small_weights(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("client-api") / "small.safetensors"
    model = build_ffn(SMALL)
    save_ffn(model, path)
    return path, numpy_weights(model)


@pytest.fixture(scope="module")
def server(small_weights: tuple[Path, dict[str, np.ndarray]]) -> Iterator[ServerProcess]:
    path, _ = small_weights
    config = path.with_name("ffn.toml")
    config.write_text(
        f"max_batch_rows = {MAX_BATCH_ROWS}\nwarmup = false\n\n"
        f'[[models]]\nname = "demo"\ndropout = {DEMO_RATE}\n\n'
        f'[[models]]\nname = "small"\nweights = "{path.name}"\n'
    )
    with start_server(config=config, env={"FFN_LOG_LEVEL": "warning"}) as process:
        yield process


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[Client]:
    with Client(server.url, max_retries=0) as c:
        yield c


def rows(n: int, d_model: int = 512, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, d_model)).astype(np.float32)


# -- Monte Carlo dropout --------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", enc.ENCODINGS)
def test_monte_carlo_in_every_encoding(client: Client, encoding: str) -> None:
    x = rows(2 * 3).reshape(2, 3, 512)  # [batch, seq, d_model] comes back in that shape
    result = client.monte_carlo("demo", x, 16, seed=7, dropout=0.01, encoding=encoding)
    assert isinstance(result, MonteCarloResult)
    assert result.mean.shape == result.std.shape == (2, 3, 512)
    assert (result.passes, result.dropout, result.seed) == (16, 0.01, 7)  # echoed by the server
    assert (result.std >= 0).all() and (result.std > 0).any()
    again = client.monte_carlo("demo", x, 16, seed=7, dropout=0.01, encoding=encoding)
    np.testing.assert_array_equal(again.mean, result.mean)  # the same seed: the same masks
    np.testing.assert_array_equal(again.std, result.std)
    other = client.monte_carlo("demo", x, 16, seed=8, dropout=0.01, encoding=encoding)
    assert not np.array_equal(other.mean, result.mean)


def test_monte_carlo_mean_is_near_the_plain_output_for_a_small_dropout(client: Client) -> None:
    x = rows(6)
    result = client.monte_carlo("demo", x, 64, seed=5, dropout=0.01)
    # Each of the 2048 hidden units dropped once in 100 passes; 64 passes average that out to
    # about 1% of the largest output (seeds 0 to 4 give 1.1 to 1.3%): 5% holds with margin.
    assert_close(result.mean, demo_reference(x), rtol=0.05)


def test_monte_carlo_without_dropout_is_the_plain_output_with_no_spread(client: Client) -> None:
    x = rows(4)
    for encoding in ("binary", "v2-json"):
        result = client.monte_carlo("demo", x, 3, dropout=0.0, encoding=encoding)
        assert_close(result.mean, demo_reference(x), rtol=1e-5)
        assert result.std.max() <= 1e-6 * np.abs(result.mean).max()


def test_monte_carlo_uses_the_models_rate_and_draws_a_seed(client: Client) -> None:
    result = client.monte_carlo("demo", rows(2), 4, encoding="v2-binary")
    assert (result.passes, result.dropout) == (4, DEMO_RATE)
    assert 0 <= result.seed < 2**63
    repeated = client.monte_carlo("demo", rows(2), 4, seed=result.seed, encoding="json")
    assert_close(repeated.mean, result.mean.astype(np.float64))  # the answered seed repeats it, in any encoding


def test_monte_carlo_refusals_are_typed_errors(client: Client) -> None:
    with pytest.raises(BadRequest, match="mc_passes"):
        client.monte_carlo("demo", rows(1), 1)  # at least 2 passes
    with pytest.raises(BadRequest, match="has no dropout rate"):  # none in its table or its file
        client.monte_carlo("small", rows(1, 8), 4, encoding="v2-json")
    with pytest.raises(ModelNotFound):
        client.monte_carlo("nope", rows(1), 4)


# -- metadata, configuration, statistics, index, readiness ----------------------------------------


def test_server_metadata(client: Client) -> None:
    assert client.server_metadata() == {
        "name": "ffn-serve",
        "version": importlib.metadata.version("ffn-serve"),
        "extensions": ["binary_tensor_data", "model_configuration", "statistics", "parameters", "trace", "logging"],
    }


def test_model_metadata_and_configuration(client: Client) -> None:
    meta = client.metadata("small")
    assert meta["name"] == "small" and meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, SMALL.d_model]}]
    assert meta["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, SMALL.d_model]}]
    config = client.model_config("small")
    assert (config["name"], config["max_batch_size"]) == ("small", MAX_BATCH_ROWS)
    assert config["input"][0]["dims"] == [SMALL.d_model] and config["output"][0]["dims"] == [SMALL.d_model]
    assert config["parameters"]["d_ff"] == {"string_value": str(SMALL.d_ff)}
    assert config["parameters"]["activation"] == {"string_value": "gelu"}
    assert client.model_config("demo")["parameters"]["dropout"] == {"string_value": str(DEMO_RATE)}
    with pytest.raises(ModelNotFound):
        client.model_config("nope")


def test_statistics_count_the_rows_and_passes_sent(
    client: Client, small_weights: tuple[Path, dict[str, np.ndarray]]
) -> None:
    _, weights = small_weights
    before = client.statistics("small")[0]
    sent = [3, 1, 5]
    for i, n in enumerate(sent):  # one at a time: each is a forward pass of its own
        x = rows(n, SMALL.d_model, seed=i)
        assert_close(client.transform("small", x), numpy_ffn(x, weights, "gelu"))
    [after] = client.statistics("small")
    assert (after["name"], after["version"]) == ("small", "1")
    assert after["inference_count"] - before["inference_count"] == sum(sent)
    assert after["execution_count"] - before["execution_count"] == len(sent)
    success = after["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"]
    assert success == len(sent)
    assert {s["name"] for s in client.statistics()} == {"demo", "small"}


def test_repository_index_and_model_readiness(client: Client) -> None:
    listed = {m["name"]: m["digest"] for m in client.models()}
    expected = [
        {"name": name, "version": "1", "state": "READY", "reason": "", "digest": listed[name]}
        for name in ("demo", "small")
    ]
    assert sorted(client.repository_index(), key=lambda m: m["name"]) == expected
    assert sorted(client.repository_index(ready_only=True), key=lambda m: m["name"]) == expected
    assert client.model_ready("demo") and client.model_ready("small")
    with pytest.raises(ModelNotFound):
        client.model_ready("nope")


async def test_the_async_client_answers_as_the_sync_one(client: Client, server: ServerProcess) -> None:
    x = rows(3)
    async with AsyncClient(server.url, max_retries=0) as aclient:
        answers = await asyncio.gather(
            aclient.monte_carlo("demo", x, 8, seed=11, encoding="v2-binary"),
            aclient.server_metadata(),
            aclient.metadata("demo"),
            aclient.model_config("small"),
            aclient.repository_index(),
            aclient.model_ready("small"),
            aclient.models(),
            aclient.statistics(),
        )
    mc, server_meta, meta, config, index, ready, models, stats = answers
    expected = client.monte_carlo("demo", x, 8, seed=11, encoding="v2-binary")
    np.testing.assert_array_equal(mc.mean, expected.mean)
    np.testing.assert_array_equal(mc.std, expected.std)
    assert (mc.passes, mc.dropout, mc.seed) == (8, DEMO_RATE, 11)
    assert server_meta == client.server_metadata() and meta == client.metadata("demo")
    assert config == client.model_config("small") and ready is True
    assert sorted(index, key=lambda m: m["name"]) == sorted(client.repository_index(), key=lambda m: m["name"])
    assert {m["name"] for m in models} == {"demo", "small"} and {s["name"] for s in stats} == {"demo", "small"}
