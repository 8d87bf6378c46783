"""The start (issue 29, items 6-8): a port in the way names the fix, what can be checked is checked
before torch is imported, and a signal while the models load stops the start.

Real `ffn-serve` processes where the start itself is what is tested; the settings in-process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from app.config.settings import command_line, load_settings
from app.config.settings_problems import SettingsError
from ffn_core import FFNConfig, build_ffn, save_ffn
from ffn_testing import free_port

ROOT = Path(__file__).resolve().parents[1]


# ----- item 8: the README's "Another port", and a port that collides with gRPC's ---------------------


def test_the_readmes_other_port_example_is_a_valid_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every command and variable of the README's "Another port" line: settings that start (8001 is gRPC's)."""
    line = next(text for text in (ROOT / "README.md").read_text().splitlines() if text.startswith("Another port:"))
    commands = re.findall(r"`bash scripts/serve\.sh ([^`]*)`", line)
    variables = re.findall(r"`(FFN_[A-Z_]+)=([^`;\s]+)", line)
    assert commands and variables, line
    for args in commands:
        settings = load_settings(**command_line(shlex.split(args)))
        assert settings.port != settings.grpc_port
    for name, value in variables:
        monkeypatch.setenv(name, value)
        settings = load_settings()
        assert str(settings.port) == value and settings.port != settings.grpc_port


def test_a_port_that_is_grpcs_names_both_ways_out() -> None:
    with pytest.raises(SettingsError) as refused:
        load_settings(**command_line(["--port", "8001"]))
    (problem,) = refused.value.problems
    assert "grpc_port must differ from port" in problem
    assert "--grpc-port N (FFN_GRPC_PORT)" in problem and "--no-grpc (FFN_GRPC=false)" in problem
    # Each way out, as the line says it, is a valid start.
    assert load_settings(**command_line(["--port", "8001", "--grpc-port", "9001"])).grpc_port == 9001
    assert load_settings(**command_line(["--port", "8001", "--no-grpc"])).grpc is False


# ----- item 7: what can be checked is checked before torch is imported --------------------------------

# main() in a real process, which then says whether torch was imported: the checks that come before
# it take a fraction of a second, torch seconds (over a minute on a loaded machine).
MAIN_THEN_SAY = (
    "import sys; from app.cli import main; code = main(sys.argv[1:]); "
    "print('torch imported' if 'torch' in sys.modules else 'no torch'); sys.exit(code)"
)


def start_refused(*args: str, expected: int) -> list[str]:
    """ffn-serve with `args`, which must exit `expected` without importing torch; its lines, each the one
    style of a refused start (`ffn-serve: ...` on stderr, whatever the log format), without the prefix."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FFN_")}
    result = subprocess.run(
        [sys.executable, "-c", MAIN_THEN_SAY, *args, "--log-format", "json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )
    assert result.returncode == expected, result.stderr[-3000:]
    assert result.stdout == "no torch\n", result.stderr[-3000:]
    lines = result.stderr.splitlines()
    assert lines and all(line.startswith("ffn-serve: ") for line in lines), result.stderr[-3000:]
    return [line.removeprefix("ffn-serve: ") for line in lines]


@pytest.mark.server
@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_port_in_use_is_found_before_torch_and_says_another_ffn_serve_may_be_there(workers: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        main = start_refused("--port", str(port), "--grpc-port", "0", "--workers", workers, expected=3)
        grpc = start_refused("--port", str(free_port()), "--grpc-port", str(port), "--workers", workers, expected=3)
        metrics = start_refused(
            "--port", str(free_port()), "--grpc-port", "0", "--metrics-port", str(port), expected=3
        )  # fmt: skip
    assert main == [
        f"cannot listen on 127.0.0.1:{port}: Address already in use: another ffn-serve may be running there; "
        "stop it, or choose another port with --port N (FFN_PORT)"
    ]
    assert grpc == [
        f"cannot listen on 127.0.0.1:{port} (gRPC): Address already in use: another ffn-serve may be running there; "
        "give gRPC another port with --grpc-port N (FFN_GRPC_PORT), or turn it off with --no-grpc (FFN_GRPC=false)"
    ]
    assert metrics[0].endswith("choose another port with --metrics-port N (FFN_METRICS_PORT)"), metrics


@pytest.mark.server
def test_a_weights_file_that_cannot_be_read_is_found_before_torch(tmp_path: Path) -> None:
    (tmp_path / "folder.safetensors").mkdir()
    (tmp_path / "ffn.toml").write_text(
        '[[models]]\nname = "demo"\n\n'
        '[[models]]\nname = "gone"\nweights = "missing.safetensors"\n\n'
        '[[models]]\nname = "folder"\nweights = "folder.safetensors"\n'
    )
    errors = start_refused("--config", str(tmp_path / "ffn.toml"), "--port", "0", "--grpc-port", "0", expected=2)
    assert errors == [
        f"model 'gone': cannot load {tmp_path / 'missing.safetensors'}: No such file or directory",
        f"model 'folder': cannot load {tmp_path / 'folder.safetensors'}: it is a directory, not a regular file",
    ]


# ----- item 6: a signal while the models load stops the start ------------------------------------------


def five_models(folder: Path) -> Path:
    """A config of five models from one file (d_model 512, d_ff 8192): five reads, then five warm-ups."""
    weights = folder / "wide.safetensors"
    torch.manual_seed(0)
    save_ffn(build_ffn(FFNConfig(d_model=512, d_ff=8192, activation="relu")), weights)
    tables = "".join(f'[[models]]\nname = "m{i}"\nweights = "wide.safetensors"\n\n' for i in range(5))
    config = folder / "ffn.toml"
    config.write_text(tables)
    return config


STOP_AFTER = "m0"


def signalled_while_loading(
    config: Path, sig: signal.Signals, *, workers: int, sigint_ignored: bool
) -> tuple[int, str]:
    """Start ffn-serve on `config`, send `sig` once the first model is loaded; its exit code and log.

    `sigint_ignored`: start it with SIGINT ignored, as a shell leaves a command it runs in the
    background (`bash scripts/serve.sh &`).
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("FFN_")}
    args = [
        "--config",
        str(config),
        "--port",
        "0",
        "--grpc-port",
        "0",
        "--workers",
        str(workers),
        "--torch-threads",
        "1",
    ]
    process = subprocess.Popen(
        [sys.executable, "-m", "app.cli", *args],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None,
    )
    assert process.stderr is not None
    lines: list[str] = []
    try:
        for line in process.stderr:
            lines.append(line)
            if f"loaded model {STOP_AFTER}" in line:
                process.send_signal(sig)
                break
        else:
            raise AssertionError("the server ended before loading a model:\n" + "".join(lines))
        # Generous: the models' warm-up under way on a thread finishes before the process ends.
        lines.extend(process.communicate(timeout=180)[1])
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return process.returncode, "".join(lines)


@pytest.mark.server
@pytest.mark.parametrize(
    ("sig", "sigint_ignored"),
    [(signal.SIGTERM, False), (signal.SIGINT, True)],
    ids=["SIGTERM", "SIGINT-in-the-background"],
)
def test_a_signal_while_the_models_load_stops_the_start_with_exit_0(
    tmp_path: Path, sig: signal.Signals, sigint_ignored: bool
) -> None:
    code, log = signalled_while_loading(five_models(tmp_path), sig, workers=1, sigint_ignored=sigint_ignored)
    assert code == 0, log[-3000:]
    assert "ready:" not in log and "Traceback" not in log, log[-3000:]
    # Stopped where it was, loading (before it listens) or warming up once it listens: never ready, it
    # served nothing, and says so (issue 41: a warming single process logged "draining").
    assert f"received {sig.name} while starting: stopped before serving" in log, log[-3000:]
    assert "draining" not in log, log[-3000:]


@pytest.mark.server
def test_a_signal_while_workers_load_stops_each_of_them_with_exit_0(tmp_path: Path) -> None:
    code, log = signalled_while_loading(five_models(tmp_path), signal.SIGINT, workers=2, sigint_ignored=True)
    assert code == 0, log[-3000:]
    assert "received SIGINT: stopping 2 workers" in log, log[-3000:]
    assert "ready:" not in log and "Traceback" not in log, log[-3000:]
    # Each worker was loading or warming up, which it does before it accepts anything: a stopped start.
    assert log.count("received SIGTERM while starting: stopped before serving") == 2, log[-3000:]


# ----- item 5: a signal's log lines and the drain it starts carry no request's id ---------------------


async def test_a_signal_handled_inside_a_requests_context_logs_and_drains_outside_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A signal handler runs in whatever context it interrupted: here, a request's, as under load."""
    import uvicorn

    from app.config.settings import Settings
    from app.http.transport.protocol import uvicorn_options
    from app.main import create_app
    from app.observe import identity as request_context
    from app.process.server import DrainingServer

    settings = Settings(warmup=False)
    app = create_app(settings)
    engine = app.state.service.engine
    config = uvicorn.Config(app, log_config=None, **uvicorn_options(settings))
    config.load()
    server = DrainingServer(config, engine)
    server.started = True
    # Serving, warm: a signal now drains (one still starting, or warming up, stops the start instead).
    server._warm = True
    seen: list[object] = []

    class Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(("log", record.getMessage(), request_context.current()))

    async def drain() -> bool:
        seen.append(("drain", request_context.current()))
        return True

    monkeypatch.setattr(engine, "drain", drain)
    recorder = Recorder()
    logger = logging.getLogger("ffn_serve")
    level = logger.level
    logger.addHandler(recorder)
    logger.setLevel(logging.INFO)
    try:
        token = request_context.CURRENT.set(request_context.RequestContext("a-request-under-way"))
        try:
            server.handle_exit(signal.SIGTERM, None)
        finally:
            request_context.CURRENT.reset(token)
        assert server._drain_task is not None
        await asyncio.wait_for(server._drain_task, 30)
    finally:
        logger.removeHandler(recorder)
        logger.setLevel(level)
    assert seen[0][:2] == ("log", "received SIGTERM: draining (up to 20.0 s)") and seen[0][2] is None, seen
    assert ("drain", None) in seen, seen
