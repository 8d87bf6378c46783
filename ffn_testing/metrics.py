"""Reading a server's /metrics in a test: one sample's value, and waiting until a page shows something."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx


async def wait_for_metrics(
    client: httpx.AsyncClient, ready: Callable[[str], bool], what: str, timeout: float = 60.0
) -> str:
    """Poll `client`'s /metrics until `ready(page)` and return that page; AssertionError naming
    `what` after `timeout` seconds (a wait with a bound, so that a hang fails instead)."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + timeout
    while loop.time() < give_up:
        response = await client.get("/metrics")
        assert response.status_code == 200, f"/metrics answered {response.status_code}"
        if ready(response.text):
            return response.text
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out after {timeout:g} s waiting for: {what}")


def metric_value(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels`, in Prometheus text (0.0: none yet).

    Labels left out are summed over, as PromQL's `sum` does (e.g. ffn_requests_total over both doors).
    """
    # prometheus_client comes with the loadtest and test extras, not with the client library.
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        float(sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )
