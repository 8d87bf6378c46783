"""Run an ffn-serve process on a free local port for the length of a `with` block.

For tests and benchmarks that need a real server:

    with LocalServer(env={"FFN_MAX_WAIT_MS": "2"}) as server:
        report = asyncio.run(run_load(LoadConfig(url=server.url, requests=1000)))

It starts a command (by default `python -m app.cli`, i.e. `ffn-serve`) as a subprocess; the
client library itself never imports the server.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

DEFAULT_COMMAND = (sys.executable, "-m", "app.cli")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class LocalServer:
    """`command --host 127.0.0.1 --port <free> *args` until the block ends; ready when it is entered."""

    def __init__(
        self,
        *args: str,
        env: Mapping[str, str] | None = None,
        command: Sequence[str] = DEFAULT_COMMAND,
        cwd: str | Path | None = None,
        ready_timeout: float = 120.0,
    ) -> None:
        self.args = args
        self.env = {**os.environ, **(env or {})}
        self.command = tuple(command)
        self.cwd = cwd
        self.ready_timeout = ready_timeout
        self.host = "127.0.0.1"
        self.port = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._log = tempfile.TemporaryFile()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def output(self) -> str:
        """Everything the server printed so far."""
        self._log.seek(0)
        return self._log.read().decode("utf-8", "replace")

    def __enter__(self) -> LocalServer:
        self.port = free_port(self.host)
        self._process = subprocess.Popen(
            [*self.command, "--host", self.host, "--port", str(self.port), *self.args],
            env=self.env, cwd=self.cwd, stdout=self._log, stderr=subprocess.STDOUT,
        )
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_ready(self) -> None:
        assert self._process is not None, "_wait_ready before start. This is a bug."
        deadline = time.monotonic() + self.ready_timeout
        with httpx.Client(base_url=self.url, timeout=2.0) as http:
            while time.monotonic() < deadline:
                if self._process.poll() is not None:
                    raise RuntimeError(f"server exited with {self._process.returncode}:\n{self.output()[-4000:]}")
                try:
                    if http.get("/v2/health/ready").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
        raise TimeoutError(f"server not ready after {self.ready_timeout:g} s:\n{self.output()[-4000:]}")

    def __exit__(self, *exc_info: object) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)  # graceful: the server drains, then exits
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._log.close()
