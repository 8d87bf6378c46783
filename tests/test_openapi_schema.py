"""The OpenAPI page against the running service, with schemathesis (4.x).

Every operation of a real `ffn-serve` process's /openapi.json gets generated requests, valid and
invalid ones (random model names, shapes, headers, bodies): no 5xx, every status documented,
every body and header as the page describes. Bounded: a few examples per operation.

Not checked: that schema-valid requests are accepted (positive_data_acceptance). The page can
not say that the last dimension must be the model's d_model (512 here), so most generated
tensors are rightly refused with a documented 400.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from ffn_testing import ServerProcess, start_server

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    env = {"FFN_WARMUP": "0", "FFN_MAX_BODY_BYTES": str(1 << 20), "FFN_DEFAULT_TIMEOUT_MS": "10000"}
    with start_server(env=env) as srv:
        yield srv


@pytest.fixture
def api_schema(server: ServerProcess) -> schemathesis.schemas.BaseSchema:
    config = schemathesis.Config.from_dict({"generation": {"mode": "all"}})
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json", config=config, timeout=10)


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(
    max_examples=20,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture],
)
def test_api_conforms_to_its_openapi_page(case: schemathesis.Case, server: ServerProcess) -> None:
    case.call_and_validate(base_url=server.url, checks=CHECKS, timeout=30)
    assert server.proc.poll() is None, "the server died"
