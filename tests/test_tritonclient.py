"""Every public method of tritonclient's InferenceServerClient, HTTP and gRPC, against a real ffn-serve.

Each one either works, with its answer checked, or raises an InferenceServerException whose
status names the extension this server does not implement (HTTP: 400; gRPC: UNIMPLEMENTED, as
Triton answers an unsupported request). The server has system shared memory on; CUDA shared
memory holds no region (status: none; unregister: nothing to do, as perf_analyzer's clean-up
needs) and registering one names the extension and why (no GPU here). Each door's table covers
exactly its client's public methods (a new tritonclient method fails the test until it is
placed), and docs/api.md's table for that door must say the same.

Three servers, one per parameter of `served`: over HTTP, one with an API key; over gRPC, one with
the key and one without. A keyed server is reached through a plugin that adds the bearer token,
which is how the plugin methods are put to work; against the gRPC one, every method that calls
the server fails UNAUTHENTICATED without the key. Each traces to a real OTLP receiver, so that
the trace settings it is given take effect, and runs with model_control = explicit, so that
load_model and unload_model work; with the default (none) they are refused naming the setting.
"""

from __future__ import annotations

import inspect
import json
import queue
import re
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc
import tritonclient.http
import tritonclient.utils.shared_memory as shm
from tritonclient._plugin import InferenceServerClientPlugin
from tritonclient.utils import InferenceServerException

from bench.otlp_receiver import OtlpReceiver
from ffn_client.encodings import as_wire_values
from ffn_testing import ServerProcess, start_server
from tests.model_files import add_table, matches, write_ffn
from tests.reference import demo_reference

KEY = "tritonclient-table-key"
D = 512
DOCS = Path(__file__).resolve().parents[1] / "docs" / "api.md"
Client = Any  # tritonclient.http's or tritonclient.grpc's InferenceServerClient


@dataclass(frozen=True)
class Door:
    """What differs between the two clients: the module, where they connect, the statuses they report."""

    name: str
    triton: ModuleType
    methods: int  # the client's public methods in tritonclient 2.73
    invalid: str  # a bad argument
    not_found: str
    unimplemented: str  # an extension this server does not implement
    unauthenticated: str
    model_control_off: str  # load_model or unload_model under model_control = none
    key_header: str
    closed_error: type[Exception]  # what a closed client raises
    docs_marker: str  # docs/api.md's table
    docs_refusal: str  # how that table names a refusal

    @property
    def client_class(self) -> Any:
        return self.triton.InferenceServerClient

    def target(self, server: ServerProcess) -> str:
        return server.url.removeprefix("http://") if self.name == "http" else server.grpc_target


HTTP = Door(
    "http", tritonclient.http, 28, "400", "404", "400", "401", "400", "Authorization", RuntimeError,
    "tritonclient-table", "400 naming",
)  # fmt: skip
GRPC = Door(
    "grpc", tritonclient.grpc, 29, "StatusCode.INVALID_ARGUMENT", "StatusCode.NOT_FOUND", "StatusCode.UNIMPLEMENTED",
    "StatusCode.UNAUTHENTICATED", "StatusCode.UNIMPLEMENTED",  # as an extension a setting turned off
    "authorization", ValueError, "tritonclient-grpc-table", "UNIMPLEMENTED naming",
)  # fmt: skip
DOORS = {"http": HTTP, "grpc": GRPC}


@dataclass
class Served:
    """A started server, the door this module reaches it through, and a client of that door."""

    server: ServerProcess
    door: Door
    keyed: bool
    repository: Path  # the config file's folder, the model repository
    extra: dict[str, np.ndarray]  # the weights of its extra.safetensors, which load_model loads
    client: Any = None  # with the key where the server has one


class Bearer(InferenceServerClientPlugin):
    """Adds the API key to every request (HTTP) or call (gRPC) the client makes."""

    def __init__(self, header: str) -> None:
        self.header = header

    def __call__(self, request: Any) -> None:
        request.headers[self.header] = f"Bearer {KEY}"


# The servers: (door, keyed) by name. A test names the one it runs against.
SERVERS = {"http-key": ("http", True), "grpc-key": ("grpc", True), "grpc-no-key": ("grpc", False)}


@contextmanager
def serve(name: str, folder: Path) -> Iterator[Served]:
    door, keyed = DOORS[SERVERS[name][0]], SERVERS[name][1]
    # The config file's folder is the model repository: `demo` configured, extra.safetensors there to load.
    (folder / "ffn.toml").write_text('model_control = "explicit"\n\n[[models]]\nname = "demo"\n')
    extra = write_ffn(folder / "extra.safetensors", 7, d_model=16)
    # Traced to a real OTLP receiver, so that the trace settings it is given take effect.
    with OtlpReceiver() as receiver:
        env = {"FFN_LOG_LEVEL": "warning", "FFN_OTLP_ENDPOINT": receiver.url, "FFN_SHARED_MEMORY": "true"}
        env |= {"FFN_API_KEY": KEY} if keyed else {}
        with start_server(env=env, config=folder / "ffn.toml") as server:
            served = Served(server, door, keyed, folder, extra)
            served.client = new_client(served)
            try:
                yield served
            finally:
                served.client.close()


@pytest.fixture(scope="module")
def door_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Served]]:
    """door_servers(name) -> that server of SERVERS, started at the module's first test that names it
    and stopped after its last test: each door runs only its own client's methods, so the tests are
    not a product of servers and methods that one parametrized fixture could group."""
    with ExitStack() as stack:
        started: dict[str, Served] = {}

        def get(name: str) -> Served:
            if name not in started:
                started[name] = stack.enter_context(serve(name, tmp_path_factory.mktemp(f"tritonclient-{name}")))
            return started[name]

        yield get


def new_client(served: Served, *, authorized: bool = True) -> Client:
    client = served.door.client_class(served.door.target(served.server))
    if authorized and served.keyed:
        client.register_plugin(Bearer(served.door.key_header))
    return client


def rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, D)).astype(np.float32)


def input_tensor(door: Door, x: np.ndarray, datatype: str = "FP32", *, binary: bool = True) -> Any:
    tensor = door.triton.InferInput("input", list(x.shape), datatype)
    wire = {"FP32": np.float32, "FP16": np.float16, "BF16": ml_dtypes.bfloat16}[datatype]
    if door is HTTP:
        tensor.set_data_from_numpy(x.astype(wire), binary_data=binary)
    else:
        tensor.set_data_from_numpy(x.astype(wire))
    return tensor


def assert_demo_answer(y: np.ndarray, x: np.ndarray, dtype: str = "float32") -> None:
    """y against the float64 reference of x as the server saw it, to the wire dtype's precision."""
    assert y.shape == x.shape
    seen = as_wire_values(x, dtype).astype(np.float64)
    tolerance = {"float32": 1e-5, "float16": 2e-2, "bfloat16": 1e-1}[dtype]
    np.testing.assert_allclose(y.astype(np.float64), demo_reference(seen), rtol=tolerance, atol=tolerance)


def json_of(door: Door, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """An answer as JSON: HTTP's already is; gRPC's protobuf message as its JSON mapping (int64 as text)."""
    return call(*args, **kwargs) if door is HTTP else call(*args, as_json=True, **kwargs)


# ----- the methods that work, each with its answer checked ------------------------------------


def check_infer(client: Client, served: Served) -> None:
    door = served.door
    if door is HTTP:  # JSON in, binary out
        x = rows(4, 1)
        result = client.infer(
            "demo",
            [input_tensor(door, x, binary=False)],
            request_id="t-1",
            outputs=[door.triton.InferRequestedOutput("output", binary_data=True)],
        )
        assert result.get_response()["id"] == "t-1"
        assert_demo_answer(result.as_numpy("output"), x)
        return
    for datatype, dtype in (("FP32", "float32"), ("FP16", "float16"), ("BF16", "bfloat16")):
        x = rows(4, 1)
        result = client.infer(
            "demo",
            [input_tensor(door, x, datatype)],
            request_id=f"t-{datatype}",
            outputs=[door.triton.InferRequestedOutput("output")],
        )
        response = result.get_response()
        assert response.id == f"t-{datatype}" and response.outputs[0].datatype == datatype
        assert_demo_answer(result.as_numpy("output").astype(np.float32), x, dtype)
    x3 = rows(6, 2).reshape(2, 3, D)  # [batch, seq, d_model] keeps its shape
    assert_demo_answer(client.infer("demo", [input_tensor(door, x3)], model_version="1").as_numpy("output"), x3)


def check_async_infer(client: Client, served: Served) -> None:
    door = served.door
    if door is HTTP:  # a handle to wait on
        x = rows(3, 2)
        pending = client.async_infer("demo", [input_tensor(door, x)], model_version="1")
        assert_demo_answer(pending.get_result(timeout=60).as_numpy("output"), x)
        return
    x = rows(3, 3)  # a callback
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.async_infer("demo", [input_tensor(door, x)], lambda result, error: answers.put((result, error)))
    result, error = answers.get(timeout=60)
    assert error is None
    assert_demo_answer(result.as_numpy("output"), x)


def check_body_helpers(client: Client, served: Served) -> None:
    """HTTP's generate_request_body and parse_response_body: the client's wire format, sent by hand."""
    x = rows(2, 3)
    triton = tritonclient.http
    body, json_size = triton.InferenceServerClient.generate_request_body(
        [input_tensor(HTTP, x)], outputs=[triton.InferRequestedOutput("output", binary_data=True)]
    )
    headers = {"Authorization": f"Bearer {KEY}", "Inference-Header-Content-Length": str(json_size)}
    response = httpx.post(f"{served.server.url}/v2/models/demo/infer", content=body, headers=headers)
    assert response.status_code == 200, response.text
    header_length = int(response.headers["Inference-Header-Content-Length"])
    result = triton.InferenceServerClient.parse_response_body(response.content, header_length=header_length)
    assert_demo_answer(result.as_numpy("output"), x)


def check_stream(client: Client, served: Served) -> None:
    """gRPC's start_stream, async_stream_infer, stop_stream: three requests on one stream, answered by id."""
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    sent = {f"s{k}": rows(k + 1, 10 + k) for k in range(3)}
    for request_id, x in sent.items():
        client.async_stream_infer("demo", [input_tensor(GRPC, x)], request_id=request_id)
    got = {}
    for _ in sent:
        result, error = answers.get(timeout=60)
        assert error is None, error
        got[result.get_response().id] = result.as_numpy("output")
    client.stop_stream()
    assert set(got) == set(sent)
    for request_id, x in sent.items():
        assert_demo_answer(got[request_id], x)


def check_metadata(client: Client, served: Served) -> None:
    meta = json_of(served.door, client.get_server_metadata)
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


def check_model_metadata(client: Client, served: Served) -> None:
    door = served.door
    meta = json_of(door, client.get_model_metadata, "demo", model_version="1")
    assert meta["versions"] == ["1"]
    if door is HTTP:
        assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, D]}]
        return
    assert meta["platform"] == "pytorch_ffn"
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": ["-1", str(D)]}]  # int64 as JSON text
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("demo", model_version="2")
    assert info.value.status() == door.not_found


def check_model_config(client: Client, served: Served) -> None:
    if served.door is HTTP:
        config = client.get_model_config("demo")
        assert config["name"] == "demo" and config["max_batch_size"] == 1024
        assert config["input"][0]["dims"] == [D] and config["input"][0]["data_type"] == "TYPE_FP32"
        assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 0
        assert client.get_model_config("demo", model_version="1") == config
        return
    message = client.get_model_config("demo").config
    assert message.name == "demo" and message.max_batch_size == 1024
    assert (
        list(message.input[0].dims) == [D]
        and message.input[0].data_type == tritonclient.grpc.model_config_pb2.TYPE_FP32
    )
    assert message.dynamic_batching.default_queue_policy.default_timeout_microseconds == 30_000_000
    assert message.parameters["d_ff"].string_value == "2048"
    assert client.get_model_config("demo", model_version="1").config == message


def check_statistics(client: Client, served: Served) -> None:
    door = served.door
    before = json_of(door, client.get_inference_statistics, "demo")["model_stats"][0]
    client.infer("demo", [input_tensor(door, rows(5, 4))])
    (after,) = json_of(door, client.get_inference_statistics, "demo", model_version="1")["model_stats"]
    assert after["name"] == "demo" and after["version"] == "1"
    # gRPC's JSON mapping writes int64 counts as text
    assert int(after["inference_count"]) - int(before["inference_count"]) == 5
    success = int(after["inference_stats"]["success"]["count"]) - int(before["inference_stats"]["success"]["count"])
    assert success == 1
    if door is GRPC:
        assert int(after["memory_usage"][0]["byte_size"]) > 0
    assert [s["name"] for s in json_of(door, client.get_inference_statistics)["model_stats"]] == ["demo"]


def repository_index(client: Client, door: Door) -> list[dict[str, Any]]:
    index = json_of(door, client.get_model_repository_index)
    return index if door is HTTP else index["models"]


def check_repository_index(client: Client, served: Served) -> None:
    demo = [entry for entry in repository_index(client, served.door) if entry["name"] == "demo"]
    if served.door is HTTP:
        digest = client.get_model_config("demo")["parameters"]["digest"]["string_value"]
        assert demo == [{"name": "demo", "version": "1", "state": "READY", "reason": "", "digest": digest}]
    else:
        assert demo == [{"name": "demo", "version": "1", "state": "READY"}]  # an empty reason is left out


def check_load_and_unload(client: Client, served: Served) -> None:
    """A model loaded from the repository with a config, its file replaced and reloaded, refused
    loads leaving it serving, then unloaded: each step seen by the client, answers against numpy."""
    door = served.door

    def version(name: str) -> list[str]:
        return json_of(door, client.get_model_metadata, name)["versions"]

    def model_version(result: Any) -> str:
        response = result.get_response()
        return response["model_version"] if door is HTTP else response.model_version

    x = np.random.default_rng(8).standard_normal((3, 16)).astype(np.float32)
    # A version grows with each load: so this check may run more than once (it is listed twice).
    last = int(next((e["version"] for e in repository_index(client, door) if e["name"] == "extra"), 0))
    add_table(served.repository / "ffn.toml", "extra", "extra.safetensors")
    client.load_model("extra", config=json.dumps({"weights": "extra.safetensors"}))
    assert client.is_model_ready("extra")
    result = client.infer("extra", [input_tensor(door, x)])
    assert matches(result.as_numpy("output"), served.extra, x) and model_version(result) == str(last + 1)

    # The operator's workflow: replace the weight file, then load (no config: the table it serves with).
    old = dict(served.extra)
    served.extra.clear()
    served.extra.update(write_ffn(served.repository / "extra.safetensors", 100 + last, d_model=16))
    client.load_model("extra")
    result = client.infer("extra", [input_tensor(door, x)])
    answered = result.as_numpy("output")
    assert matches(answered, served.extra, x) and not matches(answered, old, x)  # the new weights answer
    assert model_version(result) == str(last + 2)
    assert version("extra") == [str(last + 2)]

    refusals: list[dict[str, Any]] = [{"config": json.dumps({"weights": "../ffn.toml"})}]
    if door is GRPC:
        refusals.append({"files": {"file:1/m.bin": b"x"}})
    for refused in refusals:
        with pytest.raises(InferenceServerException) as info:
            client.load_model("extra", **refused)
        assert info.value.status() == door.invalid, info.value.message()
        if "config" in refused:
            assert "outside the model repository" in info.value.message()
    # The failed loads left the copy serving: the same version, the same answers.
    assert version("extra") == [str(last + 2)]
    assert matches(client.infer("extra", [input_tensor(door, x)]).as_numpy("output"), served.extra, x)

    client.unload_model("extra")
    assert client.is_model_ready("extra") is False
    with pytest.raises(InferenceServerException) as gone:
        client.infer("extra", [input_tensor(door, x)])
    assert gone.value.status() == door.not_found and "is unloaded" in gone.value.message()
    (entry,) = [e for e in repository_index(client, door) if e["name"] == "extra"]
    if door is HTTP:
        assert re.fullmatch(r"sha256:[0-9a-f]{64}", entry.pop("digest")), "of the copy it last served"
    assert entry == {"name": "extra", "version": str(last + 2), "state": "UNAVAILABLE", "reason": "unloaded"}


def check_health(client: Client, served: Served) -> None:
    assert client.is_server_live() is True and client.is_server_ready() is True
    assert client.is_model_ready("demo") is True and client.is_model_ready("demo", "1") is True
    assert client.is_model_ready("no-such-model") is False and client.is_model_ready("demo", "2") is False


def check_trace_settings(client: Client, served: Served) -> None:
    """Triton's trace extension (gRPC's TraceSetting, the twin of /v2/trace/setting): the server's
    settings, a model's over them, a null (HTTP) or empty value (gRPC) putting one back."""
    door = served.door

    def settings(answer: Any) -> dict[str, list[str]]:
        """Each setting as a list of strings: HTTP's JSON has a lone string where gRPC has a list."""
        if door is HTTP:
            return {key: value if isinstance(value, list) else [value] for key, value in answer.items()}
        return {key: list(value.value) for key, value in answer.settings.items()}

    if door is HTTP:  # a lone value is a string, not a list of one
        raw = client.get_trace_settings()
        assert all(isinstance(raw[key], str) for key in ("trace_rate", "trace_count", "log_frequency", "trace_mode"))
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
        if door is GRPC:
            with pytest.raises(InferenceServerException, match="unknown trace setting 'trace_speed'") as info:
                client.update_trace_settings(settings={"trace_speed": "9"})
            assert info.value.status() == door.invalid
    finally:
        cleared = client.update_trace_settings(settings=dict.fromkeys(["trace_rate", "trace_count"]))
    assert settings(cleared) == defaults


def check_log_settings(client: Client, served: Served) -> None:
    """Triton's logging extension (gRPC's LogSettings, the twin of /v2/logging): each setting in its
    own type, a change in every worker."""
    door = served.door

    def settings(answer: Any) -> dict[str, Any]:
        if door is HTTP:
            return answer
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
    assert info.value.status() == door.invalid and "log_file cannot be changed" in info.value.message()


def check_system_shared_memory(client: Client, served: Served) -> None:
    """Registering, listing and unregistering regions made with tritonclient's own shared-memory
    utilities, and inference through them."""
    if served.door is HTTP:
        check_system_shared_memory_http(client, served)
    else:
        check_system_shared_memory_grpc(client, served)


def check_system_shared_memory_http(client: Client, served: Served) -> None:
    """Inputs and outputs through regions, their status as JSON lists."""
    triton = tritonclient.http
    x = rows(5, 6)
    tag = f"{served.server.port}"
    regions = {
        "in": shm.create_shared_memory_region("in", f"/ffn_triton_in_{tag}", x.nbytes),
        "out": shm.create_shared_memory_region("out", f"/ffn_triton_out_{tag}", x.nbytes),
    }
    try:
        shm.set_shared_memory_region(regions["in"], [x])
        client.register_system_shared_memory("in", f"/ffn_triton_in_{tag}", x.nbytes)
        client.register_system_shared_memory("out", f"/ffn_triton_out_{tag}", x.nbytes)
        status = client.get_system_shared_memory_status()
        assert sorted((r["name"], r["key"], r["offset"], r["byte_size"]) for r in status) == [
            ("in", f"/ffn_triton_in_{tag}", 0, x.nbytes),
            ("out", f"/ffn_triton_out_{tag}", 0, x.nbytes),
        ]
        assert [r["name"] for r in client.get_system_shared_memory_status("out")] == ["out"]
        tensor = triton.InferInput("input", list(x.shape), "FP32")
        tensor.set_shared_memory("in", x.nbytes)
        output = triton.InferRequestedOutput("output", binary_data=False)
        output.set_shared_memory("out", x.nbytes)
        result = client.infer("demo", [tensor], outputs=[output])
        assert result.get_output("output") == {"name": "output", "datatype": "FP32", "shape": [5, D]}
        assert_demo_answer(shm.get_contents_as_numpy(regions["out"], np.float32, [5, D]), x)
        client.unregister_system_shared_memory("in")
        assert [r["name"] for r in client.get_system_shared_memory_status()] == ["out"]
        client.unregister_system_shared_memory()
        assert client.get_system_shared_memory_status() == []
        with pytest.raises(InferenceServerException) as info:
            client.get_system_shared_memory_status("in")
        assert info.value.status() == HTTP.not_found
    finally:
        for handle in regions.values():
            shm.destroy_shared_memory_region(handle)


def check_system_shared_memory_grpc(client: Client, served: Served) -> None:
    """A region registered, listed as a message, refused past its end, unregistered; then inference."""
    tag = f"g{served.server.port}{int(served.keyed)}"
    handle = shm.create_shared_memory_region("in", f"/ffn_grpc_{tag}", 64)
    try:
        client.register_system_shared_memory("in", f"/ffn_grpc_{tag}", 64, offset=0)
        status = client.get_system_shared_memory_status(as_json=True)["regions"]
        assert status == {"in": {"name": "in", "key": f"/ffn_grpc_{tag}", "byte_size": "64"}}
        with pytest.raises(InferenceServerException) as info:
            client.register_system_shared_memory("in", f"/ffn_grpc_{tag}", 128)  # past the object's end
        assert info.value.status() == GRPC.invalid
        client.unregister_system_shared_memory("in")
        assert client.get_system_shared_memory_status(as_json=True) == {}
        with pytest.raises(InferenceServerException) as info:
            client.get_system_shared_memory_status("in")
        assert info.value.status() == GRPC.not_found
    finally:
        client.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(handle)
    check_infer_through_shared_memory(client, tag)


def check_infer_through_shared_memory(client: Client, tag: str) -> None:
    """gRPC: tensors in regions instead of the message, the input read from one, outputs written to another."""
    triton = tritonclient.grpc
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
        plain = client.infer("demo", [input_tensor(GRPC, x)], outputs=outputs, parameters=mc)
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
        assert info.value.status() == GRPC.invalid and "the output needs" in info.value.message()
        both = input_tensor(GRPC, x)
        both._input.parameters["shared_memory_region"].string_param = "x"
        both._input.parameters["shared_memory_byte_size"].int64_param = x.nbytes
        with pytest.raises(InferenceServerException) as info:
            client.infer("demo", [both])
        assert info.value.status() == GRPC.invalid and "send one of them" in info.value.message()
        missing = triton.InferInput("input", list(x.shape), "FP32")
        missing.set_shared_memory("nope", x.nbytes)
        with pytest.raises(InferenceServerException) as info:
            client.infer("demo", [missing])
        assert info.value.status() == GRPC.not_found and "'nope'" in info.value.message()
    finally:
        client.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(handle_in)
        shm.destroy_shared_memory_region(handle_out)


def check_cuda_shared_memory(client: Client, served: Served) -> None:
    """No CUDA region is ever registered: none listed, a named one not found, unregistering done (perf_analyzer's)."""
    door = served.door

    def status() -> Any:
        return json_of(door, client.get_cuda_shared_memory_status)

    nothing = [] if door is HTTP else {}
    assert status() == nothing
    if door is GRPC:
        assert len(client.get_cuda_shared_memory_status().regions) == 0
    with pytest.raises(InferenceServerException) as info:
        client.get_cuda_shared_memory_status("r")
    assert info.value.status() == door.not_found
    assert "no cuda shared memory region named 'r' is registered" in info.value.message()
    client.unregister_cuda_shared_memory()  # all of them, as perf_analyzer's clean-up does
    client.unregister_cuda_shared_memory("r")
    assert status() == nothing


def check_plugins(client: Client, served: Served) -> None:
    """Without the plugin a keyed server refuses (the key is missing); registered, it is sent;
    unregistered, missing again."""
    door = served.door
    fresh = new_client(served, authorized=False)
    try:
        assert fresh.plugin() is None
        if served.keyed:
            with pytest.raises(InferenceServerException) as info:
                fresh.get_server_metadata()
            assert info.value.status() == door.unauthenticated
        plugin = Bearer(door.key_header)
        fresh.register_plugin(plugin)
        assert fresh.plugin() is plugin
        assert json_of(door, fresh.get_server_metadata)["name"] == "ffn-serve"
        fresh.unregister_plugin()
        assert fresh.plugin() is None
        if served.keyed:
            with pytest.raises(InferenceServerException) as info:
                fresh.get_server_metadata()
            assert info.value.status() == door.unauthenticated
    finally:
        fresh.close()


def check_close(client: Client, served: Served) -> None:
    fresh = new_client(served)
    assert fresh.is_server_live()
    fresh.close()
    fresh.close()  # twice is harmless
    with pytest.raises(served.door.closed_error, match="closed"):
        fresh.is_server_live()


Check = Callable[[Client, Served], None]
BOTH: dict[str, Check] = {
    "infer": check_infer,
    "async_infer": check_async_infer,
    "get_server_metadata": check_metadata,
    "get_model_metadata": check_model_metadata,
    "get_model_config": check_model_config,
    "get_inference_statistics": check_statistics,
    "get_model_repository_index": check_repository_index,
    "load_model": check_load_and_unload,
    "unload_model": check_load_and_unload,
    "get_trace_settings": check_trace_settings,
    "update_trace_settings": check_trace_settings,
    "is_server_live": check_health,
    "is_server_ready": check_health,
    "is_model_ready": check_health,
    "register_plugin": check_plugins,
    "plugin": check_plugins,
    "unregister_plugin": check_plugins,
    "close": check_close,
    "get_log_settings": check_log_settings,
    "update_log_settings": check_log_settings,
    "get_system_shared_memory_status": check_system_shared_memory,
    "register_system_shared_memory": check_system_shared_memory,
    "unregister_system_shared_memory": check_system_shared_memory,
    "get_cuda_shared_memory_status": check_cuda_shared_memory,
    "unregister_cuda_shared_memory": check_cuda_shared_memory,
}
WORKS: dict[str, dict[str, Check]] = {
    "http": {**BOTH, "generate_request_body": check_body_helpers, "parse_response_body": check_body_helpers},
    "grpc": {**BOTH, "start_stream": check_stream, "async_stream_infer": check_stream, "stop_stream": check_stream},
}

# ----- the methods of extensions this server does not implement: refused, naming them -----------

REFUSED: dict[str, tuple[Callable[[Client], Any], str]] = {
    "register_cuda_shared_memory": (
        lambda c: c.register_cuda_shared_memory("r", b"aGFuZGxl", 0, 64),
        "cuda_shared_memory",
    ),
}

# What calls the server, for the key check: every method but the client-side ones.
CLIENT_SIDE = {"register_plugin", "plugin", "unregister_plugin", "close"}


def public_methods(door: Door) -> set[str]:
    return {name for name, _ in inspect.getmembers(door.client_class, inspect.isfunction) if not name.startswith("_")}


@pytest.mark.parametrize("door", [HTTP, GRPC], ids=["http", "grpc"])
def test_the_table_places_every_public_method_once(door: Door) -> None:
    assert not set(WORKS[door.name]) & set(REFUSED)
    assert set(WORKS[door.name]) | set(REFUSED) == public_methods(door)
    assert len(public_methods(door)) == door.methods  # tritonclient 2.73: a new method must be placed in the table


@pytest.mark.parametrize(
    ("name", "method"), [(name, method) for name, (door, _) in SERVERS.items() for method in sorted(WORKS[door])]
)
def test_method_works(door_servers: Callable[[str], Served], name: str, method: str) -> None:
    served = door_servers(name)
    WORKS[served.door.name][method](served.client, served)


@pytest.mark.parametrize("name", list(SERVERS))
@pytest.mark.parametrize("method", sorted(REFUSED))
def test_method_is_refused_naming_its_extension(door_servers: Callable[[str], Served], name: str, method: str) -> None:
    served = door_servers(name)
    call, extension = REFUSED[method]
    with pytest.raises(InferenceServerException) as info:
        call(served.client)
    assert info.value.status() == served.door.unimplemented
    assert f"the {extension} extension is not supported" in info.value.message()


@pytest.mark.parametrize("door", [HTTP, GRPC], ids=["http", "grpc"])
@pytest.mark.parametrize("call", ["load_model", "unload_model"])
def test_with_model_control_none_load_and_unload_are_refused_naming_the_setting(
    demo_server: ServerProcess, door: Door, call: str
) -> None:
    client = door.client_class(door.target(demo_server))
    try:
        with pytest.raises(InferenceServerException) as info:
            getattr(client, call)("demo")
    finally:
        client.close()
    assert info.value.status() == door.model_control_off
    assert "model_control = none" in info.value.message() and "--model-control explicit" in info.value.message()


def test_last_inference_is_the_time_of_the_last_pass(door_servers: Callable[[str], Served]) -> None:
    client = door_servers("http-key").client
    before_ms = time.time() * 1000
    client.infer("demo", [input_tensor(HTTP, rows(1, 5))])
    (stat,) = client.get_inference_statistics("demo")["model_stats"]
    assert before_ms - 1 <= stat["last_inference"] <= time.time() * 1000 + 1


def without_key_calls() -> dict[str, Callable[[Client], Any]]:
    x = rows(1, 7)
    return {
        "infer": lambda c: c.infer("demo", [input_tensor(GRPC, x)]),
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


def test_without_the_key_every_grpc_call_is_unauthenticated(door_servers: Callable[[str], Served]) -> None:
    served = door_servers("grpc-key")
    client = new_client(served, authorized=False)
    try:
        for name, call in without_key_calls().items():
            with pytest.raises(InferenceServerException) as info:
                call(client)
            assert info.value.status() == GRPC.unauthenticated, name
            assert "missing API key" in info.value.message(), name
        # The probes are open on both doors, as Kubernetes and load balancers send no key.
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("demo")
        wrong = GRPC.client_class(served.server.grpc_target)
        with pytest.raises(InferenceServerException) as info:
            wrong.get_server_metadata(headers={"authorization": "Bearer not-the-key"})
        assert info.value.status() == GRPC.unauthenticated and "wrong API key" in info.value.message()
        wrong.close()
        # The stream too: refused as it opens, its error reaches the callback (and the stream is closed).
        answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        try:
            client.async_stream_infer("demo", [input_tensor(GRPC, rows(1, 8))])
        except InferenceServerException as exc:  # the refusal came first
            assert "no longer in valid state" in exc.message()
        result, error = answers.get(timeout=60)
        assert result is None and error.status() == GRPC.unauthenticated
        client.stop_stream()
    finally:
        client.close()
    probes = {"is_server_live", "is_server_ready", "is_model_ready"}
    assert set(without_key_calls()) | {"async_infer", "start_stream", "async_stream_infer", "stop_stream"} | probes == (
        public_methods(GRPC) - CLIENT_SIDE
    )


def docs_table(door: Door) -> dict[str, str]:
    """docs/api.md's table for `door`'s client: method -> "works" or the extension it names."""
    text = DOCS.read_text()
    start, end = f"<!-- {door.docs_marker}:start -->", f"<!-- {door.docs_marker}:end -->"
    table = text[text.index(start) : text.index(end)]
    found = {}
    for method, verdict in re.findall(r"^\| `(\w+)` \| (.+?) \|", table, flags=re.MULTILINE):
        extension = re.search(rf"{door.docs_refusal} `(\w+)`", verdict)
        found[method] = "works" if verdict.startswith("works") else extension.group(1) if extension else verdict
    return found


@pytest.mark.parametrize("door", [HTTP, GRPC], ids=["http", "grpc"])
def test_docs_table_says_what_this_test_shows(door: Door) -> None:
    assert docs_table(door) == {
        **dict.fromkeys(WORKS[door.name], "works"),
        **{m: ext for m, (_, ext) in REFUSED.items()},
    }
