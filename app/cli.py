"""ffn-serve: read the settings, bind the address, then serve until SIGTERM drains it.

The settings are read and checked first, then every model's table held to its file and this
torch's build, the ports bound (app/process/preflight.py), and the server (with torch, seconds to import)
only once all of that holds. Whatever is refused before the start is one line per problem on
stderr, `ffn-serve: <what is wrong>` naming the fix where there is one, in a fraction of a second;
from the banner on, the process is a server and reports in its log (records, text or JSON), as
its workers do. One process (`workers = 1`) loads the models and serves (app/process/server.py); with
more, a supervisor (app/process/supervisor.py) runs that many worker processes on the sockets bound here.

Exit codes (app/process/exits.py): 0 stopped cleanly (drained); 1 a model could not be loaded, the server
failed while starting, or the host lacks the memory the hand-off's slots reserve; 2 invalid
settings or command line, or what they name cannot be used as asked (a TLS or weights file
missing or unreadable, a checkpoint without the layer asked for, a GPU asked of a torch built
without CUDA), or an installed uvicorn that lacks what app/http/transport/protocol.py needs; 3
the address cannot be bound (the port is in use, or not allowed).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from importlib import metadata

from app import __version__
from app.config import tracing as tracing_config
from app.config.settings import Settings, budgets_off, load_settings, misspelt_variables, parse_command
from app.config.settings_problems import SettingsError
from app.observe.logs import configure_logging
from app.observe.metrics_folder import MetricsFolderError, check_metrics_dir
from app.process.exits import EXIT_BAD_SETTINGS, EXIT_CANNOT_BIND, EXIT_OK, EXIT_START_FAILED
from app.process.starting import Starting, StartStopped

log = logging.getLogger("ffn_serve")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        command = parse_command(sys.argv[1:] if argv is None else argv)
        settings = load_settings(**command.settings)
    except SettingsError as exc:
        return _refuse(exc.problems, EXIT_BAD_SETTINGS)
    if command.check:
        return check(settings)
    if settings.workers > 1 or settings.shared_engine:
        try:
            check_metrics_dir(settings.metrics_dir)
        except MetricsFolderError as exc:
            return _refuse([f"invalid setting {exc}"], EXIT_BAD_SETTINGS)
    if settings.tls_cert_file is not None:
        from app.config.tls import start_problems  # cryptography: only where TLS is on

        tls_problems = start_problems(settings)
        if tls_problems:
            return _refuse([f"invalid setting {problem}" for problem in tls_problems], EXIT_BAD_SETTINGS)
    tracing_problems = tracing_config.problems(settings.otlp_endpoint, os.environ)
    if tracing_problems:
        return _refuse(tracing_problems, EXIT_BAD_SETTINGS)
    configure_logging(settings.log_level, settings.log_format)
    for warning in misspelt_variables() + budgets_off(settings):
        log.warning(warning)
    return serve(settings)


def check(settings: Settings) -> int:
    """--check: the models loaded, warmed up and asked once in this process (app/process/check.py); 0, or one line and 2."""
    # Warnings only, unless a log level was asked for: the check's own lines are its output.
    configure_logging(
        settings.log_level if "log_level" in settings.model_fields_set else "warning", settings.log_format
    )
    for warning in misspelt_variables():
        log.warning(warning)
    from app.process.preflight import refusals

    problems = refusals(settings)
    if problems:
        print(f"ffn-serve --check: {problems[0]}", file=sys.stderr)
        return EXIT_BAD_SETTINGS
    with Starting():
        try:
            from app.process.check import check as run_check  # torch and the engine

            return run_check(settings)
        except StartStopped as stopped:
            print(f"ffn-serve --check: {stopped}: the check did not finish", file=sys.stderr)
            return EXIT_BAD_SETTINGS


def serve(settings: Settings) -> int:
    # A SIGTERM or SIGINT from here until the server serves stops the start, exit 0 (app/process/starting.py).
    with Starting() as starting:
        try:
            return _start(settings, starting)
        except StartStopped as stopped:
            log.info("%s: stopped before serving", stopped)
            return EXIT_OK


def _start(settings: Settings, starting: Starting) -> int:
    # Before torch, the models or a port: a uvicorn outside the pinned range fails here, in one line.
    from app.http.transport import uvicorn_members

    mismatch = uvicorn_members.mismatch()
    if mismatch is not None:
        return _refuse([mismatch], EXIT_BAD_SETTINGS)
    # Before torch (seconds to import) and the models: a weights file missing, a layer past the last, a
    # port in use, in a moment. Every refusal is one `ffn-serve: ...` line, as a settings mistake is.
    from app.process.preflight import handoff_shortage, refusals
    from app.process.preflight import listeners as bind_listeners

    problems = refusals(settings)
    if problems:
        return _refuse(problems, EXIT_BAD_SETTINGS)
    listeners = bind_listeners(settings)
    if isinstance(listeners, str):
        return _refuse([listeners], EXIT_CANNOT_BIND)
    try:
        if (shortage := handoff_shortage(settings)) is not None:
            return _refuse([shortage], EXIT_START_FAILED)
        if listeners.grpc is not None:
            # Port 0 is resolved once, here: every worker's gRPC server binds the port held.
            settings = settings.model_copy(update={"grpc_port": listeners.grpc.getsockname()[1]})
        # torch, which the banner reads and the server imports, takes seconds and some 200 MiB: a
        # supervisor of workers, which computes nothing, never imports it.
        log.info("ffn-serve %s, %s", __version__, _runtime(settings))
        export = tracing_config.traces_export(settings.otlp_endpoint, os.environ)
        if export is not None:
            log.info("tracing on: spans to %s (named by %s)", export.endpoint, export.named_by)
        if settings.workers > 1 or settings.shared_engine:  # one front and its engine are two processes too
            from app.process.supervisor import Supervisor

            starting.end()  # the supervisor handles the signals from here, passing them to the workers
            return Supervisor(settings, listeners).run()
        from app.observe.metrics import Metrics
        from app.process.server import serve_here

        return serve_here(settings, listeners, Metrics(), starting=starting)
    finally:
        listeners.close()


def _refuse(problems: Sequence[str], code: int) -> int:
    """A start refused before anything started: one `ffn-serve: ...` line per problem on stderr, and `code`."""
    for problem in problems:
        print(f"ffn-serve: {problem}", file=sys.stderr)
    return code


def _runtime(settings: Settings) -> str:
    """torch's version, CUDA's and the devices served on; on the CPU, the torch threads each process will use.

    With workers, from the supervisor, which does not import torch: torch's version as installed,
    and the threads each worker will set; each worker names its models' devices as it loads them.
    """
    if settings.shared_engine:
        from app.process.supervisor import engines_named

        fronts = f"{settings.workers} front{'' if settings.workers == 1 else 's'}"
        return f"torch {metadata.version('torch')}, {fronts} and {engines_named(settings)}"
    if settings.workers > 1:
        from app.process.supervisor import threads_per_worker

        threads = _threads(threads_per_worker(settings))
        return f"torch {metadata.version('torch')}, {settings.workers} workers of {threads} each"
    import torch

    cuda = f"torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}"
    if not torch.cuda.is_available():
        return f"{cuda}, CPU only ({_threads(settings.intra_op_threads() or torch.get_num_threads())})"
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return f"{cuda}, GPUs: " + ", ".join(f"cuda:{i} {name}" for i, name in enumerate(names))


def _threads(count: int) -> str:
    return f"{count} torch thread{'' if count == 1 else 's'}"


if __name__ == "__main__":
    sys.exit(main())
