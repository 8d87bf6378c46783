"""The suite's fork server: test servers forked from a process that imported the server once.

A fresh `python -m app.cli` spends about 3.5 s of CPU before it listens, most of it importing
torch, FastAPI and grpc, and a run of the suite starts some 120 of them: on a 2-core machine
that was a third of the run. The fork server (one per pytest process, started at its first
server) imports app.cli and app.process.server once; every start then forks it, and the child runs
app.cli's main with the start's arguments, environment, folder and log file. The server is the
same code in a real process, on real sockets, taking real signals, for about 0.5 s of CPU.

What a fork cannot give a start is started the plain way (ffn_testing.exec_server): a
command other than `python -m app.cli` or a prefix (the installed script, taskset, ...), worker
processes (a supervisor imports no torch, and that is tested; it starts its workers from a fork server
of its own), or an
environment that differs from the fork server's in anything but FFN_* variables and the few read
only when used (READ_WHEN_USED), since some libraries read their variables only when they load (glibc's MALLOC_*, OpenMP's OMP_*,
huggingface_hub's HF_*). FFN_TEST_FORKSERVER=0 turns it off: every start a fresh interpreter,
as a user's is.

A forked server's environment is os.environ (and C's getenv) as the start gave it; only
/proc/<pid>/environ, the block the process began with, still shows the fork server's.

The fork server is the servers' parent, so it is the one that can wait for them: a test's
process handle asks it for the exit status (`poll`), over the pipe that carries the starts.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ffn_testing import SERVE_COMMAND, Process, exec_server

REPO = Path(__file__).resolve().parents[1]
SWITCH = "FFN_TEST_FORKSERVER"


def enabled() -> bool:
    return os.environ.get(SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


# Variables that may differ between a start and the fork server, beside FFN_*: each is read when it
# is used, never when a library loads, so the fork's environment (the start's, whole) is all that
# counts. PYTEST_CURRENT_TEST: pytest's name of the running test. TORCHINDUCTOR_CACHE_DIR: torch
# sets it in the test process at its first torch.compile (torch/_inductor/runtime/cache_dir_utils.py),
# and with it every later start of that process would differ and be started the plain way (15 of
# a run's starts, 40 s of CPU). TMPDIR: read by tempfile, whose cached answer the child forgets.
# OTEL_BSP_SCHEDULE_DELAY, OTEL_SERVICE_NAME: read by the OpenTelemetry SDK when a server builds its
# span processor and resource (the fork server imports only opentelemetry.context). HF_HOME,
# HF_HUB_OFFLINE: huggingface_hub reads them when it loads, and only a server of a hub model loads it.
READ_WHEN_USED = frozenset(
    {
        "PYTEST_CURRENT_TEST",
        "TORCHINDUCTOR_CACHE_DIR",
        "TMPDIR",
        "OTEL_BSP_SCHEDULE_DELAY",
        "OTEL_SERVICE_NAME",
        "HF_HOME",
        "HF_HUB_OFFLINE",
    }
)


def _without_ffn(env: Mapping[str, str]) -> dict[str, str]:
    """The environment but its FFN_* variables and those of READ_WHEN_USED, which the server reads
    only once started (a fork takes the start's whole environment all the same)."""
    return {k: v for k, v in env.items() if not k.startswith("FFN_") and k not in READ_WHEN_USED}


def _fork_server_environment() -> dict[str, str]:
    """What the fork server starts with: this process's environment as start_server passes it on
    (PYTHONUNBUFFERED set), less FFN_*: each start brings its own."""
    return _without_ffn({**os.environ, "PYTHONUNBUFFERED": "1"})


# ----- the test process's side -----------------------------------------------------------------------


@dataclass
class Forked:
    """A server forked by the fork server: Popen's methods, the exit status asked of its parent."""

    forks: ForkServer
    pid: int
    returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.forks.returncode(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        give_up = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if give_up is not None and time.monotonic() > give_up:
                raise subprocess.TimeoutExpired([*SERVE_COMMAND], timeout or 0.0)
            time.sleep(0.02)
        return code

    def send_signal(self, sig: int) -> None:
        # Not yet waited for, the pid cannot have been reused: an exited server stays a zombie
        # of the fork server until a poll reaps it.
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


@dataclass
class ForkServer:
    """The launcher: a fork where the start allows one, else exec_server."""

    _proc: subprocess.Popen[bytes] | None = None
    _env: dict[str, str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def launch(self, argv: Sequence[str], env: Mapping[str, str], cwd: str | Path | None, log_path: Path) -> Process:
        if (
            tuple(argv[: len(SERVE_COMMAND)]) != SERVE_COMMAND
            or not self._same_environment(env)
            or _supervisor(argv, env)
        ):
            return exec_server(argv, env, cwd, log_path)
        start = {
            "op": "fork",
            "args": list(argv[len(SERVE_COMMAND) :]),
            "env": dict(env),
            "cwd": str(Path(cwd).resolve()) if cwd is not None else os.getcwd(),
            "log": str(log_path),
        }
        return Forked(self, int(self._ask(start)["pid"]))

    def returncode(self, pid: int) -> int | None:
        code = self._ask({"op": "poll", "pid": pid})["returncode"]
        return None if code is None else int(code)

    def close(self) -> None:
        """End the fork server (it exits when its requests end); servers still running go on."""
        with self._lock:
            if self._proc is not None and self._proc.stdin is not None:
                self._proc.stdin.close()
                self._proc.wait(30)
                self._proc = None

    def _same_environment(self, env: Mapping[str, str]) -> bool:
        # Compared with what the fork server was (or would be) started with.
        return _without_ffn(env) == (self._env or _fork_server_environment())

    def _ask(self, message: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            proc = self._started()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(json.dumps(message).encode() + b"\n")
                proc.stdin.flush()
                line = proc.stdout.readline()
            except BrokenPipeError:
                line = b""
            if not line:
                raise RuntimeError(f"the test fork server exited ({proc.poll()}); see the test output for its error")
            answer: dict[str, Any] = json.loads(line)
            return answer

    def _started(self) -> subprocess.Popen[bytes]:
        if self._proc is None:
            self._env = _fork_server_environment()
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "tests.forkserver"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                cwd=REPO,
                env=self._env,
            )
        return self._proc


def _supervisor(argv: Sequence[str], env: Mapping[str, str]) -> bool:
    """Whether the start asks for worker processes: its supervisor imports no torch, where a fork would have it."""
    return env.get("FFN_WORKERS", "1").strip() != "1" or "--workers" in argv


# ----- the fork server's side ------------------------------------------------------------------------


@dataclass
class Start:
    args: list[str]
    env: dict[str, str]
    cwd: str
    log: str


def serve(requests: IO[bytes], answers: IO[bytes]) -> Start | None:
    """Answer starts and polls until the requests end (None); in a forked child, return its start."""
    exited: dict[int, int] = {}
    for line in requests:
        ask = json.loads(line)
        if ask["op"] == "fork":
            pid = os.fork()
            if pid == 0:
                return Start(ask["args"], ask["env"], ask["cwd"], ask["log"])
            answer: dict[str, Any] = {"pid": pid}
        else:
            answer = {"returncode": _exit_status(ask["pid"], exited)}
        answers.write(json.dumps(answer).encode() + b"\n")
        answers.flush()
    return None


def _exit_status(pid: int, exited: dict[int, int]) -> int | None:
    """Popen's returncode for a child: None while it runs, minus the signal that ended it."""
    if pid not in exited:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not ours: nothing to report
            return None
        if done == 0:
            return None
        exited[pid] = os.waitstatus_to_exitcode(status)
    return exited[pid]


def become_server(start: Start) -> int:
    """In the forked child: take the start's folder, files and environment, then run app.cli as `python -m` would."""
    import app.cli

    os.chdir(start.cwd)
    log = os.open(start.log, os.O_WRONLY | os.O_APPEND)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the pipes to the test process close here: fds 0 and 1 were them
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the process's own stdin, never closed)
    sys.stdout = _text(1)
    sys.stderr = _text(2)
    os.environ.clear()
    os.environ.update(start.env)
    tempfile.tempdir = None  # found again from TMPDIR, as a fresh interpreter would
    random.seed()  # a fresh interpreter's seeds, not the sequence every fork would share
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    sys.argv = [str(app.cli.__file__), *start.args]
    # multiprocessing's workers import the main module by its name, as they do under `python -m app.cli`.
    sys.modules["__main__"] = app.cli
    return app.cli.main()


def _text(fd: int) -> io.TextIOWrapper:
    """A stream on `fd` written through at once, as PYTHONUNBUFFERED gives a fresh interpreter."""
    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(raw, encoding="utf-8", errors="backslashreplace", line_buffering=True, write_through=True)


def main() -> int:
    # What every start would import, as the supervisor's own fork server does: the web stack and grpc,
    # torch and the engine (app.process.server imports no torch), and what a server loads before it is ready.
    from app.process.supervisor import WORKER_PRELOAD

    for module in ("app.cli", *WORKER_PRELOAD):
        importlib.import_module(module)
    start = serve(sys.stdin.buffer, sys.stdout.buffer)
    if start is None:
        return 0
    return become_server(start)


if __name__ == "__main__":
    sys.exit(main())
