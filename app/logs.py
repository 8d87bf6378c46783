"""Logging for the whole process, ours and uvicorn's, in one format: text or one JSON object a line.

uvicorn is started with `log_config=None`, so its loggers (`uvicorn.error`, `uvicorn.access`)
carry no handlers of their own and reach the root handler configured here. JSON lines suit log
collectors (Loki, CloudWatch, Elasticsearch); access-log records keep their fields apart there
(client, method, path, status) instead of one formatted string.
"""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime
from typing import Literal

import orjson

LogFormat = Literal["text", "json"]
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# uvicorn's access records carry (client, method, path, http_version, status) as their args.
_ACCESS_FIELDS = ("client", "method", "path", "http_version", "status")


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
        handler.setFormatter(logging.Formatter(TEXT_FORMAT.replace("%(name)s", prefix + "%(name)s")))
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers = []
        logging.getLogger(name).propagate = True
