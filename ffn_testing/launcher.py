"""The one launcher of a real ffn-serve for tests and benchmarks: start_server and ServerProcess.

    with start_server(env={"FFN_MAX_QUEUE_ROWS": "64"}) as server:
        httpx.get(server.url + "/v2/health/ready")
        server.pid, server.logs(), server.rss_bytes()
    server.returncode  # after the block: the exit code of the SIGTERM stop (its log is kept unless 0)

It imports neither torch nor the server: the server runs as a subprocess,
`python -m app.cli --host 127.0.0.1 --port <free port>`, with its output in a log file (a pipe
nobody reads could fill up and stall it). FFN_* variables of the calling environment are
dropped, so that a developer's shell cannot change what a test or a benchmark sees.

While REFUSE_STARTS is set in the environment every start is refused, in this process and in the
processes it starts (a benchmark run by a test): the test suite sets it during each test not
marked `server`, so that `pytest -m "not server"` starts none.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ffn_client.client import Client
from ffn_client.tls import CertFiles
from ffn_testing.ports import HOST, free_ports
from ffn_testing.procfs import children, command_line, process_tree, read_pss, read_rss, tree_cpu_seconds

SERVE_COMMAND = (sys.executable, "-m", "app.cli")


# ----- waiting for a start ----------------------------------------------------------------------

CLOCK_FACTOR = 10  # the clock's bound on a start: ten times its CPU budget (a machine loaded ten times over)
STALL_S = 60.0  # by the clock: a start that used no CPU at all for this long is stuck, not slow


@dataclass
class StartPatience:
    """How long to wait for a start: `budget` seconds of the starting processes' CPU time, not of the clock.

    A start costs CPU seconds (a server: about 4 per process, for Python, torch, the app and the
    model), which a machine with a load average of 20 on 2 cores hands out ten times slower than
    an idle one: a deadline by the clock failed there with nothing wrong (issue 27: servers that
    had logged "listening on" were "not ready within 90 s"). So the wait goes on while the start
    uses CPU, and gives up once it has used `budget` seconds of it (a start that spins), has used
    none for `stall_s` seconds by the clock (stuck on something that will not come), or the clock
    has passed CLOCK_FACTOR times `budget`. `cpu_seconds` reads the starting processes' CPU time
    (None: not readable here, and the clock counts instead).
    """

    cpu_seconds: Callable[[], float | None]
    budget: float
    stall_s: float = STALL_S
    clock: Callable[[], float] = time.monotonic
    started: float = field(init=False)
    _first_cpu: float | None = field(init=False)  # what the meter read when the wait began
    _last_cpu: float | None = field(init=False, default=None)
    _last_progress: float = field(init=False)

    def __post_init__(self) -> None:
        self.started = self._last_progress = self.clock()
        self._first_cpu = self.cpu_seconds()

    def exhausted(self) -> str | None:
        """Why to stop waiting now, or None to wait on."""
        now = self.clock()
        elapsed = now - self.started
        reading = self.cpu_seconds()
        if reading is None:
            return f"not ready within {self.budget:g} s" if elapsed > self.budget else None
        cpu = reading - (self._first_cpu or 0.0)  # spent since the wait began (a test process has run before)
        if self._last_cpu is None or cpu > self._last_cpu:
            self._last_cpu, self._last_progress = cpu, now
        if cpu > self.budget:
            return (
                f"not ready after {cpu:.1f} s of CPU time (its budget: {self.budget:g} s), {elapsed:.0f} s by the clock"
            )
        if now - self._last_progress > self.stall_s:
            return f"stuck: no CPU time used in {self.stall_s:g} s ({cpu:.1f} s in all, {elapsed:.0f} s by the clock)"
        if elapsed > CLOCK_FACTOR * self.budget:
            return f"not ready within {elapsed:.0f} s by the clock ({cpu:.1f} s of CPU time)"
        return None


# ----- the launcher ------------------------------------------------------------------------------


class Process(Protocol):
    """A started server process as a launcher hands it back: subprocess.Popen is one."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


# How a start becomes a process: (argv, environment, folder or None, log file) -> the process.
Launcher = Callable[[Sequence[str], Mapping[str, str], "str | Path | None", Path], Process]


def exec_server(argv: Sequence[str], env: Mapping[str, str], cwd: str | Path | None, log_path: Path) -> Process:
    """The plain launcher: a new process running `argv`, its output appended to `log_path`."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(list(argv), cwd=cwd, env=dict(env), stdout=log, stderr=subprocess.STDOUT)


_launcher: Launcher = exec_server


# Set (to the reason), every start is refused with that reason; see the module's docstring.
REFUSE_STARTS = "SERVER_STARTS_REFUSED"


class StartRefused(RuntimeError):
    """A start while REFUSE_STARTS is set: the message is its reason (a test not marked `server`)."""


def use_launcher(launcher: Launcher) -> Launcher:
    """Start every later server with `launcher` (the test suite's fork server); returns the one it replaces."""
    global _launcher
    previous, _launcher = _launcher, launcher
    return previous


class ServerFailed(RuntimeError):
    """The server exited or never became ready, or would not stop; the message holds its log."""


@dataclass
class ServerProcess:
    """A started server: where it listens, its log, and how to stop it.

    As a context manager: stopped (SIGTERM, then wait) when the block ends, unless the block
    stopped it; the log file is removed when it exited 0 and kept for whoever debugs it otherwise.
    """

    proc: Process
    port: int
    log_path: Path
    returncode: int | None = field(default=None)  # set once it has exited and been waited for
    grpc_port: int | None = field(default=None)  # None: started with gRPC turned off
    scheme: str = field(default="http")  # https: started with TLS (start_server's `verify`)

    @property
    def url(self) -> str:
        return f"{self.scheme}://{HOST}:{self.port}"

    @property
    def grpc_target(self) -> str:
        """host:port of the gRPC service, as gRPC clients take it."""
        assert self.grpc_port is not None, "this server was started with gRPC turned off"
        return f"{HOST}:{self.grpc_port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def logs(self) -> str:
        """Everything the server printed so far."""
        return self.log_path.read_text(errors="replace")

    def rss_bytes(self) -> int:
        """The process's resident memory now. With a command prefix, the prefix's process: use one that execs."""
        return read_rss(self.proc.pid)

    def tree_rss_bytes(self) -> int:
        """The memory the process and its descendants hold now (the fronts and engines of a layout): each
        process's proportional set size, so that a page the hand-off shares between a front and an engine
        counts once, as the host spends it once (read_pss)."""
        total = 0
        for pid in process_tree(self.proc.pid):
            try:
                total += read_pss(pid)
            except (OSError, RuntimeError):  # exited meanwhile, or a zombie: it holds nothing
                continue
        return total

    def worker_pids(self) -> set[int]:
        """A supervisor's worker (and engine) processes, not its fork server or resource tracker.

        The fronts are spawned (`spawn_main` in their command line); the processes that compute are
        forked by the supervisor's fork server, whose children they are (app/process/supervisor.py).
        """
        found: set[int] = set()
        for child in children(self.pid):
            command = command_line(child)
            if b"spawn_main" in command:
                found.add(child)
            elif b"multiprocessing.forkserver" in command:
                found.update(children(child))
        return found

    def terminate(self) -> None:
        """Send SIGTERM (a drain) without waiting."""
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 30.0) -> int:
        """Wait for the process to exit; kill it and raise ServerFailed if it does not in `timeout` seconds."""
        try:
            self.returncode = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.returncode = self.proc.wait(10)
            raise ServerFailed(f"server did not exit within {timeout:g} s; log:\n{self.logs()}") from None
        return self.returncode

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM unless it has exited already, then wait for the exit code (killed after `timeout` s)."""
        if self.proc.poll() is None:
            self.terminate()
        return self.wait(timeout)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.returncode is None:
            self.stop()
        if self.returncode == 0:
            self.log_path.unlink(missing_ok=True)


def start_server(
    env: Mapping[str, str] | None = None,
    config: str | Path | None = None,
    args: Sequence[str] = (),
    *,
    prefix: Sequence[str] = (),
    command: Sequence[str] = SERVE_COMMAND,
    cwd: str | Path | None = None,
    ready_timeout: float = 90.0,
    verify: str | Path | None = None,
    cert: CertFiles | None = None,
) -> ServerProcess:
    """Start `*prefix *command --host 127.0.0.1 --port <free> [--config F] *args` and return once ready.

    Use it in a `with` block (see ServerProcess), or stop() it yourself.

    env: added to the calling environment less its FFN_* variables (FFN_LOG_LEVEL is info
    unless given; FFN_GRPC_PORT a free port unless given). prefix: a wrapper such as `taskset -c 0`. command: another way to run the
    server, such as the installed `ffn-serve` script. Ready is GET /v2/health/ready answering
    200; a server that exits first, or is not ready within `ready_timeout` seconds of its CPU time
    (its worker processes' included; see StartPatience), raises ServerFailed. verify: a server
    started with TLS (its FFN_TLS_* in `env`): the CA its readiness is asked over HTTPS with, and
    `cert` the client certificate where it requires one; `url` is then https.
    """
    refusal = os.environ.get(REFUSE_STARTS)
    if refusal:
        raise StartRefused(refusal)
    # A free gRPC port too: two servers on the default 8001 would refuse to start.
    port, free_grpc_port = free_ports(2)
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("FFN_")}
    child_env.update({"PYTHONUNBUFFERED": "1", "FFN_LOG_LEVEL": "info", "FFN_GRPC_PORT": str(free_grpc_port)})
    child_env.update(env or {})
    grpc_on = child_env.get("FFN_GRPC", "true").lower() not in ("0", "false", "no", "off")
    grpc_port = int(child_env["FFN_GRPC_PORT"]) if grpc_on else None
    argv = [*prefix, *command, "--host", HOST, "--port", str(port)]
    if config is not None:
        argv += ["--config", str(config)]
    argv += args
    log_fd, log_name = tempfile.mkstemp(prefix=f"ffn-serve-{port}-", suffix=".log")
    os.close(log_fd)
    proc = _launcher(argv, child_env, cwd, Path(log_name))
    server = ServerProcess(
        proc, port, Path(log_name), grpc_port=grpc_port, scheme="http" if verify is None else "https"
    )
    try:
        _wait_ready(server, ready_timeout, verify, cert)
    except BaseException:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        raise
    return server


def _wait_ready(server: ServerProcess, timeout: float, verify: str | Path | None, cert: CertFiles | None) -> None:
    patience = StartPatience(lambda: tree_cpu_seconds(server.pid), timeout)
    # A probe that times out is asked again, not counted against the start: on a loaded machine a
    # server still importing holds connections in its listening socket's backlog unanswered.
    with Client(
        server.url, timeout=PROBE_TIMEOUT_S, max_retries=0, verify=True if verify is None else verify, cert=cert
    ) as client:
        while True:
            if server.proc.poll() is not None:
                raise ServerFailed(f"server exited with {server.proc.returncode} while starting; log:\n{server.logs()}")
            if client.ready():
                return
            reason = patience.exhausted()
            if reason is not None:
                raise ServerFailed(f"server {reason}; log:\n{server.logs()}")
            time.sleep(0.05)


PROBE_TIMEOUT_S = 5.0
