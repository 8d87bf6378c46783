"""Every public method of tritonclient's gRPC InferenceServerClient against a real ffn-serve, with and without a key.

Each one either works, with its answer checked, or raises an InferenceServerException whose
status is UNIMPLEMENTED and whose message names the extension this server does not implement
(the gRPC twin of the HTTP table's 400, as Triton answers an unsupported request). The table
covers exactly the client's public methods (a new tritonclient method fails the test until it
is placed), and docs/api.md's gRPC table must say the same.

Two servers: one with an API key, reached through a plugin that adds the `authorization`
metadata (which puts the plugin methods to work), and one without. Against the first, every
method that calls the server fails UNAUTHENTICATED without the key. Both run with
model_control = explicit, so that load_model and unload_model work; with the default (none) they
are refused naming the setting.
"""

from __future__ import annotations

import inspect
import json
import queue
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.utils.shared_memory as shm
from tritonclient._plugin import InferenceServerClientPlugin
from tritonclient.utils import InferenceServerException

from bench.otlp_receiver import OtlpReceiver
from ffn_client.encodings import as_wire_values
from ffn_testing import ServerProcess, start_server
from tests.model_files import add_table, matches, write_ffn
from tests.reference import demo_reference

KEY = "tritonclient-grpc-key"
D = 512
DOCS = Path(__file__).resolve().parents[1] / "docs" / "api.md"
Client = triton.InferenceServerClient


class Bearer(InferenceServerClientPlugin):
    """Adds the API key to every call the client makes."""

    def __call__(self, request: Any) -> None:
        request.headers["authorization"] = f"Bearer {KEY}"


EXTRA: dict[str, np.ndarray] = {}  # the weights of extra.safetensors, which load_model loads


@pytest.fixture(scope="module", params=["key", "no key"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # The config file's folder is the model repository: `demo` configured, extra.safetensors there to load.
    folder = tmp_path_factory.mktemp("grpc-repository")
    (folder / "ffn.toml").write_text('model_control = "explicit"\n\n[[models]]\nname = "demo"\n')
    EXTRA.update(write_ffn(folder / "extra.safetensors", 7, d_model=16))
    # Traced to a real OTLP receiver, so that the trace settings it is given take effect.
    with OtlpReceiver() as receiver:
        env = {"FFN_LOG_LEVEL": "warning", "FFN_OTLP_ENDPOINT": receiver.url, "FFN_SHARED_MEMORY": "true"}
        env |= {"FFN_API_KEY": KEY} if request.param == "key" else {}
        with start_server(env=env, config=folder / "ffn.toml") as srv:
            srv.keyed = request.param == "key"  # type: ignore[attr-defined]
            srv.repository = folder  # type: ignore[attr-defined]
            yield srv


def new_client(server: ServerProcess, *, authorized: bool = True) -> Client:
    client = Client(server.grpc_target)
    if authorized and server.keyed:  # type: ignore[attr-defined]
        client.register_plugin(Bearer())
    return client


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[Client]:
    c = new_client(server)
    yield c
    c.close()


def rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, D)).astype(np.float32)


def input_tensor(x: np.ndarray, datatype: str = "FP32") -> triton.InferInput:
    tensor = triton.InferInput("input", list(x.shape), datatype)
    wire = {"FP32": np.float32, "FP16": np.float16, "BF16": ml_dtypes.bfloat16}[datatype]
    tensor.set_data_from_numpy(x.astype(wire))
    return tensor


def assert_demo_answer(y: np.ndarray, x: np.ndarray, dtype: str = "float32") -> None:
    """y against the float64 reference of x as the server saw it, to the wire dtype's precision."""
    assert y.shape == x.shape
    seen = as_wire_values(x, dtype).astype(np.float64)
    tolerance = {"float32": 1e-5, "float16": 2e-2, "bfloat16": 1e-1}[dtype]
    np.testing.assert_allclose(y.astype(np.float64), demo_reference(seen), rtol=tolerance, atol=tolerance)


# ----- the methods that work, each with its answer checked ------------------------------------


def check_infer(client: Client, server: ServerProcess) -> None:
    for datatype, dtype in (("FP32", "float32"), ("FP16", "float16"), ("BF16", "bfloat16")):
        x = rows(4, 1)
        result = client.infer(
            "demo",
            [input_tensor(x, datatype)],
            request_id=f"t-{datatype}",
            outputs=[triton.InferRequestedOutput("output")],
        )
        response = result.get_response()
        assert response.id == f"t-{datatype}" and response.outputs[0].datatype == datatype
        assert_demo_answer(result.as_numpy("output").astype(np.float32), x, dtype)
    x3 = rows(6, 2).reshape(2, 3, D)  # [batch, seq, d_model] keeps its shape
    assert_demo_answer(client.infer("demo", [input_tensor(x3)], model_version="1").as_numpy("output"), x3)


def check_async_infer(client: Client, server: ServerProcess) -> None:
    x = rows(3, 3)
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.async_infer("demo", [input_tensor(x)], lambda result, error: answers.put((result, error)))
    result, error = answers.get(timeout=60)
    assert error is None
    assert_demo_answer(result.as_numpy("output"), x)


def check_stream(client: Client, server: ServerProcess) -> None:
    """start_stream, async_stream_infer, stop_stream: three requests on one stream, answered by id."""
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    sent = {f"s{k}": rows(k + 1, 10 + k) for k in range(3)}
    for request_id, x in sent.items():
        client.async_stream_infer("demo", [input_tensor(x)], request_id=request_id)
    got = {}
    for _ in sent:
        result, error = answers.get(timeout=60)
        assert error is None, error
        got[result.get_response().id] = result.as_numpy("output")
    client.stop_stream()
    assert set(got) == set(sent)
    for request_id, x in sent.items():
        assert_demo_answer(got[request_id], x)


def check_metadata(client: Client, server: ServerProcess) -> None:
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "ffn-serve"
    assert meta["extensions"] == [
        "binary_tensor_data",
        "model_configuration",
        "statistics",
        "parameters",
        "trace",
        "logging",
        "system_shared_memory",
        "model_repository",
    ]


def check_model_metadata(client: Client, server: ServerProcess) -> None:
    meta = client.get_model_metadata("demo", model_version="1", as_json=True)
    assert meta["versions"] == ["1"] and meta["platform"] == "pytorch_ffn"
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": ["-1", str(D)]}]  # int64 as JSON text
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("demo", model_version="2")
    assert info.value.status() == "StatusCode.NOT_FOUND"


def check_model_config(client: Client, server: ServerProcess) -> None:
    config = client.get_model_config("demo").config
    assert config.name == "demo" and config.max_batch_size == 1024
    assert list(config.input[0].dims) == [D] and config.input[0].data_type == triton.model_config_pb2.TYPE_FP32
    assert config.dynamic_batching.default_queue_policy.default_timeout_microseconds == 30_000_000
    assert config.parameters["d_ff"].string_value == "2048"
    assert client.get_model_config("demo", model_version="1").config == config


def check_statistics(client: Client, server: ServerProcess) -> None:
    before = client.get_inference_statistics("demo").model_stats[0]
    client.infer("demo", [input_tensor(rows(5, 4))])
    (after,) = client.get_inference_statistics("demo", model_version="1").model_stats
    assert after.name == "demo" and after.version == "1"
    assert after.inference_count - before.inference_count == 5
    assert after.inference_stats.success.count - before.inference_stats.success.count == 1
    assert after.memory_usage[0].byte_size > 0
    assert [s.name for s in client.get_inference_statistics().model_stats] == ["demo"]


def check_repository_index(client: Client, server: ServerProcess) -> None:
    index = client.get_model_repository_index(as_json=True)
    demo = [entry for entry in index["models"] if entry["name"] == "demo"]
    assert demo == [{"name": "demo", "version": "1", "state": "READY"}]  # an empty reason is left out


def check_load_and_unload(client: Client, server: ServerProcess) -> None:
    """A model loaded from the repository with a config, its file replaced and reloaded, refused
    loads leaving it serving, then unloaded: each step seen by the client, answers against numpy."""
    x = np.random.default_rng(8).standard_normal((3, 16)).astype(np.float32)
    # A version grows with each load: so this check may run more than once (it is listed twice).
    index = client.get_model_repository_index(as_json=True)["models"]
    last = int(next((e["version"] for e in index if e["name"] == "extra"), 0))
    add_table(server.repository / "ffn.toml", "extra", "extra.safetensors")  # type: ignore[attr-defined]
    client.load_model("extra", config=json.dumps({"weights": "extra.safetensors"}))
    assert client.is_model_ready("extra")
    result = client.infer("extra", [input_tensor(x)])
    assert matches(result.as_numpy("output"), EXTRA, x) and result.get_response().model_version == str(last + 1)

    # The operator's workflow: replace the weight file, then load (no config: the table it serves with).
    old = dict(EXTRA)
    EXTRA.clear()
    EXTRA.update(write_ffn(server.repository / "extra.safetensors", 100 + last, d_model=16))  # type: ignore[attr-defined]
    client.load_model("extra")
    result = client.infer("extra", [input_tensor(x)])
    answered = result.as_numpy("output")
    assert matches(answered, EXTRA, x) and not matches(answered, old, x)  # the new weights answer
    assert result.get_response().model_version == str(last + 2)
    assert client.get_model_metadata("extra").versions == [str(last + 2)]

    for refused in ({"config": json.dumps({"weights": "../ffn.toml"})}, {"files": {"file:1/m.bin": b"x"}}):
        with pytest.raises(InferenceServerException) as info:
            client.load_model("extra", **refused)
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT", info.value.message()
    # The failed loads left the copy serving: the same version, the same answers.
    assert client.get_model_metadata("extra").versions == [str(last + 2)]
    assert matches(client.infer("extra", [input_tensor(x)]).as_numpy("output"), EXTRA, x)

    client.unload_model("extra")
    assert client.is_model_ready("extra") is False
    with pytest.raises(InferenceServerException) as gone:
        client.infer("extra", [input_tensor(x)])
    assert gone.value.status() == "StatusCode.NOT_FOUND" and "is unloaded" in gone.value.message()
    index = client.get_model_repository_index(as_json=True)["models"]
    (entry,) = [e for e in index if e["name"] == "extra"]
    assert entry == {"name": "extra", "version": str(last + 2), "state": "UNAVAILABLE", "reason": "unloaded"}


def check_health(client: Client, server: ServerProcess) -> None:
    assert client.is_server_live() is True and client.is_server_ready() is True
    assert client.is_model_ready("demo") is True and client.is_model_ready("demo", "1") is True
    assert client.is_model_ready("no-such-model") is False and client.is_model_ready("demo", "2") is False


def check_cuda_shared_memory(client: Client, server: ServerProcess) -> None:
    """No CUDA region is ever registered: none listed, a named one NOT_FOUND, unregistering done (perf_analyzer's)."""
    assert client.get_cuda_shared_memory_status(as_json=True) == {}
    assert len(client.get_cuda_shared_memory_status().regions) == 0
    with pytest.raises(InferenceServerException) as info:
        client.get_cuda_shared_memory_status("r")
    assert info.value.status() == "StatusCode.NOT_FOUND"
    assert "no cuda shared memory region named 'r' is registered" in info.value.message()
    client.unregister_cuda_shared_memory()  # all of them, as perf_analyzer's clean-up does
    client.unregister_cuda_shared_memory("r")
    assert client.get_cuda_shared_memory_status(as_json=True) == {}


def check_plugins(client: Client, server: ServerProcess) -> None:
    """Registered, the plugin's metadata is sent; unregistered, it is not (a keyed server then refuses)."""
    fresh = Client(server.grpc_target)
    try:
        assert fresh.plugin() is None
        plugin = Bearer()
        fresh.register_plugin(plugin)
        assert fresh.plugin() is plugin
        assert fresh.get_server_metadata().name == "ffn-serve"
        fresh.unregister_plugin()
        assert fresh.plugin() is None
        if server.keyed:  # type: ignore[attr-defined]
            with pytest.raises(InferenceServerException) as info:
                fresh.get_server_metadata()
            assert info.value.status() == "StatusCode.UNAUTHENTICATED"
    finally:
        fresh.close()


def check_close(client: Client, server: ServerProcess) -> None:
    fresh = new_client(server)
    assert fresh.is_server_live()
    fresh.close()
    fresh.close()  # twice is harmless
    with pytest.raises(ValueError, match="closed"):
        fresh.is_server_live()


def check_trace_settings(client: Client, server: ServerProcess) -> None:
    """TraceSetting, the twin of /v2/trace/setting: the server's, a model's over them, an empty value clearing one."""

    def settings(answer: Any) -> dict[str, list[str]]:
        return {key: list(value.value) for key, value in answer.settings.items()}

    defaults = {
        "trace_level": ["TIMESTAMPS"],
        "trace_rate": ["1"],
        "trace_count": ["-1"],
        "log_frequency": ["0"],
        "trace_mode": ["opentelemetry"],
    }
    assert settings(client.get_trace_settings()) == defaults
    try:
        changed = settings(client.update_trace_settings(settings={"trace_rate": "2", "trace_count": "5"}))
        assert changed == {**defaults, "trace_rate": ["2"], "trace_count": ["5"]}
        assert settings(client.get_trace_settings(model_name="demo")) == changed  # the model follows the server
        off = settings(client.update_trace_settings(model_name="demo", settings={"trace_level": ["OFF"]}))
        assert off == {**changed, "trace_level": ["OFF"]}
        assert settings(client.get_trace_settings())["trace_level"] == ["TIMESTAMPS"]
        assert settings(client.update_trace_settings(model_name="demo", settings={"trace_level": None})) == changed
        with pytest.raises(InferenceServerException, match="unknown trace setting 'trace_speed'") as info:
            client.update_trace_settings(settings={"trace_speed": "9"})
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    finally:
        cleared = client.update_trace_settings(settings=dict.fromkeys(["trace_rate", "trace_count"]))
    assert settings(cleared) == defaults


def check_log_settings(client: Client, server: ServerProcess) -> None:
    """LogSettings, the twin of /v2/logging: each setting in its own type, a change in every worker."""

    def settings(answer: Any) -> dict[str, Any]:
        return {key: getattr(value, value.WhichOneof("parameter_choice")) for key, value in answer.settings.items()}

    before = settings(client.get_log_settings())
    assert before == {
        "log_file": "",
        "log_info": False,  # the server runs at FFN_LOG_LEVEL=warning
        "log_warning": True,
        "log_error": True,
        "log_verbose_level": 0,
        "log_format": "text",
    }
    after = settings(client.update_log_settings({"log_info": True, "log_verbose_level": 2}))
    assert after == {**before, "log_info": True, "log_verbose_level": 2}
    assert settings(client.get_log_settings()) == after
    assert settings(client.update_log_settings(before)) == before
    with pytest.raises(InferenceServerException) as info:
        client.update_log_settings({"log_file": "/tmp/elsewhere.log"})
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT" and "log_file cannot be changed" in info.value.message()


def check_system_shared_memory(client: Client, server: ServerProcess) -> None:
    """Registering, listing and unregistering regions made with tritonclient's own shared-memory utilities."""
    tag = f"g{server.port}{int(server.keyed)}"  # type: ignore[attr-defined]
    handle = shm.create_shared_memory_region("in", f"/ffn_grpc_{tag}", 64)
    try:
        client.register_system_shared_memory("in", f"/ffn_grpc_{tag}", 64, offset=0)
        status = client.get_system_shared_memory_status(as_json=True)["regions"]
        assert status == {"in": {"name": "in", "key": f"/ffn_grpc_{tag}", "byte_size": "64"}}
        with pytest.raises(InferenceServerException) as info:
            client.register_system_shared_memory("in", f"/ffn_grpc_{tag}", 128)  # past the object's end
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
        client.unregister_system_shared_memory("in")
        assert client.get_system_shared_memory_status(as_json=True) == {}
        with pytest.raises(InferenceServerException) as info:
            client.get_system_shared_memory_status("in")
        assert info.value.status() == "StatusCode.NOT_FOUND"
    finally:
        client.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(handle)
    check_infer_through_shared_memory(client, tag)


def check_infer_through_shared_memory(client: Client, tag: str) -> None:
    """Tensors in regions instead of the message: the input read from one, outputs written to another."""
    x = rows(3, 21)
    handle_in = shm.create_shared_memory_region("x", f"/ffn_grpc_{tag}_in", x.nbytes)
    handle_out = shm.create_shared_memory_region("y", f"/ffn_grpc_{tag}_out", 16 + x.nbytes)
    try:
        shm.set_shared_memory_region(handle_in, [x])
        client.register_system_shared_memory("x", f"/ffn_grpc_{tag}_in", x.nbytes)
        client.register_system_shared_memory("y", f"/ffn_grpc_{tag}_out", 16 + x.nbytes)
        tensor = triton.InferInput("input", list(x.shape), "FP32")
        tensor.set_shared_memory("x", x.nbytes)
        output = triton.InferRequestedOutput("output")
        output.set_shared_memory("y", x.nbytes, offset=16)
        result = client.infer("demo", [tensor], outputs=[output])
        assert result.get_output("output").shape == list(x.shape)
        assert_demo_answer(shm.get_contents_as_numpy(handle_out, np.float32, x.shape, offset=16), x)
        # One output in a region, the other in the message: the message's entries stay in order.
        mc = {"mc_passes": 8, "mc_dropout": 0.25, "mc_seed": 5}
        outputs = [triton.InferRequestedOutput("output"), triton.InferRequestedOutput("output_std")]
        plain = client.infer("demo", [input_tensor(x)], outputs=outputs, parameters=mc)
        outputs[0].set_shared_memory("y", x.nbytes, offset=16)
        split = client.infer("demo", [tensor], outputs=outputs, parameters=mc)
        np.testing.assert_array_equal(
            shm.get_contents_as_numpy(handle_out, np.float32, x.shape, 16), plain.as_numpy("output")
        )
        np.testing.assert_array_equal(split.as_numpy("output_std"), plain.as_numpy("output_std"))
        # Refused as over HTTP: a span that does not hold the output, an input with its values too.
        small = triton.InferRequestedOutput("output")
        small.set_shared_memory("y", x.nbytes - 4)
        with pytest.raises(InferenceServerException) as info:
            client.infer("demo", [tensor], outputs=[small])
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT" and "the output needs" in info.value.message()
        both = input_tensor(x)
        both._input.parameters["shared_memory_region"].string_param = "x"
        both._input.parameters["shared_memory_byte_size"].int64_param = x.nbytes
        with pytest.raises(InferenceServerException) as info:
            client.infer("demo", [both])
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT" and "send one of them" in info.value.message()
        missing = triton.InferInput("input", list(x.shape), "FP32")
        missing.set_shared_memory("nope", x.nbytes)
        with pytest.raises(InferenceServerException) as info:
            client.infer("demo", [missing])
        assert info.value.status() == "StatusCode.NOT_FOUND" and "'nope'" in info.value.message()
    finally:
        client.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(handle_in)
        shm.destroy_shared_memory_region(handle_out)


Check = Callable[[Client, ServerProcess], None]
WORKS: dict[str, Check] = {
    "infer": check_infer,
    "async_infer": check_async_infer,
    "start_stream": check_stream,
    "async_stream_infer": check_stream,
    "stop_stream": check_stream,
    "get_server_metadata": check_metadata,
    "get_model_metadata": check_model_metadata,
    "get_model_config": check_model_config,
    "get_inference_statistics": check_statistics,
    "get_model_repository_index": check_repository_index,
    "load_model": check_load_and_unload,
    "unload_model": check_load_and_unload,
    "is_server_live": check_health,
    "is_server_ready": check_health,
    "is_model_ready": check_health,
    "register_plugin": check_plugins,
    "plugin": check_plugins,
    "unregister_plugin": check_plugins,
    "close": check_close,
    "get_trace_settings": check_trace_settings,
    "update_trace_settings": check_trace_settings,
    "get_log_settings": check_log_settings,
    "update_log_settings": check_log_settings,
    "get_system_shared_memory_status": check_system_shared_memory,
    "register_system_shared_memory": check_system_shared_memory,
    "unregister_system_shared_memory": check_system_shared_memory,
    "get_cuda_shared_memory_status": check_cuda_shared_memory,
    "unregister_cuda_shared_memory": check_cuda_shared_memory,
}

# ----- the methods of extensions this server does not implement: UNIMPLEMENTED, naming them -------

REFUSED: dict[str, tuple[Callable[[Client], Any], str]] = {
    "register_cuda_shared_memory": (
        lambda c: c.register_cuda_shared_memory("r", b"aGFuZGxl", 0, 64),
        "cuda_shared_memory",
    ),
}

# What calls the server, for the key check: every method but the client-side ones.
CLIENT_SIDE = {"register_plugin", "plugin", "unregister_plugin", "close"}


def public_methods() -> set[str]:
    return {name for name, _ in inspect.getmembers(Client, inspect.isfunction) if not name.startswith("_")}


def test_the_table_places_every_public_method_once() -> None:
    assert not set(WORKS) & set(REFUSED)
    assert set(WORKS) | set(REFUSED) == public_methods()
    assert len(public_methods()) == 29  # tritonclient 2.73: a new method must be placed in the table


@pytest.mark.parametrize("method", sorted(WORKS))
def test_method_works(client: Client, server: ServerProcess, method: str) -> None:
    WORKS[method](client, server)


@pytest.mark.parametrize("method", sorted(REFUSED))
def test_method_is_refused_naming_its_extension(client: Client, method: str) -> None:
    call, extension = REFUSED[method]
    with pytest.raises(InferenceServerException) as info:
        call(client)
    assert info.value.status() == "StatusCode.UNIMPLEMENTED"
    assert f"the {extension} extension is not supported" in info.value.message()


@pytest.mark.parametrize("call", ["load_model", "unload_model"])
def test_with_model_control_none_load_and_unload_are_refused_naming_the_setting(
    demo_server: ServerProcess, call: str
) -> None:
    client = Client(demo_server.grpc_target)
    try:
        with pytest.raises(InferenceServerException) as info:
            getattr(client, call)("demo")
    finally:
        client.close()
    assert info.value.status() == "StatusCode.UNIMPLEMENTED"  # as an extension a setting turned off
    assert "model_control = none" in info.value.message() and "--model-control explicit" in info.value.message()


def without_key_calls() -> dict[str, Callable[[Client], Any]]:
    x = rows(1, 7)
    return {
        "infer": lambda c: c.infer("demo", [input_tensor(x)]),
        "get_server_metadata": lambda c: c.get_server_metadata(),
        "get_model_metadata": lambda c: c.get_model_metadata("demo"),
        "get_model_config": lambda c: c.get_model_config("demo"),
        "get_inference_statistics": lambda c: c.get_inference_statistics(),
        "get_model_repository_index": lambda c: c.get_model_repository_index(),
        "get_trace_settings": lambda c: c.get_trace_settings(),
        "update_trace_settings": lambda c: c.update_trace_settings(settings={"trace_rate": "3"}),
        "get_log_settings": lambda c: c.get_log_settings(),
        "update_log_settings": lambda c: c.update_log_settings({"log_verbose_level": 1}),
        "get_system_shared_memory_status": lambda c: c.get_system_shared_memory_status(),
        "register_system_shared_memory": lambda c: c.register_system_shared_memory("r", "/k", 64),
        "unregister_system_shared_memory": lambda c: c.unregister_system_shared_memory(),
        "get_cuda_shared_memory_status": lambda c: c.get_cuda_shared_memory_status(),
        "unregister_cuda_shared_memory": lambda c: c.unregister_cuda_shared_memory(),
        "load_model": lambda c: c.load_model("demo"),
        "unload_model": lambda c: c.unload_model("demo"),
        **{name: call for name, (call, _) in REFUSED.items()},
    }


def test_without_the_key_every_call_is_unauthenticated(server: ServerProcess) -> None:
    if not server.keyed:  # type: ignore[attr-defined]
        pytest.skip("this server has no key")
    client = new_client(server, authorized=False)
    try:
        for name, call in without_key_calls().items():
            with pytest.raises(InferenceServerException) as info:
                call(client)
            assert info.value.status() == "StatusCode.UNAUTHENTICATED", name
            assert "missing API key" in info.value.message(), name
        # The probes are open on both doors, as Kubernetes and load balancers send no key.
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("demo")
        wrong = Client(server.grpc_target)
        with pytest.raises(InferenceServerException) as info:
            wrong.get_server_metadata(headers={"authorization": "Bearer not-the-key"})
        assert info.value.status() == "StatusCode.UNAUTHENTICATED" and "wrong API key" in info.value.message()
        wrong.close()
        # The stream too: refused as it opens, its error reaches the callback (and the stream is closed).
        answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        try:
            client.async_stream_infer("demo", [input_tensor(rows(1, 8))])
        except InferenceServerException as exc:  # the refusal came first
            assert "no longer in valid state" in exc.message()
        result, error = answers.get(timeout=60)
        assert result is None and error.status() == "StatusCode.UNAUTHENTICATED"
        client.stop_stream()
    finally:
        client.close()
    probes = {"is_server_live", "is_server_ready", "is_model_ready"}
    assert set(without_key_calls()) | {"async_infer", "start_stream", "async_stream_infer", "stop_stream"} | probes == (
        public_methods() - CLIENT_SIDE
    )


def docs_table() -> dict[str, str]:
    """docs/api.md's tritonclient.grpc table: method -> "works" or the extension it names."""
    text = DOCS.read_text()
    start, end = "<!-- tritonclient-grpc-table:start -->", "<!-- tritonclient-grpc-table:end -->"
    table = text[text.index(start) : text.index(end)]
    found = {}
    for method, verdict in re.findall(r"^\| `(\w+)` \| (.+?) \|", table, flags=re.MULTILINE):
        extension = re.search(r"UNIMPLEMENTED naming `(\w+)`", verdict)
        found[method] = "works" if verdict.startswith("works") else extension.group(1) if extension else verdict
    return found


def test_docs_table_says_what_this_test_shows() -> None:
    assert docs_table() == {**dict.fromkeys(WORKS, "works"), **{m: ext for m, (_, ext) in REFUSED.items()}}
