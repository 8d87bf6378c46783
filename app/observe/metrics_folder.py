"""The folder where worker processes keep their metrics (prometheus_client's multiprocess mode).

Unset (`metrics_dir`): a fresh temporary folder, removed at exit. Set: the operator's folder (a
tmpfs or emptyDir under a read-only root file system, say), checked at start, emptied of the
metrics files a previous run left there (their counts would add to this run's), never removed.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# prometheus_client names each process's files <kind>_<pid>.db (kind: counter, histogram,
# summary, gauge_<mode>); the supervisor adds its list of processes. Nothing else is removed.
_METRICS_FILE = re.compile(r"(counter|histogram|summary|gauge_\w+)_\d+\.db")
_TEMPORARY_PREFIX = "ffn-metrics-"


class MetricsFolderError(Exception):
    """No usable folder for the workers' metrics; the message is one line for the operator."""


def check_metrics_dir(setting: Path | None) -> None:
    """Raise MetricsFolderError unless the workers' metrics folder can be written (or, unset, made)."""
    if setting is None:
        try:
            with tempfile.TemporaryDirectory(prefix=_TEMPORARY_PREFIX):
                return
        except OSError as exc:
            raise MetricsFolderError(
                f"metrics_dir (unset): no writable temporary folder for the worker processes' metrics "
                f"({_reason(exc)}): set FFN_METRICS_DIR to a writable folder such as a tmpfs, or mount one at /tmp"
            ) from None
    if not setting.is_dir():
        what = "does not exist" if not setting.exists() else "is not a folder"
        raise MetricsFolderError(f"metrics_dir (FFN_METRICS_DIR): {setting} {what}")
    try:
        with tempfile.TemporaryFile(dir=setting):
            pass
    except OSError as exc:
        raise MetricsFolderError(f"metrics_dir (FFN_METRICS_DIR): {setting} is not writable: {_reason(exc)}") from None


@contextmanager
def metrics_folder(setting: Path | None) -> Iterator[Path]:
    """The folder for this run: the setting's, emptied of stale metrics files; or a temporary one, removed after."""
    if setting is None:
        folder = Path(tempfile.mkdtemp(prefix=_TEMPORARY_PREFIX))
        try:
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return
    from app.observe.collectors import (
        PROCESSES_FILE,  # here: collectors imports torch, which the start-up check must not
    )

    for path in setting.iterdir():
        if _METRICS_FILE.fullmatch(path.name) or path.name.lstrip(".").startswith(PROCESSES_FILE):
            path.unlink(missing_ok=True)
    yield setting


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)
