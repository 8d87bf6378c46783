"""Supervisor: N worker processes on the parent's listening sockets, each with its own models.

The parent binds the port, then starts the workers and hands them the bound sockets. A worker is
forked from a fork server (multiprocessing's "forkserver"): a fresh interpreter, started by the
parent, that imported torch and the serving code once and runs nothing, so a worker inherits no
CUDA or thread state and starts in a fraction of the CPU a fresh interpreter takes. With
shared_engine the engines are forked so, and the fronts, which never import torch, are spawned.
Each worker loads its models, warms up, and only then accepts connections, telling the parent
"ready" over a pipe: a connection is only ever accepted by a warm worker.

- A worker that dies is started again after a backoff (0.5 s, doubling to 30 s; back to 0.5 s
  once a worker has stayed up 30 s), with a log line.
- A fork server that dies (killed) leaves its workers running, but they read as exited (code 255):
  each still running is asked to drain (SIGTERM; its pipe closed too, which alone would drain it),
  with a log line that says so, and is replaced from a new fork server.
- Liveness (app/process/liveness.py): a ready worker silent for `heartbeat_timeout_s` is asked to drain
  (SIGTERM), and killed (SIGKILL) if it stays silent as long again; a starting worker silent for
  STARTING_SILENCE_S, or not ready within `worker_start_timeout_s`, is killed; each with a log line
  saying why, and started again like any dead worker. Silence is counted only over time this loop
  ran: it turns at least every TURN_S, a later turn is time it did not run (stopped, starved, its
  machine paused) and moves every deadline on, and it reads every pipe dry before judging.
- A worker that exits before the service was first ready stops the start: the others are
  stopped and the parent exits with that worker's code (no restart loop on a bad model).
- SIGTERM or SIGINT is passed to every worker, which drains what it accepted; the parent exits
  0 once all have exited 0, its metrics folder removed. A second signal is passed on too (the
  workers then exit at once).
- SIGHUP goes to one ready worker, which reads the config file again and loads, reloads or
  unloads what changed in every worker (app/control.py carries it); the workers started later
  replay those loads. With TLS, every front is also told to read the certificate and key again.
- If the parent dies, each worker sees its pipe close and drains and exits by itself.
- Metrics: the workers write theirs in one folder (prometheus_client's multiprocess mode): a fresh
  one removed at exit, or `metrics_dir` (app/observe/metrics_folder.py); a dead worker's gauges are
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
import tempfile
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType

from prometheus_client import multiprocess

from app.config.settings import Settings
from app.config.tls import TLS_RELOAD
from app.control import ALIVE, HEARTBEAT, READY, Control
from app.observe.collectors import write_processes
from app.observe.logs import configure_logging
from app.observe.metrics import MULTIPROCESS_VARIABLE, Metrics
from app.observe.metrics_folder import metrics_folder
from app.process.exits import EXIT_OK, EXIT_START_FAILED
from app.process.listeners import Listeners, log_start
from app.process.liveness import STOP_MARGIN_S, TURN_S, Slot, drain_allowance_s, reason, verdict
from app.process.relay import Relay
from app.process.starting import Starting, StartStopped

log = logging.getLogger("ffn_serve.supervisor")

FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.5, 30.0
STABLE_AFTER_S = 30.0  # a worker that served this long resets its slot's backoff
STARTING_BEAT_S = 0.5  # a starting worker's heartbeats, from a thread while it loads
LOST_LOGGED_S = 1.0  # a stretch this long in which the supervisor did not run is logged
ENGINE = 0  # the (first) engine process's slot index (shared_engine); the workers' are 1 to N, more engines' N+1...
# The broadcast commands an engine process applies: the log settings (app/protocol/v2/log_settings.py's
# COMMAND), and the model loads and unloads (app/engine/lifecycle.py's LOAD_MODEL, UNLOAD_MODEL), which
# an engine broadcasts to every engine, and which are kept and replayed to one that restarts. The
# fronts apply the rest (the trace settings, the shared-memory regions: the engines read no request).
MODEL_COMMANDS = frozenset({"load_model", "unload_model"})
ENGINE_COMMANDS = frozenset({"log_settings"}) | MODEL_COMMANDS
# What the fork server imports before it forks a process that computes (multiprocessing's "forkserver":
# a fresh interpreter this process starts, which imports these modules once and forks each worker from
# itself). A worker then starts in about 0.7 s of CPU instead of 4 and more (most of that importing
# torch; bench/worker_start.py), and one that died is back as fast. The fork server imports, and runs nothing else: no CUDA context,
# no torch threads, no sockets, which is all a spawned worker was spared by its fresh interpreter.
# WORKER_PRELOAD is all of ours, and torch, that a worker imports before it is ready (a test holds it to that).
WORKER_PRELOAD = (
    "app.process.supervisor",
    "app.process.server",
    "app.engine.service",
    "app.engine.registry",
    "app.process.preflight",
    "app.http.transport.uvicorn_members",
)
ENGINE_PRELOAD = ("app.process.supervisor", "app.process.engine_process")
FORK_SERVER_LOST = 255  # the exit code multiprocessing gives each child of a fork server that died


def engine_count(settings: Settings) -> int:
    """shared_engine: how many engine processes, one per entry of `devices` (or one)."""
    return max(1, len(settings.devices))


def engines_named(settings: Settings) -> str:
    """shared_engine's engine processes, for a log line: "one engine process", "2 engine processes (cpu, cpu)"."""
    if len(settings.devices) < 2:
        return "one engine process" + (f" ({settings.devices[0]})" if settings.devices else "")
    return f"{len(settings.devices)} engine processes ({', '.join(settings.devices)})"


def engine_settings(settings: Settings) -> Settings:
    """The engine processes' settings: the torch threads of each one's share of this process's cores
    (the engines compute for every front; the fronts compute nothing)."""
    cores = len(os.sched_getaffinity(0))
    return settings.model_copy(
        update={"torch_threads": settings.intra_op_threads() or max(1, cores // engine_count(settings))}
    )


def threads_per_worker(settings: Settings) -> int:
    """torch threads for each worker: the setting (one in batch-invariant mode), or this process's cores shared out."""
    return settings.intra_op_threads() or max(1, len(os.sched_getaffinity(0)) // settings.workers)


class Supervisor:
    """Start, watch and stop `settings.workers` worker processes on `listeners`."""

    def __init__(self, settings: Settings, listeners: Listeners) -> None:
        self.settings = settings
        self.listeners = listeners
        self.threads = threads_per_worker(settings)
        self._worker_settings = settings.model_copy(update={"torch_threads": self.threads})
        # The processes that compute (the workers; with shared_engine the engines) are forked from a fork
        # server that imported torch and the serving code once; the fronts, which import no torch, are spawned.
        self._spawning = multiprocessing.get_context("spawn")
        self._forking = multiprocessing.get_context("forkserver")
        self._forking.set_forkserver_preload(list(ENGINE_PRELOAD if settings.shared_engine else WORKER_PRELOAD))
        self._slots = [Slot(i + 1) for i in range(settings.workers)]
        # Workers that lost their fork server and were asked to drain, by pid, with their start time:
        # where this process is PID 1 (a container) or a subreaper, they become its children, and it
        # waits for them (_reap_orphans).
        self._orphans: dict[int, int | None] = {}
        # shared_engine: the engine processes (one, or one per entry of `devices`) are started first and
        # stopped last; the workers are fronts. Slot 0 is the first engine, N+1... the others.
        self._engines: list[Slot] = []
        self._engine_sockets: list[Path] = []
        self._engines_stopped = False  # asked to drain, the fronts gone
        if settings.shared_engine:
            self._engines = [Slot(ENGINE if k == 0 else settings.workers + k) for k in range(engine_count(settings))]
            self._slots[:0] = self._engines
            self._engine_settings = engine_settings(settings)
        self._folder = Path()
        self._serving = False  # every worker has been ready once
        self._stop_deadline: float | None = None
        self._exit_code = EXIT_OK
        self._signals: list[int] = []
        self._relay = Relay()
        self._turned_at = time.monotonic()  # when the loop last woke
        self._starting_s = 0.0  # of the time since, how long a start held the loop (a fork server importing)

    def run(self) -> int:
        """Supervise until stopped; the exit code for the whole service."""
        with metrics_folder(self.settings.metrics_dir) as folder, tempfile.TemporaryDirectory(prefix="ffn-") as run:
            self._folder = folder
            # The engines' sockets, in a folder only this user can open (mkdtemp makes it 0700).
            self._engine_sockets = [Path(run) / f"engine-{k}.sock" for k in range(len(self._engines))]
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
        self._turned_at = time.monotonic()
        while self._stop_deadline is None or any(slot.process for slot in self._slots):
            waitables: list[Connection | socket.socket | int] = [wakeup]
            for slot in self._slots:
                if slot.conn is not None:
                    waitables.append(slot.conn)
                if slot.process is not None:
                    waitables.append(slot.process.sentinel)
            woken = wait(waitables, self._timeout())
            self._woke(time.monotonic())
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
            self._judge(now)
            for slot in self._slots:
                if slot.restart_at is not None and slot.restart_at <= now and self._stop_deadline is None:
                    slot.restart_at = None
                    self._start(slot)
            if self._stop_deadline is not None and now >= self._stop_deadline:
                self._kill_the_rest()
            self._relay.expire(now)
            self._reap_orphans()

    def _timeout(self) -> float:
        """How long the loop may wait: until the next thing due, and never longer than TURN_S (see _woke)."""
        due = [slot.restart_at for slot in self._slots if slot.restart_at is not None]
        if self._stop_deadline is None:
            due += [judged.at for slot in self._slots if (judged := verdict(slot, self.settings)) is not None]
        if (deadline := self._relay.next_deadline()) is not None:
            due.append(deadline)
        if self._stop_deadline is not None:
            due.append(self._stop_deadline)
        return max(0.0, min([*due, time.monotonic() + TURN_S]) - time.monotonic())

    def _woke(self, now: float) -> None:
        """The loop woke at `now`: time past TURN_S since it last woke is time this process did not run
        (stopped, starved of CPU, its machine paused), and no worker's silence: every deadline moves on by it."""
        lost = now - self._turned_at - TURN_S
        busy, self._turned_at, self._starting_s = self._starting_s, now, 0.0
        if lost <= 0:
            return
        for slot in self._slots:
            slot.resumed(lost)
        if self._stop_deadline is not None:
            self._stop_deadline += lost
        # A start that waited for a fork server to import torch (its first start, or one after it died)
        # held the loop too: counted like any lost time, but nothing to warn of.
        if lost - busy >= LOST_LOGGED_S:
            log.warning(
                "the supervisor did not run for %.1f s (stopped, starved of CPU, or its machine paused): "
                "its workers' silence is not counted for that time",
                lost,
            )

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        self._signals.append(sig)  # handled in the loop: the wake-up fd ends its wait

    # ----- workers -------------------------------------------------------------------------

    def _start(self, slot: Slot) -> None:
        ours, theirs = multiprocessing.Pipe(duplex=True)
        replacement = slot.failures > 0 or slot.ready
        process: BaseProcess
        if slot in self._engines:
            k = self._engines.index(slot)
            process = self._forking.Process(
                target=engine_entry,
                name=f"ffn-engine-{k}",
                args=(self._engine_settings, theirs, self._engine_sockets[k], replacement, slot.index, self._device(k)),
            )
        else:
            context = self._spawning if self._engines else self._forking
            process = context.Process(
                target=worker_main,
                name=f"ffn-worker-{slot.index}",
                args=(self._worker_settings, self.listeners, theirs, slot.index, replacement, self._engine_sockets),
            )
        began = time.monotonic()
        process.start()
        self._starting_s += time.monotonic() - began
        theirs.close()  # the worker's end lives in the worker: its reads see EOF when we are gone
        slot.process, slot.conn, slot.ready, slot.beat_at = process, ours, False, None
        slot.started_at, slot.killed, slot.drain_asked_at = time.monotonic(), False, None
        log.info("%s started (pid %d)", self._named(slot), process.pid)
        self._record_processes()
        if slot in self._engines:
            self._relay.started(slot, accepts=ENGINE_COMMANDS)
        else:
            self._relay.started(slot, refuses=MODEL_COMMANDS if self._engines else frozenset())

    def _receive(self, slot: Slot) -> None:
        """Read all that the worker's pipe holds (beats queued while this loop did not run count before
        it judges), and answer its heartbeats: the worker knows this loop runs (app/control.py)."""
        beat = False
        while slot.conn is not None and slot.conn.poll():
            try:
                message = slot.conn.recv()
            except (EOFError, OSError):  # the worker exited; its sentinel tells the rest
                slot.conn.close()
                slot.conn = None
                return
            if message[0] == HEARTBEAT:
                beat = True
                if not slot.killed:
                    slot.beat_at = time.monotonic()
            elif message[0] == READY:
                self._ready(slot)
            else:
                self._relay.received(slot, message)
        if beat and slot.conn is not None:
            try:
                slot.conn.send((ALIVE,))
            except OSError:  # the worker is exiting; its sentinel tells the rest
                pass

    def _ready(self, slot: Slot) -> None:
        slot.ready, slot.ready_at = True, time.monotonic()
        slot.beat_at = slot.ready_at
        log.info("%s (pid %s) ready", self._named(slot), slot.pid)
        # A worker that finishes warming up after the stop began announces nothing: the listening
        # sockets are closed by then, and the service is not starting but stopping.
        if not self._serving and self._stop_deadline is None and all(s.ready for s in self._slots):
            self._serving = True
            log_start(self.settings, self.listeners)
            if self._engines:
                log.info("ready: %d fronts and %s", self.settings.workers, engines_named(self.settings))
            else:
                log.info("ready: %d workers, %d torch threads each", len(self._slots), self.threads)

    def _judge(self, now: float) -> None:
        """Ask to drain, or kill, every worker whose verdict is due (app/process/liveness.py), with a log line saying why."""
        if self._stop_deadline is not None:
            return  # stopping: the drain has its own deadline, and a draining loop may stop beating
        for slot in self._slots:
            judged = verdict(slot, self.settings)
            if judged is None or now < judged.at or slot.process is None:
                continue
            log.error("%s (pid %s) %s", self._named(slot), slot.pid, reason(slot, judged.what, now, self.settings))
            if judged.kill:
                slot.killed = True
                slot.process.kill()
            else:
                slot.drain_asked_at = now
                slot.process.terminate()

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
        if code == FORK_SERVER_LOST and _running(process.pid):
            # Its fork server is gone (killed), which reports every child it forked as exited with 255;
            # the worker itself runs on. Its pipe is closed above, which drains it; told once more here.
            how = "lost its fork server (killed?) and is asked to drain"
            os.kill(process.pid, signal.SIGTERM)
            self._orphans[process.pid] = _start_time(process.pid)
        if self._stop_deadline is not None:
            stopped_cleanly = code == 0 or (not slot.ready and code == -signal.SIGTERM)
            if stopped_cleanly and self._engines:
                log.info("%s (pid %d) stopped", self._named(slot), process.pid)
            if not stopped_cleanly:
                log.warning("%s (pid %d) %s while stopping", self._named(slot), process.pid, how)
                self._exit_code = EXIT_START_FAILED
            self._stop_engine_after_fronts()
            if self._engines and not any(other.process for other in self._slots):
                log.info("stopped: every front and engine process has exited")
            return
        if not self._serving:
            log.error("%s (pid %d) %s while starting: stopping the service", self._named(slot), process.pid, how)
            self._exit_code = code if code and code > 0 else EXIT_START_FAILED
            self._stop(None)
            return
        if slot.ready and time.monotonic() - slot.ready_at >= STABLE_AFTER_S:
            slot.failures = 0
        slot.failures += 1
        delay = min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (slot.failures - 1))
        slot.restart_at = time.monotonic() + delay
        log.error("%s (pid %d) %s; starting another in %.1f s", self._named(slot), process.pid, how, delay)

    def _reap_orphans(self) -> None:
        """Wait for the drained orphans that are this process's children (it is PID 1 or a subreaper):
        unwaited, each would stay a zombie until the service exits. One that is not its child is
        watched until it is gone: the fork server's end can reach this process before the kernel
        has given its children a new parent, and then they may yet be this process's."""
        for pid, started in list(self._orphans.items()):
            try:
                exited, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # not its child (yet), or not there; the start time tells a new process
                exited = 0 if started is not None and _start_time(pid) == started else pid
            if exited:
                del self._orphans[pid]

    def _hang_up(self) -> None:
        """SIGHUP: one worker applies the config file for all (its loads are broadcast to every worker)."""
        if self._stop_deadline is not None:
            return
        if self.settings.tls_cert_file is not None:
            # Every front serves TLS from the same files, so every one reads them again (app/process/server.py's TLS_RELOAD).
            reached = self._relay.tell(TLS_RELOAD, {"why": "SIGHUP"})
            log.info("received SIGHUP: %d front(s) read the TLS certificate and key again", reached)
        # One process applies the config file for all: its loads are broadcast to every worker, or, with
        # a shared engine, to every engine process.
        candidates = self._engines or self._slots
        slot = next((s for s in candidates if s.ready and s.process is not None and s.process.is_alive()), None)
        if slot is None or slot.pid is None:
            log.warning(
                "received SIGHUP with no %s ready to apply the config file: ignored",
                "engine process" if self._engines else "worker",
            )
            return
        log.info("received SIGHUP: %s reads the config file again and applies it to every one", self._named(slot))
        os.kill(slot.pid, signal.SIGHUP)

    def _stop(self, sig: int | None) -> None:
        """Pass a stop on to every worker; the first one starts the countdown to killing them."""
        if self._stop_deadline is None:
            if sig is not None and self._engines:  # each phase of the layout's stop has its line
                fronts = len(self._slots) - len(self._engines)
                log.info(
                    "received %s: stopping %d fronts, then %s",
                    signal.Signals(sig).name,
                    fronts,
                    engines_named(self.settings),
                )
            elif sig is not None:
                log.info("received %s: stopping %d workers", signal.Signals(sig).name, len(self._slots))
            self._stop_deadline = time.monotonic() + drain_allowance_s(self.settings)
            self.listeners.close()  # the workers hold their own copies until they have drained
            for slot in self._slots:
                slot.restart_at = None
        for slot in self._slots:
            if slot not in self._engines and slot.process is not None and slot.process.is_alive():
                slot.process.terminate()
        self._stop_engine_after_fronts()

    def _stop_engine_after_fronts(self) -> None:
        """The engines drain last: once every front has finished what it accepted (and handed to them)."""
        if not self._engines or self._engines_stopped:
            return
        if any(slot.process is not None for slot in self._slots if slot not in self._engines):
            return
        self._engines_stopped = True
        log.info("every front has stopped: stopping %s", engines_named(self.settings))
        for engine in self._engines:
            if engine.process is not None and engine.process.is_alive():
                engine.process.terminate()

    def _kill_the_rest(self) -> None:
        for slot in self._slots:
            if slot.process is not None and slot.process.is_alive():
                log.error("%s (pid %s) still running after the drain timeout: killing it", self._named(slot), slot.pid)
                slot.process.kill()
                self._exit_code = EXIT_START_FAILED
        self._stop_deadline = time.monotonic() + STOP_MARGIN_S

    def _device(self, k: int) -> str | None:
        """Where engine `k` computes every model (`devices`); None: each model where its table says."""
        return self.settings.devices[k] if self.settings.devices else None

    def _named(self, slot: Slot) -> str:
        """How the log names the process in `slot`: "worker 2", "engine process", or "engine process 1 (cuda:1)"."""
        if slot not in self._engines:
            return f"worker {slot.index}"
        if len(self._engines) == 1:
            return "engine process"
        k = self._engines.index(slot)
        return f"engine process {k} ({self.settings.devices[k]})"

    def _record_processes(self) -> None:
        write_processes(
            self._folder, os.getpid(), [pid for pid in (slot.pid for slot in self._slots) if pid is not None]
        )


def _running(pid: int) -> bool:
    """Whether a process `pid` exists (one this process forked no longer is its child once its fork server is gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, /proc/<pid>/stat), or None if it is not there
    or there is no /proc: told apart from a later process given the same pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return int(stat.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


# ----- in the worker process -----------------------------------------------------------------


def engine_entry(
    settings: Settings, conn: Connection, path: Path, replacement: bool, index: int, device: str | None
) -> None:
    """An engine process's life (shared_engine): app/process/engine_process.py, imported here, in it alone.
    `index`: its slot's, the number its log lines carry; `device`: where it computes every model (None:
    where each model's table says)."""
    from app.process.engine_process import engine_main  # torch: in the engine, never the supervisor

    engine_main(settings, conn, path, replacement, index, device)


def worker_main(
    settings: Settings,
    listeners: Listeners,
    conn: Connection,
    index: int,
    replacement: bool,
    engine_sockets: Sequence[Path] = (),
) -> None:
    """A worker's whole life: load, warm up, say ready, serve until drained; exits with serve_here's code.

    With shared_engine it is a front of the engine processes listening at `engine_sockets`: no models, no torch."""
    os.setpgid(0, 0)  # a terminal's Ctrl-C reaches the supervisor alone, which passes one SIGTERM on
    configure_logging(settings.log_level, settings.log_format, worker=index)
    control = Control(worker=index, conn=conn)
    control.serve_pipe()  # also: when the supervisor is gone, this worker drains and exits
    metrics = Metrics()
    if replacement:
        metrics.worker_restarts.inc()
    started = threading.Event()
    threading.Thread(target=beat_until, args=(control, started), name="starting-heartbeat", daemon=True).start()

    def ready() -> None:
        started.set()  # from now on the event loop beats (app/engine/loop_watch.py)
        control.send_ready()

    # The supervisor's SIGTERM while this worker starts (it is stopping the service) stops the start: exit 0.
    with Starting() as starting:
        try:
            from app.process.server import (
                serve_here,  # torch and the web stack: in the workers only, never the supervisor
            )
        except StartStopped as stopped:
            log.info("%s: stopped before serving", stopped)
            sys.exit(EXIT_OK)
        code = serve_here(
            settings,
            listeners,
            metrics,
            on_ready=ready,
            control=control,
            starting=starting,
            engine_sockets=engine_sockets if settings.shared_engine else (),
        )
    sys.exit(code)


def beat_until(control: Control, started: threading.Event) -> None:
    """A starting worker's (or engine's) heartbeats, every STARTING_BEAT_S until it is ready."""
    while not started.wait(STARTING_BEAT_S):
        control.heartbeat()
