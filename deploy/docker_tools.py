"""The Docker engine and tools as deploy/docker_check.py finds them: the CLI, the engine, Compose v2, an index.

Kept apart from the checks so that tests can ask (is there an engine? Compose v2?) without
running any; and the few questions every check asks of a container (healthy yet? exit code?).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class CheckFailed(Exception):
    """A check did not hold; the message says what was seen."""


def docker_cli() -> list[str]:
    """The docker client: $DOCKER, else /usr/bin/docker (an engine's own), else docker on PATH."""
    if os.environ.get("DOCKER"):
        return [os.environ["DOCKER"]]
    return ["/usr/bin/docker"] if os.path.exists("/usr/bin/docker") else ["docker"]


def docker(*args: str, timeout: float = 120, check: bool = True) -> str:
    """Run a docker command; its stdout, or CheckFailed with its stderr."""
    env = {
        **os.environ,
        "DOCKER_BUILDKIT": "1",
    }  # the Dockerfile's COPY --chmod; a 20.10 client defaults to the old builder
    try:
        result = subprocess.run([*docker_cli(), *args], capture_output=True, text=True, timeout=timeout, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CheckFailed(f"docker {' '.join(args[:3])}: {type(exc).__name__}: {exc}") from exc
    if check and result.returncode != 0:
        raise CheckFailed(f"docker {' '.join(args)} exited {result.returncode}: {result.stderr.strip()[-2000:]}")
    return result.stdout.strip()


def engine_reachable(timeout: float = 5.0) -> str | None:
    """None when an engine answers; otherwise why not (for a skip message)."""
    try:
        result = subprocess.run(
            [*docker_cli(), "version", "--format", "{{.Server.Version}}"],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"no Docker client or engine: {type(exc).__name__}: {exc}"
    if result.returncode != 0:
        return f"no Docker engine answered (DOCKER_HOST={os.environ.get('DOCKER_HOST', 'default')}): {result.stderr.strip()[:300]}"
    return None


def torch_index() -> str:
    """The CPU torch wheel index the build uses: $DOCKER_CHECK_TORCH_INDEX, else the Dockerfile's default."""
    default = re.search(r"ARG CPU_TORCH_INDEX=(\S+)", (ROOT / "Dockerfile").read_text())
    assert default, "the Dockerfile declares no CPU_TORCH_INDEX default. This is a bug."
    return os.environ.get("DOCKER_CHECK_TORCH_INDEX") or default[1]


def index_unreachable(url: str) -> str | None:
    """None when `url`/torch/ answers; otherwise why not (the build would fail at its first step)."""
    import httpx

    try:
        httpx.get(f"{url.rstrip('/')}/torch/", timeout=10, trust_env=False).raise_for_status()
    except httpx.HTTPError as exc:
        return f"the torch index {url} does not answer ({type(exc).__name__}: {exc}): set DOCKER_CHECK_TORCH_INDEX"
    return None


def compose_v2() -> tuple[list[str] | None, str]:
    """The Compose v2 command and its version, or None and why not (v1 alone, or none)."""
    seen = []
    for command in ([*docker_cli(), "compose"], ["docker", "compose"], ["docker-compose"]):
        if shutil.which(command[0]) is None:
            continue
        try:
            result = subprocess.run([*command, "version"], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            continue
        version = re.search(r"v?(\d+)\.(\d+)\.(\d+)", result.stdout) if result.returncode == 0 else None
        if version and int(version[1]) >= 2:
            return command, version[0]
        if version:
            seen.append(f"{' '.join(command)} {version[0]}")
    found = f"only Compose v1 ({', '.join(seen)})" if seen else "no Compose"
    return None, f"{found}: docker-compose.yml needs Compose v2 (its top-level `name:`, `up --wait`)"


def engine_version() -> tuple[int, ...]:
    """The engine's version as numbers (20.10.24+dfsg1 -> (20, 10, 24))."""
    found = re.match(r"(\d+)\.(\d+)\.(\d+)", docker("version", "--format", "{{.Server.Version}}"))
    assert found, "the engine reports no version. This is a bug."
    return tuple(int(n) for n in found.groups())


def wait_healthy(name: str, limit_s: float = 240) -> float:
    """Seconds until Docker's health check says healthy; CheckFailed with the logs if it never does."""
    started = time.perf_counter()
    while time.perf_counter() - started < limit_s:
        state = json.loads(docker("inspect", "-f", "{{json .State}}", name))
        if state.get("Health", {}).get("Status") == "healthy":
            return round(time.perf_counter() - started, 1)
        if not state["Running"] and not state.get("Restarting"):
            raise CheckFailed(f"{name} exited {state['ExitCode']} before healthy:\n{logs(name)}")
        time.sleep(0.5)
    raise CheckFailed(f"{name} not healthy after {limit_s:g} s:\n{logs(name)}")


def wait_exited(name: str, limit_s: float = 120) -> int:
    """The container's exit code once it has stopped by itself."""
    return int(docker("wait", name, timeout=limit_s))


def exit_code(name: str) -> int:
    return int(docker("inspect", "-f", "{{.State.ExitCode}}", name))


def logs(name: str, tail: int = 30) -> str:
    """The container's last lines, stdout and stderr together (docker logs writes them to both)."""
    result = subprocess.run([*docker_cli(), "logs", "--tail", str(tail), name], capture_output=True, text=True)
    return (result.stdout + result.stderr).strip()
