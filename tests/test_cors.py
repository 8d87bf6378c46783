"""CORS when FFN_CORS_ORIGINS names origins: allowed ones get the Access-Control-* headers, others none.

(Off by default: test_hostile checks a server without it sends none.)
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from app.config.settings import Settings
from tests.reference import demo_reference

ALLOWED = "https://app.example"
OTHER = "https://evil.example"
V1 = "/v1/models/demo/transform"


@pytest.fixture
async def client(start_app) -> httpx.AsyncClient:
    settings = Settings(cors_origins=[ALLOWED, "https://second.example"], warmup=False)
    return (await start_app(settings)).client


def preflight(origin: str) -> dict[str, str]:
    return {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type, x-shape, x-dtype",
    }


def test_the_setting_reads_a_list_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FFN_CORS_ORIGINS", f'["{ALLOWED}", "https://second.example"]')
    assert Settings().cors_origins == [ALLOWED, "https://second.example"]


async def test_preflight_from_an_allowed_origin_is_allowed(client: httpx.AsyncClient) -> None:
    r = await client.options(V1, headers=preflight(ALLOWED))
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == ALLOWED
    assert "POST" in r.headers["access-control-allow-methods"]
    allowed_headers = r.headers["access-control-allow-headers"].lower()
    assert all(name in allowed_headers for name in ("content-type", "x-shape", "x-dtype"))


async def test_preflight_from_another_origin_is_refused(client: httpx.AsyncClient) -> None:
    r = await client.options(V1, headers=preflight(OTHER))
    assert r.status_code == 400
    assert "access-control-allow-origin" not in r.headers
    assert r.json()["error_type"] == "invalid_input" and "Disallowed CORS origin" in r.json()["error"]


async def test_a_post_from_an_allowed_origin_may_read_the_answer_and_its_shape_headers(
    client: httpx.AsyncClient,
) -> None:
    x = np.random.default_rng(0).standard_normal((2, 512)).astype(np.float32)
    headers = {
        "Origin": ALLOWED,
        "Content-Type": "application/octet-stream",
        "Accept": "application/octet-stream",
        "X-Shape": "2,512",
        "X-Dtype": "float32",
    }
    r = await client.post(V1, content=x.tobytes(), headers=headers)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == ALLOWED
    exposed = {name.strip().lower() for name in r.headers["access-control-expose-headers"].split(",")}
    assert {"x-shape", "x-dtype"} <= exposed
    y = np.frombuffer(r.content, dtype="<f4").reshape(2, 512)
    np.testing.assert_allclose(y, demo_reference(x), rtol=1e-5, atol=1e-5)


async def test_a_post_from_another_origin_gets_no_cors_headers(client: httpx.AsyncClient) -> None:
    r = await client.post(V1, json={"inputs": [[0.0] * 512]}, headers={"Origin": OTHER})
    assert r.status_code == 200  # CORS is the browser's check; the server only withholds the grant
    # (Starlette sends Access-Control-Expose-Headers to everyone; without Allow-Origin it grants nothing.)
    assert not any(name.startswith("access-control-allow-") for name in r.headers)
