"""Liveness: what the supervisor knows of each worker position, and when it gives up on the worker in it.

A worker is judged only over time the supervisor itself ran (issue 28, class 8): a worker is
silent when the supervisor, running, heard nothing from it, never because the supervisor was not
there to hear. The supervisor (app/process/supervisor.py) acts on the verdicts; the rules:

- A ready worker's event loop beats every half second (app/engine/loop_watch.py). One silent for
  `heartbeat_timeout_s` is asked to drain (SIGTERM): its loop may be held by work (a huge body
  parsed on a loaded machine) rather than hung, and a drain answers what it accepted (200, or 503
  for work it had not begun) once the loop runs again. Still silent `heartbeat_timeout_s` later,
  it is killed (SIGKILL: stopped, deadlocked, or hung in C), and the requests it holds are lost
  with it, their connections closed: the kill is the last resort, logged with why. Beating again,
  it is draining, and is killed only if it outlives the drain's own deadline.
- A starting worker beats from a thread while it loads. One silent for STARTING_SILENCE_S
  (stopped), or not ready within `worker_start_timeout_s` (hung loading), is killed at once: it
  has accepted nothing yet.
- The supervisor's own time. Its loop turns at least every TURN_S (a wake-up with nothing to do),
  so a turn that comes later means the supervisor did not run for the excess: stopped (SIGSTOP),
  starved of CPU, or its machine paused. `Slot.resumed` moves every deadline on by that excess,
  which is no worker's silence or lateness; and the supervisor reads all that a worker's pipe
  holds before judging it, so the beats that queued meanwhile count.
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import NamedTuple

from app.config.settings import Settings
from app.process.listeners import CONNECTION_CLOSE_GRACE_S

TURN_S = 0.5  # the supervisor's loop turns at least this often
# A starting worker silent this long is stopped: its beat thread waits for the interpreter, which
# an import or a model's load can hold for a second or two, never for this long.
STARTING_SILENCE_S = 30.0
# After the drain timeout and the connections' close grace, a draining worker still running is killed.
STOP_MARGIN_S = 10.0

# What a worker failed, as a verdict names it.
SILENT = "silent"  # a ready worker's beats stopped: asked to drain
SILENT_DRAINING = "silent draining"  # and stayed silent once asked: killed
DRAIN_OVERDUE = "drain overdue"  # it drains, past the drain's deadline: killed
SILENT_STARTING = "silent starting"  # a starting worker's beats stopped: killed
LATE = "late"  # not ready within worker_start_timeout_s: killed


def drain_allowance_s(settings: Settings) -> float:
    """How long a worker asked to drain may take to exit: its drain, the connections' close grace, a margin."""
    return settings.drain_timeout_s + CONNECTION_CLOSE_GRACE_S + STOP_MARGIN_S


@dataclass(eq=False)
class Slot:
    """One worker position: the process in it now, how it is doing, and how often it has died lately.

    Every time here is on time.monotonic(), moved on by the stretches the supervisor did not run.
    """

    index: int
    process: BaseProcess | None = None
    conn: Connection | None = None
    ready: bool = False
    ready_at: float = 0.0
    started_at: float = 0.0
    beat_at: float | None = None  # its last heartbeat; None: none yet since its start, or killed
    drain_asked_at: float | None = None  # when it was asked to drain for its silence
    killed: bool = False  # killed as silent or late; its exit is on the way
    failures: int = 0
    restart_at: float | None = None

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def resumed(self, lost_s: float) -> None:
        """The supervisor did not run for `lost_s` seconds: none of them counts against this worker."""
        self.started_at += lost_s
        if self.beat_at is not None:
            self.beat_at += lost_s
        if self.drain_asked_at is not None:
            self.drain_asked_at += lost_s


class Verdict(NamedTuple):
    """What the supervisor does to a worker at `at` unless it hears from it first."""

    at: float
    what: str  # SILENT, SILENT_DRAINING, DRAIN_OVERDUE, SILENT_STARTING or LATE
    kill: bool  # SIGKILL; else SIGTERM, a drain


def verdict(slot: Slot, settings: Settings) -> Verdict | None:
    """When and how the supervisor gives up on `slot`'s worker if nothing changes; None: it never does."""
    if slot.process is None or slot.killed:
        return None
    silence = settings.heartbeat_timeout_s
    if slot.ready:
        if slot.beat_at is None:
            return None
        if slot.drain_asked_at is None:
            return Verdict(slot.beat_at + silence, SILENT, kill=False)
        if slot.beat_at > slot.drain_asked_at:  # its loop came back: it drains
            return Verdict(slot.drain_asked_at + drain_allowance_s(settings), DRAIN_OVERDUE, kill=True)
        return Verdict(slot.drain_asked_at + silence, SILENT_DRAINING, kill=True)
    late = Verdict(slot.started_at + settings.worker_start_timeout_s, LATE, kill=True)
    if slot.beat_at is None:
        return late
    return min(late, Verdict(slot.beat_at + STARTING_SILENCE_S, SILENT_STARTING, kill=True))


def reason(slot: Slot, what: str, now: float, settings: Settings) -> str:
    """The log line's account of a verdict, for the worker in `slot` at `now`."""
    silent_for = now - (slot.beat_at or now)
    asked_for = now - (slot.drain_asked_at or now)
    return {
        SILENT: f"sent no heartbeat for {silent_for:.1f} s (heartbeat_timeout_s) while the supervisor ran: its event "
        "loop is held, stopped or hung; asking it to drain (SIGTERM), which answers what it accepted if its loop "
        f"comes back, else it is killed in {settings.heartbeat_timeout_s:g} s",
        SILENT_DRAINING: f"sent no heartbeat for {asked_for:.1f} s more after it was asked to drain: it is stopped "
        "or hung; killing it (the requests it holds are lost, their connections closed)",
        DRAIN_OVERDUE: f"still runs {asked_for:.1f} s after it was asked to drain "
        f"(drain_timeout_s {settings.drain_timeout_s:g}); killing it",
        SILENT_STARTING: f"sent no heartbeat for {silent_for:.1f} s while starting: it is stopped; killing it",
        LATE: f"was not ready {now - slot.started_at:.1f} s after its start (worker_start_timeout_s "
        f"{settings.worker_start_timeout_s:g}): it is hung loading or warming up; killing it",
    }[what]
