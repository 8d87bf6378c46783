"""The metrics beyond the batcher's: rows per request, build info, process resources, GPU memory, and
the metrics port that answers a scrape without the API key. Values, checked against what the test
reads itself (its own arithmetic, /proc, os.times, torch)."""

from __future__ import annotations

import os
import platform

import httpx
import numpy as np
import pytest
import torch
from prometheus_client.metrics import MetricWrapperBase

from app import __version__
from app.config.settings import ModelSpec, Settings
from app.observe.metrics import Metrics
from app.protocol.errors import ERRORS
from ffn_testing import free_port, metric_value, read_rss, start_server

D_MODEL = 512
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


async def test_rows_per_request_histogram(start_app) -> None:
    served = await start_app(Settings())
    sizes = [1, 3, 17, 1500]  # 1500 is over max_batch_rows (1024): one request, two batches
    for rows in sizes:
        x = np.full((rows, D_MODEL), 0.25, dtype=np.float32)
        r = await served.client.post(
            "/v1/models/demo/transform",
            content=x.tobytes(),
            headers={"content-type": "application/octet-stream", "x-shape": f"{rows},{D_MODEL}"},
        )
        assert r.status_code == 200
    page = (await served.client.get("/metrics")).text
    assert metric_value(page, "ffn_request_rows_count", model="demo") == len(sizes)
    assert metric_value(page, "ffn_request_rows_sum", model="demo") == sum(sizes)
    for bound in ROW_BUCKETS:
        expected = sum(1 for rows in sizes if rows <= bound)
        assert metric_value(page, "ffn_request_rows_bucket", model="demo", le=f"{float(bound)}") == expected, bound
    assert metric_value(page, "ffn_batch_rows_count", model="demo") >= len(sizes) + 1  # the 1500 took two passes


def samples(page: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Every sample of `name` in Prometheus text, by its sorted labels (present at 0 or not at all)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        tuple(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(page)
        for sample in family.samples
        if sample.name == name
    }


# Every per-model series a dashboard or an alert reads, and the error table's every outcome.
PER_MODEL = (
    "ffn_request_seconds_count",
    "ffn_queue_seconds_count",
    "ffn_compute_seconds_count",
    "ffn_failed_request_seconds_count",
    "ffn_request_rows_count",
    "ffn_batch_rows_count",
    "ffn_request_compute_seconds_total",
    "ffn_oom_splits_total",
)


@pytest.mark.server
def test_a_fresh_server_has_every_series_at_zero() -> None:
    """Before any request, ffn_requests_total has every outcome at 0, so increase() sees the first error."""
    with start_server(env={"FFN_LOG_LEVEL": "warning"}) as server:
        page = httpx.get(f"{server.url}/metrics").text
    outcomes = {"ok", "internal"} | {kind.error_type for kind in ERRORS.values()}
    assert "overloaded" in outcomes and "deadline_exceeded" in outcomes and "model_error" in outcomes
    requests = samples(page, "ffn_requests_total")
    assert requests == {
        (("model", "demo"), ("outcome", outcome), ("protocol", protocol)): 0.0
        for outcome in outcomes
        for protocol in ("grpc", "http")
    }
    for name in PER_MODEL:
        assert samples(page, name) == {(("model", "demo"),): 0.0}, name
    assert samples(page, "ffn_request_seconds_bucket")[(("le", "+Inf"), ("model", "demo"))] == 0.0
    # Loads: both outcomes of the configured model, and the one label every other name's refusals share.
    assert samples(page, "ffn_model_loads_total") == {
        (("model", "demo"), ("outcome", "ok")): 0.0,
        (("model", "demo"), ("outcome", "failed")): 0.0,
        (("model", "(other)"), ("outcome", "failed")): 0.0,
    }
    assert samples(page, "ffn_model_load_seconds_count") == {(("model", "demo"),): 0.0}


async def test_whole_requests_by_protocol_route_and_status_class(start_app) -> None:
    served = await start_app(Settings(warmup=False))
    client = served.client
    x = np.full((2, D_MODEL), 0.5, dtype=np.float32)
    v2 = {"inputs": [{"name": "input", "shape": [2, D_MODEL], "datatype": "FP32", "data": x.ravel().tolist()}]}
    bad = {"inputs": [{"name": "input", "shape": [2, 3], "datatype": "FP32", "data": [0.0] * 6}]}
    sent = [
        (await client.post("/v2/models/demo/infer", json=v2)).status_code,
        (await client.post("/v2/models/demo/infer", json=v2)).status_code,
        (await client.post("/v2/models/demo/infer", json=bad)).status_code,
        (await client.post("/v2/models/no-such-model/versions/7/infer", json=v2)).status_code,
        (await client.post("/v1/models/demo/transform", json={"inputs": x.tolist()})).status_code,
        (await client.get("/v1/models")).status_code,
        (await client.get("/v2/models/demo/ready")).status_code,
        (await client.get("/no/such/path/abc123")).status_code,
        (await client.post("/v1/models/demo:predict", json={"instances": x.tolist()})).status_code,
        (await client.get("/v1/models/demo")).status_code,
        (await client.get("/")).status_code,
    ]
    assert sent == [200, 200, 400, 404, 200, 200, 200, 404, 200, 200, 200]
    page = (await client.get("/metrics")).text

    def count(protocol: str, route: str, status: str) -> float:
        return metric_value(page, "ffn_http_request_seconds_count", protocol=protocol, route=route, status=status)

    assert count("v2", "/v2/models/{name}/infer", "2xx") == 2
    assert count("v2", "/v2/models/{name}/infer", "4xx") == 1
    assert count("v2", "/v2/models/{name}/versions/{version}/infer", "4xx") == 1
    assert count("native", "/v1/models/{name}/transform", "2xx") == 1
    assert count("native", "/v1/models", "2xx") == 1
    assert count("v2", "/v2/models/{name}/ready", "2xx") == 1
    assert count("http", "unmatched", "4xx") == 1
    assert count("kserve_v1", "/v1/models/{name}:predict", "2xx") == 1
    assert count("kserve_v1", "/v1/models/{name}", "2xx") == 1
    assert count("kserve_v1", "/", "2xx") == 1
    # Templates only: no raw path, model name or version reaches a label.
    labels = {value for key in samples(page, "ffn_http_request_seconds_count") for _, value in key}
    assert not any("demo" in value or "abc123" in value or "no-such-model" in value for value in labels)
    # Each request's whole time holds its time at the batcher.
    whole = sum(
        metric_value(page, "ffn_http_request_seconds_sum", protocol=protocol, route=route, status="2xx")
        for protocol, route in (
            ("v2", "/v2/models/{name}/infer"),
            ("native", "/v1/models/{name}/transform"),
            ("kserve_v1", "/v1/models/{name}:predict"),
        )
    )
    assert whole >= metric_value(page, "ffn_request_seconds_sum", model="demo") > 0


async def test_build_info(start_app) -> None:
    served = await start_app(Settings(warmup=False))
    page = (await served.client.get("/metrics")).text
    labels = {
        "version": __version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "python": platform.python_version(),
    }
    assert metric_value(page, "ffn_build_info", **labels) == 1


async def test_process_metrics_of_this_process(start_app) -> None:
    served = await start_app(Settings(warmup=False))
    before = os.times()
    page = (await served.client.get("/metrics")).text
    after = os.times()
    me = {"pid": str(os.getpid()), "role": "server"}
    cpu = metric_value(page, "process_cpu_seconds_total", **me)
    assert before.user + before.system - 0.05 <= cpu <= after.user + after.system + 0.05
    rss = metric_value(page, "process_resident_memory_bytes", **me)
    assert rss == pytest.approx(read_rss(os.getpid()), rel=0.1)
    open_fds = metric_value(page, "process_open_fds", **me)
    assert abs(open_fds - len(os.listdir("/proc/self/fd"))) <= 5
    assert metric_value(page, "process_max_fds", **me) == float(os.sysconf("SC_OPEN_MAX"))


async def test_the_metrics_port_needs_no_key_and_serves_nothing_else(start_app) -> None:
    served = await start_app(Settings(api_key="secret", metrics_port=9100, warmup=False))
    # The same app as reached through its metrics port: the guard tells them apart by the local port.
    transport = httpx.ASGITransport(app=served.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://ffn.test:9100") as metrics_port:
        scraped = await metrics_port.get("/metrics")
        assert scraped.status_code == 200
        assert metric_value(scraped.text, "ffn_max_batch_rows", model="demo") == 1024
        for path in ("/v1/models", "/v2/health/ready", "/docs"):
            refused = await metrics_port.get(path)
            assert refused.status_code == 404 and refused.json()["error_type"] == "not_found", path
    main = await served.client.get("/metrics")
    assert main.status_code == 401 and main.json()["error_type"] == "unauthorized"
    assert (await served.client.get("/metrics", headers={"Authorization": "Bearer secret"})).status_code == 200


@pytest.mark.server
def test_a_single_process_serves_its_metrics_port_without_the_key() -> None:
    port = free_port()
    with start_server(env={"FFN_API_KEY": "secret", "FFN_METRICS_PORT": str(port)}) as server:
        assert httpx.get(server.url + "/metrics").status_code == 401
        page = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        rss = metric_value(page, "process_resident_memory_bytes", pid=str(server.pid), role="server")
        assert rss == pytest.approx(server.rss_bytes(), rel=0.1)
        assert f"metrics on http://127.0.0.1:{port}/metrics, without the API key" in server.logs()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_gpu_memory_per_device(start_app) -> None:
    served = await start_app(Settings(models=[ModelSpec(name="demo", device="cuda:0")]))
    page = (await served.client.get("/metrics")).text
    free, total = torch.cuda.mem_get_info(0)
    assert metric_value(page, "ffn_gpu_memory_total_bytes", device="cuda:0") == total
    used = metric_value(page, "ffn_gpu_memory_used_bytes", device="cuda:0")
    # At least this process's own allocations (the weights), at most the device.
    assert torch.cuda.memory_reserved(0) <= used <= total
    assert used == pytest.approx(total - free, rel=0.05)


def test_a_forgotten_model_leaves_every_series_of_its_name_and_no_other() -> None:
    """Issue 28 class 7: a model no table names, unloaded, is forgotten: every instrument with a model
    label (Metrics.by_model must list them all) drops its series, and scrapes leave out whatever the
    worker processes' files still hold of it; another model's series stay."""
    metrics = Metrics()
    instruments = [value for value in vars(metrics).values() if isinstance(value, MetricWrapperBase)]
    labelled = [i for i in instruments if "model" in i._labelnames]
    assert {id(i) for i in labelled} == {id(i) for i in metrics.by_model} and len(labelled) == 17
    for instrument in labelled:
        for model in ("gone", "kept"):
            labels = {name: model if name == "model" else "x" for name in instrument._labelnames}
            instrument.labels(**labels)
    metrics.forget_model("gone")
    for instrument in labelled:
        models = {sample.labels["model"] for family in instrument.collect() for sample in family.samples}
        assert models == {"kept"}, instrument
    # A series made again meanwhile (an answer counted as the copy retired) is left out of the page;
    # a name named again shows.
    metrics.requests.labels(model="gone", outcome="ok", protocol="http").inc()
    assert 'model="gone"' not in metrics.render().decode()
    metrics.remember_model("gone")
    assert (
        metric_value(metrics.render().decode(), "ffn_requests_total", model="gone", outcome="ok", protocol="http") == 1
    )


def test_observe_many_counts_as_observe_does() -> None:
    """observe_many (a batch's values at once) leaves a histogram as one observe per value would."""
    from prometheus_client import CollectorRegistry, Histogram

    from app.observe.metrics import LATENCY_BUCKETS, observe_many

    registry = CollectorRegistry()
    histogram = Histogram("t", "t", ["k"], buckets=LATENCY_BUCKETS, registry=registry)
    one_by_one, together = histogram.labels(k="a"), histogram.labels(k="b")
    values = [0.0, 1e-7, *LATENCY_BUCKETS[:3], LATENCY_BUCKETS[4] * 1.01, 5e3, 0.002, 0.002]
    for value in values:
        one_by_one.observe(value)
    observe_many(together, values)
    observe_many(together, [])
    samples = {(s.name, s.labels.get("le"), s.labels["k"]): s.value for s in next(iter(registry.collect())).samples}
    for (name, le, k), value in samples.items():
        if k == "a":
            assert samples[name, le, "b"] == value, (name, le)
    assert samples["t_count", None, "b"] == len(values)
    assert samples["t_sum", None, "b"] == pytest.approx(sum(values))
