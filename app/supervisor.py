"""Supervisor: N worker processes on the parent's listening sockets, each with its own models.

The parent binds the port, then starts the workers (spawned: a fresh interpreter each, so no
CUDA or thread state is inherited) and hands them the bound sockets. Each worker loads its
models, warms up, and only then accepts connections, telling the parent "ready" over a pipe:
a connection is only ever accepted by a warm worker.

- A worker that dies is started again after a backoff (0.5 s, doubling to 30 s; back to 0.5 s
  once a worker has stayed up 30 s), with a log line.
- A ready worker's event loop beats every half second (app/engine/loop_watch.py); one silent for
  `heartbeat_timeout_s` (stopped, hung, its loop blocked) is killed with SIGKILL, with a log line,
  and started again like any dead worker: its clients see their connections close, not a hang.
- A starting worker beats from a thread of its own while it loads and warms up; one silent for
  STARTING_SILENCE_S (stopped), or not ready within `worker_start_timeout_s` (hung loading), is
  killed the same way. Its beats say only that it runs, not that it progresses: loading holds
  the interpreter for a second or more at times, hence the longer silence allowed, and the deadline.
- A worker that exits before the service was first ready stops the start: the others are
  stopped and the parent exits with that worker's code (no restart loop on a bad model).
- SIGTERM or SIGINT is passed to every worker, which drains what it accepted; the parent exits
  0 once all have exited 0, its metrics folder removed. A second signal is passed on too (the
  workers then exit at once).
- SIGHUP goes to one ready worker, which reads the config file again and loads, reloads or
  unloads what changed in every worker (app/control.py carries it); the workers started later
  replay those loads.
- If the parent dies, each worker sees its pipe close and drains and exits by itself.
- Metrics: the workers write theirs in one folder (prometheus_client's multiprocess mode): a fresh
  one removed at exit, or `metrics_dir` (app/metrics_folder.py); a dead worker's gauges are
  dropped, its counters kept.
- Control (app/control.py): a command one worker broadcasts is relayed to every live worker and
  their replies back to it; sticky commands are replayed to every worker started later.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType

from prometheus_client import multiprocess

from app.collectors import write_processes
from app.control import HEARTBEAT, READY, Control
from app.exits import EXIT_OK, EXIT_START_FAILED
from app.listeners import CONNECTION_CLOSE_GRACE_S, Listeners, log_start
from app.logs import configure_logging
from app.metrics import MULTIPROCESS_VARIABLE, Metrics
from app.metrics_folder import metrics_folder
from app.relay import Relay
from app.settings import Settings
from app.starting import Starting, StartStopped

log = logging.getLogger("ffn_serve.supervisor")

FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.5, 30.0
STABLE_AFTER_S = 30.0  # a worker that served this long resets its slot's backoff
# After the drain timeout and uvicorn's grace, a worker still running is killed.
STOP_MARGIN_S = 10.0
STARTING_BEAT_S = 0.5  # a starting worker's heartbeats, from a thread while it loads
# A starting worker silent this long is stopped: its beat thread waits for the interpreter, which
# an import or a model's load can hold for a second or two, never for this long.
STARTING_SILENCE_S = 30.0


def threads_per_worker(settings: Settings) -> int:
    """torch threads for each worker: the setting (one in batch-invariant mode), or this process's cores shared out."""
    return settings.intra_op_threads() or max(1, len(os.sched_getaffinity(0)) // settings.workers)


@dataclass(eq=False)
class Slot:
    """One worker position: the process in it now, and how often it has died lately."""

    index: int
    process: BaseProcess | None = None
    conn: Connection | None = None
    ready: bool = False
    ready_at: float = 0.0
    started_at: float = 0.0
    beat_at: float | None = None  # its last heartbeat; None: none yet since its start, or killed
    killed: bool = False  # killed as silent or late; its exit is on the way
    failures: int = 0
    restart_at: float | None = None

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid


class Supervisor:
    """Start, watch and stop `settings.workers` worker processes on `listeners`."""

    def __init__(self, settings: Settings, listeners: Listeners) -> None:
        self.settings = settings
        self.listeners = listeners
        self.threads = threads_per_worker(settings)
        self._worker_settings = settings.model_copy(update={"torch_threads": self.threads})
        self._context = multiprocessing.get_context("spawn")
        self._slots = [Slot(i + 1) for i in range(settings.workers)]
        self._folder = Path()
        self._serving = False  # every worker has been ready once
        self._stop_deadline: float | None = None
        self._exit_code = EXIT_OK
        self._signals: list[int] = []
        self._relay = Relay()

    def run(self) -> int:
        """Supervise until stopped; the exit code for the whole service."""
        with metrics_folder(self.settings.metrics_dir) as folder:
            self._folder = folder
            return self._run()

    def _run(self) -> int:
        os.environ[MULTIPROCESS_VARIABLE] = str(self._folder)  # inherited by every worker
        wakeup_read, wakeup_write = socket.socketpair()
        wakeup_read.setblocking(False)
        wakeup_write.setblocking(False)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        previous_wakeup = signal.set_wakeup_fd(wakeup_write.fileno())
        try:
            for slot in self._slots:
                self._start(slot)
            self._loop(wakeup_read)
        finally:
            signal.set_wakeup_fd(previous_wakeup)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            wakeup_read.close()
            wakeup_write.close()
            self.listeners.close()
            os.environ.pop(MULTIPROCESS_VARIABLE, None)
        return self._exit_code

    # ----- the loop ------------------------------------------------------------------------

    def _loop(self, wakeup: socket.socket) -> None:
        while self._stop_deadline is None or any(slot.process for slot in self._slots):
            waitables: list[Connection | socket.socket | int] = [wakeup]
            for slot in self._slots:
                if slot.conn is not None:
                    waitables.append(slot.conn)
                if slot.process is not None:
                    waitables.append(slot.process.sentinel)
            woken = wait(waitables, self._timeout())
            if wakeup in woken:
                while True:
                    try:
                        if not wakeup.recv(512):
                            break
                    except BlockingIOError:
                        break
            for sig in self._signals:
                if sig == signal.SIGHUP:
                    self._hang_up()
                else:
                    self._stop(sig)
            self._signals.clear()
            for slot in self._slots:
                if slot.conn is not None and slot.conn in woken:
                    self._receive(slot)
                if slot.process is not None and slot.process.sentinel in woken:
                    self._reap(slot)
            now = time.monotonic()
            self._kill_the_silent(now)
            for slot in self._slots:
                if slot.restart_at is not None and slot.restart_at <= now and self._stop_deadline is None:
                    slot.restart_at = None
                    self._start(slot)
            if self._stop_deadline is not None and now >= self._stop_deadline:
                self._kill_the_rest()
            self._relay.expire(now)

    def _timeout(self) -> float | None:
        due = [slot.restart_at for slot in self._slots if slot.restart_at is not None]
        if self._stop_deadline is None:
            due += [watch[0] for slot in self._slots if (watch := self._deadline(slot)) is not None]
        if (deadline := self._relay.next_deadline()) is not None:
            due.append(deadline)
        if self._stop_deadline is not None:
            due.append(self._stop_deadline)
        return max(0.0, min(due) - time.monotonic()) if due else None

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        self._signals.append(sig)  # handled in the loop: the wake-up fd ends its wait

    # ----- workers -------------------------------------------------------------------------

    def _start(self, slot: Slot) -> None:
        ours, theirs = self._context.Pipe(duplex=True)
        replacement = slot.failures > 0 or slot.ready
        process = self._context.Process(
            target=worker_main,
            name=f"ffn-worker-{slot.index}",
            args=(self._worker_settings, self.listeners, theirs, slot.index, replacement),
        )
        process.start()
        theirs.close()  # the worker's end lives in the worker: its reads see EOF when we are gone
        slot.process, slot.conn, slot.ready, slot.beat_at = process, ours, False, None
        slot.started_at, slot.killed = time.monotonic(), False
        log.info("worker %d started (pid %d)", slot.index, process.pid)
        self._record_processes()
        self._relay.started(slot)

    def _receive(self, slot: Slot) -> None:
        assert slot.conn is not None
        try:
            message = slot.conn.recv()
        except (EOFError, OSError):  # the worker exited; its sentinel tells the rest
            slot.conn.close()
            slot.conn = None
            return
        if message[0] == HEARTBEAT:
            if not slot.killed:
                slot.beat_at = time.monotonic()
        elif message[0] == READY:
            self._ready(slot)
        else:
            self._relay.received(slot, message)

    def _ready(self, slot: Slot) -> None:
        slot.ready, slot.ready_at = True, time.monotonic()
        slot.beat_at = slot.ready_at
        log.info("worker %d (pid %s) ready", slot.index, slot.pid)
        # A worker that finishes warming up after the stop began announces nothing: the listening
        # sockets are closed by then, and the service is not starting but stopping.
        if not self._serving and self._stop_deadline is None and all(s.ready for s in self._slots):
            self._serving = True
            log_start(self.settings, self.listeners)
            log.info("ready: %d workers, %d torch threads each", len(self._slots), self.threads)

    def _deadline(self, slot: Slot) -> tuple[float, str] | None:
        """When `slot`'s worker is to be killed if nothing changes, and what it will then have failed:
        "silent" (a ready worker's beats), "silent starting" (a starting one's), or "late" (not ready in time)."""
        if slot.process is None or slot.killed:
            return None
        if slot.ready:
            return None if slot.beat_at is None else (slot.beat_at + self.settings.heartbeat_timeout_s, "silent")
        late = (slot.started_at + self.settings.worker_start_timeout_s, "late")
        return late if slot.beat_at is None else min(late, (slot.beat_at + STARTING_SILENCE_S, "silent starting"))

    def _kill_the_silent(self, now: float) -> None:
        """SIGKILL every worker whose heartbeats stopped, or that is not ready within worker_start_timeout_s."""
        if self._stop_deadline is not None:
            return  # stopping: the drain has its own deadline, and a draining loop may stop beating
        for slot in self._slots:
            deadline = self._deadline(slot)
            if deadline is None or now < deadline[0] or slot.process is None:
                continue
            silent_for = now - (slot.beat_at or now)
            why = {
                "silent": f"sent no heartbeat for {silent_for:.1f} s (heartbeat_timeout_s): "
                "its event loop is stopped, hung or blocked",
                "silent starting": f"sent no heartbeat for {silent_for:.1f} s while starting: it is stopped",
                "late": f"was not ready {now - slot.started_at:.1f} s after its start "
                f"(worker_start_timeout_s {self.settings.worker_start_timeout_s:g}): it is hung loading or warming up",
            }[deadline[1]]
            log.error("worker %d (pid %s) %s; killing it", slot.index, slot.pid, why)
            slot.killed = True
            slot.process.kill()

    # ----- workers leaving ------------------------------------------------------------------

    def _reap(self, slot: Slot) -> None:
        process = slot.process
        assert process is not None and process.pid is not None
        process.join()
        code = process.exitcode
        if slot.conn is not None:
            slot.conn.close()
        slot.process, slot.conn, slot.beat_at = None, None, None
        self._relay.exited(slot)
        multiprocess.mark_process_dead(process.pid, str(self._folder))
        self._record_processes()
        how = _describe_exit(code)
        if self._stop_deadline is not None:
            stopped_cleanly = code == 0 or (not slot.ready and code == -signal.SIGTERM)
            if not stopped_cleanly:
                log.warning("worker %d (pid %d) %s while stopping", slot.index, process.pid, how)
                self._exit_code = EXIT_START_FAILED
            return
        if not self._serving:
            log.error("worker %d (pid %d) %s while starting: stopping the service", slot.index, process.pid, how)
            self._exit_code = code if code and code > 0 else EXIT_START_FAILED
            self._stop(None)
            return
        if slot.ready and time.monotonic() - slot.ready_at >= STABLE_AFTER_S:
            slot.failures = 0
        slot.failures += 1
        delay = min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (slot.failures - 1))
        slot.restart_at = time.monotonic() + delay
        log.error("worker %d (pid %d) %s; starting another in %.1f s", slot.index, process.pid, how, delay)

    def _hang_up(self) -> None:
        """SIGHUP: one worker applies the config file for all (its loads are broadcast to every worker)."""
        if self._stop_deadline is not None:
            return
        slot = next((s for s in self._slots if s.ready and s.process is not None and s.process.is_alive()), None)
        if slot is None or slot.pid is None:
            log.warning("received SIGHUP with no worker ready to apply the config file: ignored")
            return
        log.info("received SIGHUP: worker %d reads the config file again and applies it to every worker", slot.index)
        os.kill(slot.pid, signal.SIGHUP)

    def _stop(self, sig: int | None) -> None:
        """Pass a stop on to every worker; the first one starts the countdown to killing them."""
        if self._stop_deadline is None:
            if sig is not None:
                log.info("received %s: stopping %d workers", signal.Signals(sig).name, len(self._slots))
            self._stop_deadline = (
                time.monotonic() + self.settings.drain_timeout_s + CONNECTION_CLOSE_GRACE_S + STOP_MARGIN_S
            )
            self.listeners.close()  # the workers hold their own copies until they have drained
            for slot in self._slots:
                slot.restart_at = None
        for slot in self._slots:
            if slot.process is not None and slot.process.is_alive():
                slot.process.terminate()

    def _kill_the_rest(self) -> None:
        for slot in self._slots:
            if slot.process is not None and slot.process.is_alive():
                log.error("worker %d (pid %s) still running after the drain timeout: killing it", slot.index, slot.pid)
                slot.process.kill()
                self._exit_code = EXIT_START_FAILED
        self._stop_deadline = time.monotonic() + STOP_MARGIN_S

    def _record_processes(self) -> None:
        write_processes(
            self._folder, os.getpid(), [pid for pid in (slot.pid for slot in self._slots) if pid is not None]
        )


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


# ----- in the worker process -----------------------------------------------------------------


def worker_main(settings: Settings, listeners: Listeners, conn: Connection, index: int, replacement: bool) -> None:
    """A worker's whole life: load, warm up, say ready, serve until drained; exits with serve_here's code."""
    os.setpgid(0, 0)  # a terminal's Ctrl-C reaches the supervisor alone, which passes one SIGTERM on
    configure_logging(settings.log_level, settings.log_format, worker=index)
    control = Control(worker=index, conn=conn)
    control.serve_pipe()  # also: when the supervisor is gone, this worker drains and exits
    metrics = Metrics()
    if replacement:
        metrics.worker_restarts.inc()
    started = threading.Event()
    threading.Thread(target=_beat_until, args=(control, started), name="starting-heartbeat", daemon=True).start()

    def ready() -> None:
        started.set()  # from now on the event loop beats (app/engine/loop_watch.py)
        control.send_ready()

    # The supervisor's SIGTERM while this worker starts (it is stopping the service) stops the start: exit 0.
    with Starting() as starting:
        try:
            from app.server import serve_here  # torch and the web stack: in the workers only, never the supervisor
        except StartStopped as stopped:
            log.info("%s: stopped before serving", stopped)
            sys.exit(EXIT_OK)
        code = serve_here(settings, listeners, metrics, on_ready=ready, control=control, starting=starting)
    sys.exit(code)


def _beat_until(control: Control, started: threading.Event) -> None:
    """A starting worker's heartbeats, every STARTING_BEAT_S until it is ready."""
    while not started.wait(STARTING_BEAT_S):
        control.heartbeat()
