"""What app/http/transport/protocol.py uses of uvicorn beyond its public API, checked before serving.

The protocol subclasses uvicorn's `HttpToolsProtocol` and reads private members of it and of its
`RequestResponseCycle`. pyproject pins uvicorn to the releases the tests ran on; a uvicorn
installed outside that range (by hand, or by another package's needs) would otherwise fail
mid-request with an AttributeError. `mismatch()` names the missing members instead, once,
at start-up.
"""

from __future__ import annotations

import asyncio
import logging
import re
from importlib.metadata import PackageNotFoundError, requires, version

from uvicorn import Config
from uvicorn.protocols.http import flow_control, httptools_impl
from uvicorn.server import ServerState

# Kept in step with protocol.py: every uvicorn name it reads or overrides.
MODULE = ("STATUS_LINE", "HttpToolsProtocol", "RequestResponseCycle")
FLOW_MODULE = ("FlowControl",)
PROTOCOL_METHODS = (
    "_should_upgrade",
    "_unset_keepalive_if_required",
    "send_400_response",
    "connection_made",
    "connection_lost",
    "data_received",
    "on_message_begin",
    "on_url",
    "on_header",
    "on_headers_complete",
    "on_body",
    "on_message_complete",
    "on_response_complete",
    "pause_writing",
    "resume_writing",
)
PROTOCOL_STATE = (
    "app",
    "loop",
    "parser",
    "connections",
    "server_state",
    "pipeline",
    "cycle",
    "transport",
    "flow",
    "scope",
    "headers",
    "expect_100_continue",
    "asgi_version",
    "root_path",
    "app_state",
    "server",
    "client",
    "scheme",
    "access_log",
    "access_logger",
)
FLOW_STATE = ("read_paused", "pause_reading", "resume_reading")
SERVER_STATE = ("default_headers",)
CYCLE_STATE = (
    "response_started",
    "response_complete",
    "disconnected",
    "message_event",
    "scope",
    "keep_alive",
    "transport",
)


def missing() -> list[str]:
    """The members protocol.py relies on that this uvicorn lacks, as `Owner.name`; empty when all are there."""
    absent = [f"httptools_impl.{name}" for name in MODULE if not hasattr(httptools_impl, name)]
    absent += [f"flow_control.{name}" for name in FLOW_MODULE if not hasattr(flow_control, name)]
    if absent:
        return absent
    protocol_class = httptools_impl.HttpToolsProtocol
    absent = [
        f"HttpToolsProtocol.{name}" for name in PROTOCOL_METHODS if not callable(getattr(protocol_class, name, None))
    ]
    if absent:
        return absent
    # Attributes set in __init__ exist only on an instance: build one, as uvicorn does per connection.
    config = Config(app=_no_app, log_config=None)
    config.load()
    loop = asyncio.new_event_loop()
    try:
        protocol = protocol_class(config=config, server_state=ServerState(), app_state={}, _loop=loop)
        cycle = httptools_impl.RequestResponseCycle(
            scope={},  # type: ignore[typeddict-item]
            transport=None,  # type: ignore[arg-type]
            flow=None,  # type: ignore[arg-type]
            logger=logging.getLogger("uvicorn.error"),
            access_logger=logging.getLogger("uvicorn.access"),
            access_log=False,
            default_headers=[],
            message_event=asyncio.Event(),
            expect_100_continue=False,
            keep_alive=True,
            on_response=lambda: None,
        )
    finally:
        loop.close()
    absent = [f"HttpToolsProtocol.{name}" for name in PROTOCOL_STATE if not hasattr(protocol, name)]
    absent += [f"ServerState.{name}" for name in SERVER_STATE if not hasattr(protocol.server_state, name)]
    absent += [f"RequestResponseCycle.{name}" for name in CYCLE_STATE if not hasattr(cycle, name)]
    flow = flow_control.FlowControl(None)  # type: ignore[arg-type]
    absent += [f"FlowControl.{name}" for name in FLOW_STATE if not hasattr(flow, name)]
    return absent


def mismatch() -> str | None:
    """One line saying which member this uvicorn lacks, or None when protocol.py can run on it."""
    absent = missing()
    if not absent:
        return None
    return (
        f"uvicorn {version('uvicorn')} lacks {', '.join(absent)}, which app/http/transport/protocol.py relies on: "
        f"install {_pinned_uvicorn()}"
    )


def _pinned_uvicorn() -> str:
    """The uvicorn requirement of the installed ffn-serve (pyproject's pin), e.g. `uvicorn<0.55,>=0.30.6`."""
    try:
        found = [r for r in requires("ffn-serve") or [] if re.match(r"uvicorn\b", r)]
    except PackageNotFoundError:
        found = []
    return found[0].split(";")[0].strip() if found else "the uvicorn release pyproject.toml pins"


async def _no_app(scope: object, receive: object, send: object) -> None:
    """The ASGI app of the protocol built only to be looked at; never called."""
    raise AssertionError("the member check's protocol served a request. This is a bug.")
