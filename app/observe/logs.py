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

What is logged can change at runtime (the V2 logging extension): `LogSettings` switches each
severity on or off, as Triton's log_info / log_warning / log_error / log_verbose_level do, and
picks the format; `apply_log_settings` sets this process's loggers and handler to them, and
`current_log_settings` reads them back from that handler.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

import orjson

from app.observe.identity import current

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


# uvicorn sets these loggers' own levels from its log_level: a new level must reach them too.
_UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")


@dataclass(frozen=True)
class LogSettings:
    """Which severities are logged, in Triton's terms, and the format. Critical records always are."""

    info: bool = True
    warning: bool = True
    error: bool = True
    verbose_level: int = 0  # above 0: debug records too
    format: LogFormat = "text"

    @classmethod
    def from_level(cls, level: str, log_format: LogFormat) -> LogSettings:
        """The settings that log `level` (debug, info, warning, error, critical) and above."""
        threshold = logging.getLevelNamesMapping()[level.upper()]
        return cls(
            info=threshold <= logging.INFO,
            warning=threshold <= logging.WARNING,
            error=threshold <= logging.ERROR,
            verbose_level=1 if threshold <= logging.DEBUG else 0,
            format=log_format,
        )

    def lowest_level(self) -> int:
        """The lowest level any switched-on severity needs: the loggers' level, so that off costs nothing."""
        for enabled, level in (
            (self.verbose_level > 0, logging.DEBUG),
            (self.info, logging.INFO),
            (self.warning, logging.WARNING),
            (self.error, logging.ERROR),
        ):
            if enabled:
                return level
        return logging.CRITICAL


class _Severities(logging.Filter):
    """Passes a record when its severity is switched on; the switches are independent, as in Triton."""

    def __init__(self) -> None:
        super().__init__()
        self.settings = LogSettings()

    def filter(self, record: logging.LogRecord) -> bool:
        s, level = self.settings, record.levelno
        if level >= logging.CRITICAL:
            return True
        if level >= logging.ERROR:
            return s.error
        if level >= logging.WARNING:
            return s.warning
        if level >= logging.INFO:
            return s.info
        return s.verbose_level > 0


class _ServiceHandler(logging.StreamHandler):
    """The one handler on the root logger: stderr, the severity switches, the worker's number."""

    def __init__(self, worker: int | None) -> None:
        super().__init__(sys.stderr)
        self.worker = worker
        self.severities = _Severities()
        self.addFilter(self.severities)
        self.addFilter(RequestIds())


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
    root = logging.getLogger()
    root.handlers = [_ServiceHandler(worker)]
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers = []
        logging.getLogger(name).propagate = True
    apply_log_settings(LogSettings.from_level(level, log_format))


def _formatter(log_format: LogFormat, worker: int | None) -> logging.Formatter:
    if log_format == "json":
        return JsonFormatter(worker)
    prefix = "" if worker is None else f"[worker {worker}] "
    return TextFormatter(TEXT_FORMAT.replace("%(name)s", prefix + "%(name)s"))


def _service_handler() -> _ServiceHandler | None:
    return next((h for h in logging.getLogger().handlers if isinstance(h, _ServiceHandler)), None)


def apply_log_settings(settings: LogSettings) -> None:
    """Log what `settings` switch on, in its format, from now on in this process."""
    level = settings.lowest_level()
    logging.getLogger().setLevel(level)
    for name in _UVICORN_LOGGERS:
        logger = logging.getLogger(name)
        if logger.level != logging.NOTSET:  # uvicorn set its own: keep it in step
            logger.setLevel(level)
    handler = _service_handler()
    if handler is not None:
        if handler.formatter is None or handler.severities.settings.format != settings.format:
            handler.setFormatter(_formatter(settings.format, handler.worker))
        handler.severities.settings = settings
    else:  # logging left to the host (an app in a test): the level is all there is to set
        _UNHANDLED.settings = settings


_UNHANDLED = _Severities()  # the settings asked for where configure_logging was not called


def current_log_settings() -> LogSettings:
    """What this process logs now: its handler's switches and format."""
    handler = _service_handler()
    return handler.severities.settings if handler is not None else _UNHANDLED.settings
