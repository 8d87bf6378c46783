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

# Kept in step with protocol.py: every uvicorn name it reads or overrides, by where it must be found.
# In uvicorn's modules:
IN_MODULES: dict[str, tuple[str, ...]] = {
    "httptools_impl": ("STATUS_LINE", "HttpToolsProtocol", "RequestResponseCycle"),
    "flow_control": ("FlowControl",),
}
# Methods of HttpToolsProtocol, callable on the class:
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
    "_start_asgi_task",
    "timeout_keep_alive_handler",
    "pause_writing",
    "resume_writing",
)
# Attributes set in __init__, found on an instance of each class:
ON_INSTANCES: dict[str, tuple[str, ...]] = {
    "HttpToolsProtocol": (
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
        "timeout_keep_alive",
    ),
    "ServerState": ("default_headers", "total_requests"),
    "RequestResponseCycle": (
        "response_started",
        "response_complete",
        "disconnected",
        "message_event",
        "scope",
        "keep_alive",
        "transport",
    ),
    "FlowControl": ("read_paused", "pause_reading", "resume_reading"),
}


def missing() -> list[str]:
    """The members protocol.py relies on that this uvicorn lacks, as `Owner.name`; empty when all are there."""
    modules = {"httptools_impl": httptools_impl, "flow_control": flow_control}
    absent = [
        f"{owner}.{name}" for owner, names in IN_MODULES.items() for name in names if not hasattr(modules[owner], name)
    ]
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
    instances = {
        "HttpToolsProtocol": protocol,
        "ServerState": protocol.server_state,
        "RequestResponseCycle": cycle,
        "FlowControl": flow_control.FlowControl(None),  # type: ignore[arg-type]
    }
    return [
        f"{owner}.{name}"
        for owner, names in ON_INSTANCES.items()
        for name in names
        if not hasattr(instances[owner], name)
    ]


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
