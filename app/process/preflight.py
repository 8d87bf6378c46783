"""What ffn-serve checks before it imports torch: every configured model can be read as its table asks
(the weights file there and readable, the layer in it, the device in this torch), its ports can be
bound, and with shared_engine, the host has the memory the hand-off's slots reserve.

torch alone takes seconds to import (a minute on a loaded machine), and the models longer to
load: a port in use, a weights file missing or a layer past the last was reported only after both.
Checked here first, each is one line in a fraction of a second. Only what is certain is refused:
what needs torch to know (a tensor's shape or values, how many GPUs there are) is checked as the
models load (app/engine/registry.py), and so is anything this cannot read.
"""

from __future__ import annotations

import ast
import errno
import importlib.util
import os
import socket
import stat
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from app.config.settings import GRPC_PORT_FIX, Settings
from app.grpc.ports import reserve
from app.process.listeners import Listeners
from ffn_core.errors import WeightsError
from ffn_core.families import FAMILIES, find_layers, layer_problem
from ffn_core.files import file_kind
from ffn_core.header import safetensors_keys
from ffn_core.hub import cached_weights, hub_format

ANOTHER_SERVER = "another ffn-serve may be running there"


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, not yet listening; uvicorn listens on it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def listeners(settings: Settings) -> Listeners | str:
    """Every port of the service bound (the gRPC port held), or the one line saying which cannot be and why."""
    main = _bind_or_why(settings.host, settings.port, "--port N (FFN_PORT)")
    if isinstance(main, str):
        return main
    bound = Listeners(main)
    if settings.metrics_port is not None:
        metrics = _bind_or_why(settings.host, settings.metrics_port, "--metrics-port N (FFN_METRICS_PORT)")
        if isinstance(metrics, str):
            bound.close()
            return metrics
        bound.metrics = metrics
    if settings.grpc:
        try:
            bound.grpc = reserve(settings.host, settings.grpc_port)
        except OSError as exc:
            bound.close()
            way_out = f": {ANOTHER_SERVER}; {GRPC_PORT_FIX}" if exc.errno == errno.EADDRINUSE else ""
            return f"cannot listen on {settings.host}:{settings.grpc_port} (gRPC): {_reason(exc)}{way_out}"
    return bound


def refusals(settings: Settings) -> list[str]:
    """One line per reason a configured model cannot be served as its table asks, as far as it shows without
    torch: a weights file missing or unreadable, a checkpoint without the layer asked for, a GPU asked of a
    torch built without one."""
    return unreadable_weights(settings) + missing_layers(settings) + missing_gpus(settings)


def unreadable_weights(settings: Settings) -> list[str]:
    """One line per configured model whose weights file is missing, not a regular file, or not readable."""
    problems = []
    for spec in settings.served_models():
        if spec.weights is not None and (why := _unreadable(str(spec.weights))) is not None:
            problems.append(f"model {spec.name!r}: cannot load {spec.weights}: {why}")
    return problems


def missing_layers(settings: Settings) -> list[str]:
    """One line per checkpoint-family model whose safetensors file has no such layer, from its header alone
    (the words the loader would say, ffn_core/checkpoints.py): a local file, or an hf_model's where the cache
    holds the file a load would read (ffn_core/hub.py). A torch state dict needs torch to be read, and a Hub
    file not yet fetched is not there: their layers are checked as they load."""
    problems = []
    for spec in settings.served_models():
        path, format = spec.weights, str(spec.format or "")  # an hf_model's config.json may name it
        if spec.hf_model is not None:
            path = cached_weights(spec.hf_model, spec.revision)
            if path is not None and not format:
                try:
                    format = hub_format(path)
                except WeightsError:  # the loader says why, in full
                    continue
        if path is None or format not in FAMILIES or spec.layer is None:
            continue
        keys = safetensors_keys(path)
        if keys is None:
            continue
        _, layers = find_layers(keys, FAMILIES[format])
        if (missing := layer_problem(format, spec.layer, layers)) is not None:
            problems.append(f"model {spec.name!r}: {path}: {missing}")
    return problems


def missing_gpus(settings: Settings) -> list[str]:
    """One line per device setting naming a GPU where the installed torch is built for none (its version.py
    read, torch not imported). A torch built with CUDA (or ROCm, whose GPUs torch also calls cuda) passes
    here, GPU or not: a driver's device files can appear only as it first starts, so only torch can tell."""
    build = torch_build()
    if build is None or build.gpu:
        return []
    if settings.devices:  # shared_engine: each engine places every model on its device
        asked = [("setting devices", device) for device in settings.devices]
    else:
        asked = [(f"model {spec.name!r}", spec.device) for spec in settings.served_models()]
    fix = 'choose device "cpu" (or "auto": a GPU when there is one), or install a build of torch with CUDA'
    return [
        f"{what}: device {device!r} needs CUDA, and torch {build.version} is built without it: {fix}"
        for what, device in dict.fromkeys(asked)
        if device.startswith("cuda")
    ]


@dataclass(frozen=True)
class TorchBuild:
    """What the installed torch was built for, read from its version.py without importing it."""

    version: str
    gpu: bool  # built with CUDA or ROCm


def torch_build() -> TorchBuild | None:
    """The installed torch's build, or None where it cannot be read with certainty (then nothing is refused)."""
    try:
        spec = importlib.util.find_spec("torch")  # finds the package, runs none of it
        if spec is None or not spec.submodule_search_locations:
            return None
        source = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
        values = {
            target.id: node.value.value
            for node in ast.parse(source).body
            if isinstance(node, ast.AnnAssign | ast.Assign) and isinstance(node.value, ast.Constant)
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(target, ast.Name)
        }
        version = metadata.version("torch")
    except (OSError, SyntaxError, ValueError, metadata.PackageNotFoundError):
        return None
    if "cuda" not in values or "hip" not in values:  # a version.py of another shape: not certain
        return None
    return TorchBuild(version, gpu=values["cuda"] is not None or values["hip"] is not None)


def _bind_or_why(host: str, port: int, flag: str) -> socket.socket | str:
    try:
        return bind(host, port)
    except OSError as exc:
        way_out = f": {ANOTHER_SERVER}; stop it, or choose another port with {flag}"
        return f"cannot listen on {host}:{port}: {_reason(exc)}{way_out if exc.errno == errno.EADDRINUSE else ''}"


def _unreadable(path: str) -> str | None:
    """Why the file at `path` cannot be read as weights, or None. Never opens what is not a regular file
    (a FIFO would block the start)."""
    try:
        info = os.stat(path)
    except OSError as exc:
        return _reason(exc)
    if not stat.S_ISREG(info.st_mode):
        return f"it is {file_kind(info.st_mode)}, not a regular file"
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
    except OSError as exc:
        return _reason(exc)
    return None


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def handoff_shortage(settings: Settings) -> str | None:
    """shared_engine: why the memory every front reserves for its slots in every engine is not there
    (one line naming the size and how to raise it), or None. Each front reserves its own at its start too."""
    if not settings.shared_engine:
        return None
    from app.handoff.arena import Arena
    from app.handoff.front import SLOT_BYTES
    from app.handoff.memory import shortage

    engines = max(1, len(settings.devices))
    block = Arena.size_of(settings.handoff_slots, SLOT_BYTES)
    what = (
        f"the hand-off's slots ({settings.workers} front{'s' if settings.workers > 1 else ''} x {engines} engine process{'es' if engines > 1 else ''} x "
        f"{settings.handoff_slots:,} slots of {SLOT_BYTES >> 20} MiB)"
    )
    return shortage(settings.workers * engines * block, what)
