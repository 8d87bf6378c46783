"""/docs and /redoc work with no internet: every file the pages load is served by ffn-serve itself."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import httpx
import pytest

from app.http.docs_assets import ASSETS_DIR


class References(HTMLParser):
    """Every URL a page loads by itself: script src, link href, img src."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        wanted = {"script": "src", "link": "href", "img": "src"}.get(tag)
        self.urls += [value for name, value in attrs if name == wanted and value]


def references(html: str) -> list[str]:
    parser = References()
    parser.feed(html)
    return parser.urls


CONTENT_TYPES = {".js": "javascript", ".css": "text/css", ".png": "image/png"}


@pytest.mark.parametrize(("page", "spec_pattern"), [("/docs", r"url: '([^']+)'"), ("/redoc", r'spec-url="([^"]+)"')])
def test_docs_pages_load_only_files_the_server_serves(demo_server, page, spec_pattern):
    with httpx.Client(base_url=demo_server.url, trust_env=False) as http:
        response = http.get(page)
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
        html = response.text
        urls = references(html)
        assert len(urls) >= 2, f"{page} loads no script or stylesheet: {html[:300]}"
        # Same origin only: a host-qualified URL (https://cdn..., //cdn...) would need the internet.
        assert [u for u in urls if re.match(r"^(?:[a-z]+:)?//", u)] == []
        assert "fonts.googleapis" not in html and "validator.swagger.io" not in html
        for url in urls:
            asset = http.get(url)
            assert asset.status_code == 200, url
            suffix = url[url.rfind(".") :]
            assert CONTENT_TYPES[suffix] in asset.headers["content-type"], (url, asset.headers["content-type"])
            assert asset.content == (ASSETS_DIR / url.rsplit("/", 1)[-1]).read_bytes()
        spec_url = re.search(spec_pattern, html)
        assert spec_url is not None, html
        assert http.get(spec_url.group(1)).json()["openapi"].startswith("3.1")


def test_bundled_swagger_ui_renders_openapi_3_1():
    """FastAPI writes OpenAPI 3.1; Swagger UI before 5 shows "Unable to render this definition" for it."""
    bundle = (ASSETS_DIR / "swagger-ui-bundle.js").read_text(encoding="utf-8")
    assert "SwaggerUIBundle" in bundle and "spec.openapis.org/oas/3.1" in bundle


def test_swagger_oauth2_redirect_page_is_served(demo_server):
    response = httpx.get(demo_server.url + "/docs/oauth2-redirect", trust_env=False)
    assert response.status_code == 200 and "oauth2" in response.text.lower()
