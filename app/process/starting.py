"""A SIGTERM or SIGINT while the process starts stops the start: exit 0, as a drain would.

From the settings to the moment uvicorn runs (ports bound, torch imported, every model read
and placed), the process had Python's own signal handling: SIGTERM killed it (status -15, not
0), SIGINT raised KeyboardInterrupt through the load, and nothing at all where a shell had
started it in the background, which leaves SIGINT ignored: a Ctrl-C or `kill -INT` during a
long load was lost and the server went on to serve. Within `Starting`, either signal raises
StartStopped in the main thread at its next Python line (a tensor read under way ends first),
and the command, or the worker, exits 0 with a log line. Once uvicorn runs, its handlers take
over (app/process/server.py: a signal before it serves stops the start there too, after that it drains).

SIGINT is taken even where it was inherited ignored: uvicorn takes it once serving anyway, and
docs/install.md promises that Ctrl-C stops ffn-serve the way `kill` does.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any

STOPPING_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StartStopped(BaseException):
    """A SIGTERM or SIGINT arrived while starting. A BaseException, as KeyboardInterrupt, so that
    no `except Exception` on the way (a model's load reports its errors) takes it for a failure."""

    def __init__(self, signum: int) -> None:
        self.name = signal.Signals(signum).name
        super().__init__(f"received {self.name} while starting")


class Starting:
    """SIGTERM and SIGINT raise StartStopped from `__enter__` until `end()` (or the block's end).

    `end()` comes just before the server installs its own handlers: they must not find ours to
    restore and call afterwards. Entering again, or ending again, does nothing.
    """

    def __init__(self) -> None:
        self._previous: dict[int, Any] | None = None
        self._raised = False
        self.stopped: StartStopped | None = None  # the signal that stopped the start, once one came

    def stopped_the(self, code: int) -> bool:
        """Whether a start that ended with exit `code` was in fact stopped by a signal.

        StartStopped is raised wherever the main thread is when the signal comes; raised inside a
        call back into Python from C (torch reading a tensor), it can come out as that code's own
        error instead (ValueError: could not determine the shape of object type ...), and the start
        fails as if its model were bad. Whatever failed after the signal came is the signal's doing.
        """
        return code != 0 and self.stopped is not None

    def __enter__(self) -> Starting:
        if self._previous is None and threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._stop) for sig in STOPPING_SIGNALS}
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.end()

    def end(self) -> None:
        """The start is over (or handed to a server that handles signals itself): the previous handlers again."""
        if self._previous is not None:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
            self._previous = None

    def _stop(self, signum: int, frame: FrameType | None) -> None:
        # Once: a second signal while the first unwinds the start must not interrupt its clean-up.
        if not self._raised:
            self._raised = True
            self.stopped = StartStopped(signum)
            raise self.stopped
