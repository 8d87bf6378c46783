"""Logging for the whole process, ours and uvicorn's, in one format: text or one JSON object a line.

uvicorn is started with `log_config=None`, so its loggers (`uvicorn.error`, `uvicorn.access`)
carry no handlers of their own and reach the root handler configured here. JSON lines suit log
collectors (Loki, CloudWatch, Elasticsearch); access-log records keep their fields apart there
(client, method, path, status) instead of one formatted string.

A record made while a request is served (the access log's line among them) carries that
request's id (X-Request-Id) and, for a V2 request that sent one, its `id`: `request_id` and `id`
in JSON, ` request_id=... id="..."` at the end of a text line. The V2 id is the client's own
text: a line holds at most MAX_LOGGED_ID characters of it, and a text line JSON-quotes it (no
newline or quote of it can forge a line).
"""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime
from typing import Literal

import orjson

from app.request_context import current

LogFormat = Literal["text", "json"]
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# uvicorn's access records carry (client, method, path, http_version, status) as their args.
_ACCESS_FIELDS = ("client", "method", "path", "http_version", "status")
MAX_LOGGED_ID = 256  # a V2 `id` is any string the client sent; a log line shows this much of it


class RequestIds(logging.Filter):
    """Adds the current request's ids to each record made while it is served (None outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        context = current()
        record.request_id = context.request_id if context is not None else None
        v2_id = context.v2_id if context is not None else None
        record.v2_id = v2_id if v2_id is None or len(v2_id) <= MAX_LOGGED_ID else v2_id[:MAX_LOGGED_ID] + "..."
        return True


class TextFormatter(logging.Formatter):
    """The text line, and the request's ids at its end when it was made while a request was served."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        request_id = getattr(record, "request_id", None)
        if request_id is None:
            return line
        line += f" request_id={request_id}"
        v2_id = getattr(record, "v2_id", None)
        if v2_id is not None:
            line += " id=" + orjson.dumps(v2_id).decode()
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, the worker if any, and the traceback if any."""

    def __init__(self, worker: int | None = None) -> None:
        super().__init__()
        self._worker = worker

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if self._worker is not None:
            entry.update(worker=self._worker, pid=record.process)
        if record.name == "uvicorn.access" and isinstance(record.args, tuple) and len(record.args) == 5:
            entry.update(zip(_ACCESS_FIELDS, record.args, strict=False))
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            entry["request_id"] = request_id
            v2_id = getattr(record, "v2_id", None)
            if v2_id is not None:
                entry["id"] = v2_id
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


def configure_logging(level: str, log_format: LogFormat, worker: int | None = None) -> None:
    """One handler on the root logger, on stderr; every library logger propagates to it.

    `worker`: the worker process's number, added to each record so that the lines of several
    processes sharing one stream can be told apart.
    """
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter(worker))
    else:
        prefix = "" if worker is None else f"[worker {worker}] "
        handler.setFormatter(TextFormatter(TEXT_FORMAT.replace("%(name)s", prefix + "%(name)s")))
    handler.addFilter(RequestIds())
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers = []
        logging.getLogger(name).propagate = True
