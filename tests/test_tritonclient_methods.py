"""Every public method of tritonclient's HTTP InferenceServerClient against a real ffn-serve.

Each one either works, with its answer checked, or raises an InferenceServerException whose
status is 400 and whose message names the extension this server does not implement. The
server has system shared memory on; CUDA shared memory holds no region (status: none;
unregister: nothing to do, as perf_analyzer's clean-up needs) and registering one names the
extension and why (no GPU here). The
table covers exactly the client's public methods (a new tritonclient method fails the test
until it is placed), and docs/api.md's table must say the same.

The server has an API key: the client reaches it through a plugin that adds the bearer token,
which is how the plugin methods are put to work. It traces to a real OTLP receiver, so that the
trace settings it is given take effect, and runs with model_control = explicit, so that
load_model and unload_model work; with the default (none) they get a 400 naming the setting.
"""

from __future__ import annotations

import inspect
import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
import tritonclient.utils.shared_memory as shm
from tritonclient._plugin import InferenceServerClientPlugin
from tritonclient.utils import InferenceServerException

from bench.otlp_receiver import OtlpReceiver
from ffn_testing import ServerProcess, start_server
from tests.model_files import add_table, matches, write_ffn
from tests.reference import demo_reference

KEY = "tritonclient-table-key"
D = 512
DOCS = Path(__file__).resolve().parents[1] / "docs" / "api.md"
Client = triton.InferenceServerClient


class Bearer(InferenceServerClientPlugin):
    """Adds the API key to every request the client sends."""

    def __call__(self, request: Any) -> None:
        request.headers["Authorization"] = f"Bearer {KEY}"


EXTRA: dict[str, np.ndarray] = {}  # the weights of extra.safetensors, which load_model loads


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The config file's folder, the model repository: `demo` configured, extra.safetensors there to load."""
    folder = tmp_path_factory.mktemp("tritonclient-repository")
    (folder / "ffn.toml").write_text('model_control = "explicit"\n\n[[models]]\nname = "demo"\n')
    EXTRA.update(write_ffn(folder / "extra.safetensors", 7, d_model=16))
    return folder


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[ServerProcess]:
    with OtlpReceiver() as receiver:
        env = {
            "FFN_API_KEY": KEY,
            "FFN_LOG_LEVEL": "warning",
            "FFN_OTLP_ENDPOINT": receiver.url,
            "FFN_SHARED_MEMORY": "true",
        }
        with start_server(config=repository / "ffn.toml", env=env) as srv:
            srv.repository = repository  # type: ignore[attr-defined]
            yield srv


def new_client(server: ServerProcess, *, authorized: bool = True) -> Client:
    client = Client(server.url.removeprefix("http://"))
    if authorized:
        client.register_plugin(Bearer())
    return client


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[Client]:
    c = new_client(server)
    yield c
    c.close()


def rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, D)).astype(np.float32)


def input_tensor(x: np.ndarray, binary: bool = True) -> triton.InferInput:
    tensor = triton.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=binary)
    return tensor


def assert_demo_answer(y: np.ndarray, x: np.ndarray) -> None:
    assert y.shape == x.shape
    np.testing.assert_allclose(y.astype(np.float64), demo_reference(x), rtol=1e-5, atol=1e-5)


# ----- the methods that work, each with its answer checked ------------------------------------


def check_infer(client: Client, server: ServerProcess) -> None:
    x = rows(4, 1)
    result = client.infer(
        "demo",
        [input_tensor(x, binary=False)],
        request_id="t-1",
        outputs=[triton.InferRequestedOutput("output", binary_data=True)],
    )
    assert result.get_response()["id"] == "t-1"
    assert_demo_answer(result.as_numpy("output"), x)


def check_async_infer(client: Client, server: ServerProcess) -> None:
    x = rows(3, 2)
    pending = client.async_infer("demo", [input_tensor(x)], model_version="1")
    assert_demo_answer(pending.get_result(timeout=60).as_numpy("output"), x)


def check_body_helpers(client: Client, server: ServerProcess) -> None:
    """generate_request_body and parse_response_body: the client's wire format, sent by hand."""
    x = rows(2, 3)
    body, json_size = Client.generate_request_body(
        [input_tensor(x)], outputs=[triton.InferRequestedOutput("output", binary_data=True)]
    )
    headers = {"Authorization": f"Bearer {KEY}", "Inference-Header-Content-Length": str(json_size)}
    response = httpx.post(f"{server.url}/v2/models/demo/infer", content=body, headers=headers)
    assert response.status_code == 200, response.text
    header_length = int(response.headers["Inference-Header-Content-Length"])
    result = Client.parse_response_body(response.content, header_length=header_length)
    assert_demo_answer(result.as_numpy("output"), x)


def check_metadata(client: Client, server: ServerProcess) -> None:
    meta = client.get_server_metadata()
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
    meta = client.get_model_metadata("demo", model_version="1")
    assert meta["versions"] == ["1"] and meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, D]}]


def check_model_config(client: Client, server: ServerProcess) -> None:
    config = client.get_model_config("demo")
    assert config["name"] == "demo" and config["max_batch_size"] == 1024
    assert config["input"][0]["dims"] == [D] and config["input"][0]["data_type"] == "TYPE_FP32"
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 0
    assert client.get_model_config("demo", model_version="1") == config


def check_statistics(client: Client, server: ServerProcess) -> None:
    before = client.get_inference_statistics("demo")["model_stats"][0]
    x = rows(5, 4)
    client.infer("demo", [input_tensor(x)])
    (after,) = client.get_inference_statistics("demo", model_version="1")["model_stats"]
    assert after["name"] == "demo" and after["version"] == "1"
    assert after["inference_count"] - before["inference_count"] == 5
    assert after["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"] == 1
    assert [s["name"] for s in client.get_inference_statistics()["model_stats"]] == ["demo"]


def check_repository_index(client: Client, server: ServerProcess) -> None:
    index = [entry for entry in client.get_model_repository_index() if entry["name"] == "demo"]
    digest = client.get_model_config("demo")["parameters"]["digest"]["string_value"]
    assert index == [{"name": "demo", "version": "1", "state": "READY", "reason": "", "digest": digest}]


def check_load_and_unload(client: Client, server: ServerProcess) -> None:
    """A model loaded from the repository with a config, reloaded, unloaded: each step seen by the client."""
    weights = EXTRA
    x = np.random.default_rng(8).standard_normal((3, 16)).astype(np.float32)
    # A version grows with each load: so this check may run more than once (it is listed twice).
    last = int(next((e["version"] for e in client.get_model_repository_index() if e["name"] == "extra"), 0))
    add_table(server.repository / "ffn.toml", "extra", "extra.safetensors")  # type: ignore[attr-defined]
    client.load_model("extra", config=json.dumps({"weights": "extra.safetensors"}))
    assert client.is_model_ready("extra")
    result = client.infer("extra", [input_tensor(x)])
    assert matches(result.as_numpy("output"), weights, x) and result.get_response()["model_version"] == str(last + 1)
    client.load_model("extra")  # again, the same table: a reload
    assert client.get_model_metadata("extra")["versions"] == [str(last + 2)]
    with pytest.raises(InferenceServerException) as refused:
        client.load_model("extra", config=json.dumps({"weights": "../ffn.toml"}))
    assert refused.value.status() == "400" and "outside the model repository" in refused.value.message()
    assert client.get_model_metadata("extra")["versions"] == [str(last + 2)]  # the failed load left it serving

    client.unload_model("extra")
    assert client.is_model_ready("extra") is False
    with pytest.raises(InferenceServerException) as gone:
        client.infer("extra", [input_tensor(x)])
    assert gone.value.status() == "404" and "is unloaded" in gone.value.message()
    (entry,) = [e for e in client.get_model_repository_index() if e["name"] == "extra"]
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", entry.pop("digest")), "of the copy it last served"
    assert entry == {"name": "extra", "version": str(last + 2), "state": "UNAVAILABLE", "reason": "unloaded"}


def check_health(client: Client, server: ServerProcess) -> None:
    assert client.is_server_live() is True and client.is_server_ready() is True
    assert client.is_model_ready("demo") is True and client.is_model_ready("demo", "1") is True
    assert client.is_model_ready("no-such-model") is False


def check_trace_settings(client: Client, server: ServerProcess) -> None:
    """Triton's trace extension: the server's settings, a model's over them, and null putting one back."""
    defaults = {
        "trace_level": ["TIMESTAMPS"],
        "trace_rate": "1",
        "trace_count": "-1",
        "log_frequency": "0",
        "trace_mode": "opentelemetry",
    }
    assert client.get_trace_settings() == defaults
    try:
        changed = client.update_trace_settings(settings={"trace_rate": "2", "trace_count": "5"})
        assert changed == {**defaults, "trace_rate": "2", "trace_count": "5"}
        assert client.get_trace_settings(model_name="demo") == changed  # the model follows the server
        off = client.update_trace_settings(model_name="demo", settings={"trace_level": ["OFF"]})
        assert off == {**changed, "trace_level": ["OFF"]}
        assert client.get_trace_settings()["trace_level"] == ["TIMESTAMPS"]
        back = client.update_trace_settings(model_name="demo", settings={"trace_level": None})
        assert back == changed
    finally:
        cleared = client.update_trace_settings(settings=dict.fromkeys(["trace_rate", "trace_count"]))
    assert cleared == defaults


def check_log_settings(client: Client, server: ServerProcess) -> None:
    before = client.get_log_settings()
    assert before == {
        "log_file": "",
        "log_info": False,  # the server runs at FFN_LOG_LEVEL=warning
        "log_warning": True,
        "log_error": True,
        "log_verbose_level": 0,
        "log_format": "text",
    }
    after = client.update_log_settings({"log_info": True, "log_verbose_level": 2})
    assert after == {**before, "log_info": True, "log_verbose_level": 2}
    assert client.get_log_settings() == after
    assert client.update_log_settings(before) == before
    with pytest.raises(InferenceServerException) as info:
        client.update_log_settings({"log_file": "/tmp/elsewhere.log"})
    assert info.value.status() == "400" and "log_file cannot be changed" in info.value.message()


def check_system_shared_memory(client: Client, server: ServerProcess) -> None:
    """Inputs and outputs through regions made with tritonclient's own shared-memory utilities."""
    x = rows(5, 6)
    tag = f"{server.port}"
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
        assert info.value.status() == "404"
    finally:
        for handle in regions.values():
            shm.destroy_shared_memory_region(handle)


def check_cuda_shared_memory(client: Client, server: ServerProcess) -> None:
    """No CUDA region is ever registered: all of them is an empty list, a named one 404, unregistering done."""
    assert client.get_cuda_shared_memory_status() == []
    with pytest.raises(InferenceServerException) as info:
        client.get_cuda_shared_memory_status("r")
    assert info.value.status() == "404"
    assert "no cuda shared memory region named 'r' is registered" in info.value.message()
    client.unregister_cuda_shared_memory()  # all of them, as perf_analyzer's clean-up does
    client.unregister_cuda_shared_memory("r")
    assert client.get_cuda_shared_memory_status() == []


def check_plugins(client: Client, server: ServerProcess) -> None:
    """Without the plugin the key is missing (401); registered, it is sent; unregistered, missing again."""
    fresh = new_client(server, authorized=False)
    try:
        assert fresh.plugin() is None
        with pytest.raises(InferenceServerException) as info:
            fresh.get_server_metadata()
        assert info.value.status() == "401"
        plugin = Bearer()
        fresh.register_plugin(plugin)
        assert fresh.plugin() is plugin
        assert fresh.get_server_metadata()["name"] == "ffn-serve"
        fresh.unregister_plugin()
        assert fresh.plugin() is None
        with pytest.raises(InferenceServerException):
            fresh.get_server_metadata()
    finally:
        fresh.close()


def check_close(client: Client, server: ServerProcess) -> None:
    fresh = new_client(server)
    assert fresh.is_server_live()
    fresh.close()
    fresh.close()  # twice is harmless
    with pytest.raises(RuntimeError, match="closed"):
        fresh.is_server_live()


Check = Callable[[Client, ServerProcess], None]
WORKS: dict[str, Check] = {
    "infer": check_infer,
    "async_infer": check_async_infer,
    "generate_request_body": check_body_helpers,
    "parse_response_body": check_body_helpers,
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

# ----- the methods of extensions this server does not implement: a 400 that names them ----------

REFUSED: dict[str, tuple[Callable[[Client], Any], str]] = {
    "register_cuda_shared_memory": (
        lambda c: c.register_cuda_shared_memory("r", b"aGFuZGxl", 0, 64),
        "cuda_shared_memory",
    ),
}


def public_methods() -> set[str]:
    return {name for name, _ in inspect.getmembers(Client, inspect.isfunction) if not name.startswith("_")}


def test_the_table_places_every_public_method_once() -> None:
    assert not set(WORKS) & set(REFUSED)
    assert set(WORKS) | set(REFUSED) == public_methods()
    assert len(public_methods()) == 28  # tritonclient 2.73: a new method must be placed in the table


@pytest.mark.parametrize("method", sorted(WORKS))
def test_method_works(client: Client, server: ServerProcess, method: str) -> None:
    WORKS[method](client, server)


@pytest.mark.parametrize("method", sorted(REFUSED))
def test_method_is_refused_naming_its_extension(client: Client, method: str) -> None:
    call, extension = REFUSED[method]
    with pytest.raises(InferenceServerException) as info:
        call(client)
    assert info.value.status() == "400"
    assert f"the {extension} extension is not supported" in info.value.message()


@pytest.mark.parametrize("call", ["load_model", "unload_model"])
def test_with_model_control_none_load_and_unload_are_a_400_naming_the_setting(
    demo_server: ServerProcess, call: str
) -> None:
    client = Client(demo_server.url.removeprefix("http://"))
    try:
        with pytest.raises(InferenceServerException) as info:
            getattr(client, call)("demo")
    finally:
        client.close()
    assert info.value.status() == "400"
    assert "model_control = none" in info.value.message() and "--model-control explicit" in info.value.message()


def test_last_inference_is_the_time_of_the_last_pass(client: Client) -> None:
    before_ms = time.time() * 1000
    client.infer("demo", [input_tensor(rows(1, 5))])
    (stat,) = client.get_inference_statistics("demo")["model_stats"]
    assert before_ms - 1 <= stat["last_inference"] <= time.time() * 1000 + 1


def docs_table() -> dict[str, str]:
    """docs/api.md's tritonclient table: method -> "works" or the extension it names."""
    text = DOCS.read_text()
    table = text[text.index("<!-- tritonclient-table:start -->") : text.index("<!-- tritonclient-table:end -->")]
    found = {}
    for method, verdict in re.findall(r"^\| `(\w+)` \| (.+?) \|", table, flags=re.MULTILINE):
        extension = re.search(r"400 naming `(\w+)`", verdict)
        found[method] = "works" if verdict.startswith("works") else extension.group(1) if extension else verdict
    return found


def test_docs_table_says_what_this_test_shows() -> None:
    assert docs_table() == {**dict.fromkeys(WORKS, "works"), **{m: ext for m, (_, ext) in REFUSED.items()}}
