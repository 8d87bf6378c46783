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

from app import __version__
from app.settings import ModelSpec, Settings
from ffn_client.testing import free_port, metric_value, read_rss, start_server

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
