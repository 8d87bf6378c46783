"""Run a real `ffn-serve` process for a test: start it on a free port, wait until ready, stop it.

    with running_server(env={"FFN_MAX_QUEUE_ROWS": "64"}) as srv:
        httpx.get(srv.url + "/v2/health/ready")
        srv.proc.pid, srv.logs()
    srv.returncode  # after the block: the exit code of the SIGTERM stop

The process is `python -m app.cli --host 127.0.0.1 --port <free port>`, its output in a log
file (a pipe nobody reads could fill up and stall the server). FFN_* variables of the calling
environment are dropped so that a developer's shell cannot change what a test sees.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from bench.soak import read_rss

REPO_ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"


class ServerFailed(RuntimeError):
    """The server exited or never became ready; the message holds its log."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    returncode: int | None = field(default=None)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rss_bytes(self) -> int:
        """Resident set size from /proc/<pid>/status (VmRSS)."""
        return read_rss(self.proc.pid)

    def terminate(self) -> None:
        """Send SIGTERM (a drain) without waiting."""
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 30.0) -> int:
        """Wait for the process to exit; kill it and raise if it does not in `timeout` seconds."""
        try:
            self.returncode = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.returncode = self.proc.wait(10)
            raise ServerFailed(f"server did not exit within {timeout} s of SIGTERM; log:\n{self.logs()}") from None
        return self.returncode

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then wait for the exit code (killed after `timeout` seconds)."""
        if self.proc.poll() is None:
            self.terminate()
        return self.wait(timeout)


def start_server(env: Mapping[str, str] | None = None, config: str | Path | None = None,
                 *, ready_timeout: float = 90.0) -> ServerProcess:
    """Start the server and return once /v2/health/ready answers 200 (ServerFailed otherwise)."""
    port = free_port()
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("FFN_")}
    child_env.update({"PYTHONUNBUFFERED": "1", "FFN_LOG_LEVEL": "info"})
    child_env.update(env or {})
    args = [sys.executable, "-m", "app.cli", "--host", HOST, "--port", str(port)]
    if config is not None:
        args += ["--config", str(config)]
    log_fd, log_name = tempfile.mkstemp(prefix=f"ffn-serve-{port}-", suffix=".log")
    with os.fdopen(log_fd, "wb") as log:
        proc = subprocess.Popen(args, cwd=REPO_ROOT, env=child_env, stdout=log, stderr=subprocess.STDOUT)
    server = ServerProcess(proc, port, Path(log_name))
    try:
        _wait_ready(server, ready_timeout)
    except BaseException:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        raise
    return server


def _wait_ready(server: ServerProcess, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if server.proc.poll() is not None:
                raise ServerFailed(f"server exited with {server.proc.returncode} while starting; log:\n{server.logs()}")
            try:
                if client.get(server.url + "/v2/health/ready").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
    raise ServerFailed(f"server not ready within {timeout} s; log:\n{server.logs()}")


@contextmanager
def running_server(env: Mapping[str, str] | None = None, config: str | Path | None = None,
                   *, ready_timeout: float = 90.0, stop_timeout: float = 30.0) -> Iterator[ServerProcess]:
    """A ready server for the block; stopped with SIGTERM after it (unless the block stopped it)."""
    server = start_server(env, config, ready_timeout=ready_timeout)
    try:
        yield server
    finally:
        if server.proc.poll() is None:
            server.stop(stop_timeout)
        else:
            server.returncode = server.proc.returncode
        if server.returncode == 0:  # keep the log of a server that failed, for whoever debugs it
            server.log_path.unlink(missing_ok=True)


@functools.cache
def _demo_weights() -> dict[str, np.ndarray]:
    from ffn_core import demo_ffn

    return {k: v.double().numpy() for k, v in demo_ffn().state_dict().items()}


def demo_reference(x: np.ndarray) -> np.ndarray:
    """The demo model's answer in float64 numpy: max(0, x W1ᵀ + b1) W2ᵀ + b2, for checking the server."""
    w = _demo_weights()
    hidden = np.maximum(np.asarray(x, dtype=np.float64) @ w["layer1.weight"].T + w["layer1.bias"], 0.0)
    return hidden @ w["layer2.weight"].T + w["layer2.bias"]


def slow_model_config(folder: Path, settings: str = "", *, with_demo: bool = False, d_ff: int = 8192) -> Path:
    """A TOML config serving `slow` (d_model 512, d_ff `d_ff`, ReLU, saved with save_ffn), maybe `demo` too.

    A few thousand rows of `slow` keep the model thread busy for a second or more on a small
    CPU: the way to hold work in the queue behind a forward pass.
    """
    import torch

    from ffn_core import FFNConfig, build_ffn, save_ffn

    weights = folder / "slow.safetensors"
    if not weights.exists():
        torch.manual_seed(0)
        save_ffn(build_ffn(FFNConfig(d_model=512, d_ff=d_ff, activation="relu")), weights)
    models = '[[models]]\nname = "slow"\nweights = "slow.safetensors"\nformat = "native"\n'
    if with_demo:
        models = '[[models]]\nname = "demo"\n\n' + models  # no weights: the built-in demo
    config = folder / "ffn.toml"
    config.write_text(f"{settings}\n\n{models}")
    return config


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]  # lower-case names; a repeated header keeps its last value
    body: bytes

    def json(self) -> object:
        return json.loads(self.body)


async def raw_request(port: int, data: bytes | Iterable[bytes], *, timeout: float = 30.0) -> RawResponse:
    """Send bytes exactly as given (one piece or several writes) and read one answer.

    For requests httpx would normalise (dot segments, huge or duplicate headers, chunked
    framing) and for bursts: one connection per request is cheap for the server, and httpx's
    pool gets slow with hundreds of concurrent connections. The answer is read up to its
    Content-Length (to EOF without one). A reset while sending (the server answered early)
    still reads the answer.
    """
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        async with asyncio.timeout(timeout):
            try:
                for piece in [data] if isinstance(data, bytes) else data:
                    writer.write(piece)
                    await writer.drain()
            except (ConnectionResetError, BrokenPipeError):
                pass
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as exc:
                raise ConnectionError(f"the server closed the connection without an answer: {exc.partial[:200]!r}")
            status_line, *header_lines = head.decode("latin1").rstrip("\r\n").split("\r\n")
            headers = {}
            for line in header_lines:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            assert "chunked" not in headers.get("transfer-encoding", ""), "chunked answers are not parsed here"
            if "content-length" in headers:
                body = await reader.readexactly(int(headers["content-length"]))
            else:
                body = await reader.read()
    finally:
        writer.close()
    return RawResponse(int(status_line.split(" ", 2)[1]), headers, body)


def http_request(method: str, path: str, headers: Mapping[str, str] | None = None, body: bytes = b"",
                 *, close: bool = True) -> bytes:
    """The bytes of an HTTP/1.1 request with Host, Content-Length and (unless `close` is false)
    Connection: close.

    Keep the connection open (close=False) when the server may answer before reading the whole
    body: closing a socket with unread data makes the kernel reset it, and the reset can destroy
    the answer before the client reads it.
    """
    lines = [f"{method} {path} HTTP/1.1", f"Host: {HOST}"] + (["Connection: close"] if close else [])
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    framed = {name.lower() for name in (headers or {})} & {"content-length", "transfer-encoding"}
    if (body or method == "POST") and not framed:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin1") + body


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text (0.0 when the series does not exist yet)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        series, _, label_text = head.partition("{")
        if series != name:
            continue
        found = dict(
            (part.split("=", 1)[0], part.split("=", 1)[1].strip('"'))
            for part in label_text.rstrip("}").split(",") if "=" in part
        )
        if all(found.get(k) == v for k, v in labels.items()):
            return float(value)
    return 0.0
