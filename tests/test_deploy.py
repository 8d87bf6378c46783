"""Deployment files: Dockerfile, docker-compose.yml, deploy/ (nginx, Kubernetes, config example).

There is no Docker engine where these tests run, so no image is built or started here. What can
be checked is: the files parse, say what the service needs (ports, paths, settings, scripts,
signals) and agree with the code; the container's entry and health-check scripts behave as the
image runs them; Kubernetes manifests validate against the Kubernetes schemas; and tools that
work offline (docker compose, hadolint, nginx) accept the files where they are installed.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.settings import Settings, read_config_file
from ffn_client.testing import free_port

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
READY_PATH = "/v2/health/ready"
LIVE_PATH = "/v2/health/live"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CONSOLE_SCRIPTS = set(PYPROJECT["project"]["scripts"])
SERVICE_PORT = Settings.model_fields["port"].default
DRAIN_TIMEOUT_S = Settings.model_fields["drain_timeout_s"].default


def setting_name(env_name: str) -> str | None:
    """The Settings field an FFN_* variable sets, or None when it sets none."""
    name = env_name.lower()[4:]
    return name if env_name.startswith("FFN_") and name in Settings.model_fields else None


# --- Dockerfile ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, ...
    args: str  # the rest of the instruction, continuation lines joined
    stage: int  # index of the FROM it belongs to; -1 before the first

    def flags(self) -> dict[str, str]:
        """Leading `--name=value` flags (COPY --chmod, HEALTHCHECK --interval, ...)."""
        return dict(re.findall(r"--([a-z-]+)=(\S+)", self.args.split("[", 1)[0]))

    def exec_form(self) -> list[str] | None:
        """The JSON list of an exec-form instruction (after any flags), or None for shell form."""
        rest = re.sub(r"^(--[a-z-]+=\S+\s+)*", "", self.args)
        if self.keyword == "HEALTHCHECK":
            rest = re.sub(r"^CMD\s+", "", rest)
        if not rest.startswith("["):
            return None
        value = json.loads(rest)
        assert isinstance(value, list) and all(isinstance(v, str) for v in value)
        return value


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions of a Dockerfile: comments and directives dropped, `\\` continuations joined."""
    instructions: list[Instruction] = []
    stage = -1
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue  # comments (and parser directives) even inside a continued instruction
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = (pending + stripped).strip()
        pending = ""
        if not full:
            continue
        keyword, _, args = full.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        instructions.append(Instruction(keyword, " ".join(args.split()), stage))
    assert not pending, "the Dockerfile ends inside a continued instruction"
    return instructions


DOCKERFILE = parse_dockerfile((ROOT / "Dockerfile").read_text())


def instructions(keyword: str, stage: int | None = None) -> list[Instruction]:
    return [i for i in DOCKERFILE if i.keyword == keyword and (stage is None or i.stage == stage)]


def arg_defaults(stage: int) -> dict[str, str]:
    """ARG name -> default declared in one stage (-1: before the first FROM)."""
    defaults = {}
    for arg in instructions("ARG", stage):
        name, _, value = arg.args.partition("=")
        defaults[name] = value
    return defaults


def env_values(stage: int) -> dict[str, str]:
    """ENV name -> value set in one stage (`ENV A=1 B=2` form)."""
    values = {}
    for env in instructions("ENV", stage):
        for name, value in re.findall(r'(\w+)=("[^"]*"|\S+)', env.args):
            values[name] = value.strip('"')
    return values


def stages() -> dict[str, tuple[int, str]]:
    """Stage name (or its index as text) -> (index, image it starts from)."""
    found = {}
    for index, from_ in enumerate(instructions("FROM")):
        parts = from_.args.split()
        name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else str(index)
        found[name] = (index, parts[0])
    return found


FINAL = len(instructions("FROM")) - 1


def copied_from(destination: str) -> Path:
    """The file in this repository that a COPY puts at `destination` in the image."""
    for copy in instructions("COPY"):
        parts = re.sub(r"^(--[a-z-]+=\S+\s+)*", "", copy.args).split()
        if parts[-1] == destination:
            assert len(parts) == 2, copy.args
            return ROOT / parts[0]
    raise AssertionError(f"no COPY puts anything at {destination}")


def on_path(command: str) -> Path:
    """The repository file behind a command that the image puts in /usr/local/bin."""
    return copied_from(f"/usr/local/bin/{command}")


def test_dockerfile_build_arg_variant_picks_base_image_and_torch_index() -> None:
    global_args = arg_defaults(-1)
    assert global_args["VARIANT"] == "cpu", "CPU must be the default build"
    all_stages = stages()
    assert {"base-cpu", "base-cuda"} <= set(all_stages)
    assert instructions("FROM")[FINAL].args == "base-${VARIANT}", "the last stage must start from base-${VARIANT}"
    for variant, index_part in (("cpu", "/whl/cpu"), ("cuda", "/whl/cu1")):
        index, image = all_stages[f"base-{variant}"]
        base_arg = re.fullmatch(r"\$\{(\w+)\}", image)
        assert base_arg and base_arg[1] in global_args, f"base-{variant} must start from a build argument"
        assert re.fullmatch(r"python:3\.11[\w.-]*", global_args[base_arg[1]]), "the service is built for Python 3.11"
        # Each base stage installs torch from its own index, a build argument: never an ENV, which
        # would stay in the image (a private mirror's credentials in every container).
        (torch_install,) = [r for r in instructions("RUN", index) if "torch==" in r.args]
        assert "torch==${TORCH_VERSION}" in torch_install.args
        arg = re.search(r'--index-url "\$\{(\w+)\}"', torch_install.args)
        assert arg and index_part in arg_defaults(index)[arg[1]], (variant, torch_install.args)
        assert not [name for name in env_values(index) if "INDEX" in name], f"base-{variant} keeps an index in ENV"
    assert not [r for r in instructions("RUN", FINAL) if "torch==" in r.args], "torch comes with the base stage"


def test_dockerfile_pins_a_torch_version_pyproject_accepts() -> None:
    from packaging.requirements import Requirement

    version = arg_defaults(-1)["TORCH_VERSION"]
    (torch,) = [Requirement(r) for r in PYPROJECT["project"]["dependencies"] if Requirement(r).name == "torch"]
    assert torch.specifier.contains(version), (version, str(torch.specifier))


def test_dockerfile_installs_dependencies_in_a_layer_before_the_code() -> None:
    final = [i for i in DOCKERFILE if i.stage == FINAL]
    position = {id(i): n for n, i in enumerate(final)}
    copies = [i for i in final if i.keyword == "COPY"]
    first_copy = copies[0]
    assert first_copy.args.split()[0] == "pyproject.toml", "pyproject.toml alone must be copied first"
    deps = [i for i in final if i.keyword == "RUN" and "pip install -r" in i.args]
    assert len(deps) == 1 and "pyproject.toml" in deps[0].args and "dependencies" in deps[0].args
    code_copies = [c for c in copies if c.args.split()[0].rstrip("/") in ("app", "ffn_core", "ffn_client")]
    assert {c.args.split()[0].rstrip("/") for c in code_copies} == {"app", "ffn_core", "ffn_client"}
    assert position[id(first_copy)] < position[id(deps[0])] < min(position[id(c)] for c in code_copies)
    install = [i for i in final if i.keyword == "RUN" and re.search(r"pip install .*--no-deps.* \.(\s|$)", i.args)]
    assert len(install) == 1, "the project itself must be installed without touching the dependencies"
    assert position[id(install[0])] > max(position[id(c)] for c in code_copies)


def test_dockerfile_runs_as_a_non_root_user_the_manifests_name() -> None:
    users = instructions("USER", FINAL)
    assert users, "no USER: the server would run as root"
    user = users[-1].args
    uid, _, gid = user.partition(":")
    assert uid not in ("root", "0") and gid not in ("root", "0")
    assert uid.isdigit(), "a numeric UID lets Kubernetes check runAsNonRoot"
    created = [r for r in instructions("RUN", FINAL) if "useradd" in r.args]
    assert created and f"--uid {uid}" in created[0].args
    entry = instructions("ENTRYPOINT")[-1]
    assert DOCKERFILE.index(users[-1]) < DOCKERFILE.index(entry)
    for manifest in (K8S / "deployment.yaml", K8S / "gpu" / "deployment.yaml"):
        security = yaml.safe_load(manifest.read_text())["spec"]["template"]["spec"]["securityContext"]
        assert security["runAsNonRoot"] is True and str(security["runAsUser"]) == uid


def test_dockerfile_entry_is_exec_form_and_runs_a_console_script() -> None:
    (entrypoint,) = instructions("ENTRYPOINT")
    (cmd,) = instructions("CMD")
    entry = entrypoint.exec_form()
    command = cmd.exec_form()
    assert entry and command, "shell form would put /bin/sh at PID 1, and SIGTERM would not reach the server"
    assert command[0] in CONSOLE_SCRIPTS and command[0] == "ffn-serve"
    script = on_path(entry[0]).read_text()
    assert script.startswith("#!/bin/sh")
    assert re.search(r'^exec "\$@"$', script, re.M), "the entry script must exec its command"
    assert re.search(r"set -- ffn-serve ", script), "flags alone must go to ffn-serve"


def test_dockerfile_healthcheck_probes_readiness_on_the_service_port() -> None:
    (healthcheck,) = instructions("HEALTHCHECK")
    command = healthcheck.exec_form()
    assert command, "HEALTHCHECK CMD in exec form"
    source = on_path(command[0]).read_text()
    assert f'READY_PATH = "{READY_PATH}"' in source
    assert f"DEFAULT_PORT = {SERVICE_PORT}" in source, "the check's default port must be the service's"
    assert "FFN_PORT" in source, "the check must follow FFN_PORT"
    (expose,) = instructions("EXPOSE")
    assert expose.args == f"{SERVICE_PORT} {Settings.model_fields['grpc_port'].default}"  # HTTP, gRPC
    flags = healthcheck.flags()
    assert {"interval", "timeout", "start-period", "retries"} <= set(flags)
    timeout_s = float(flags["timeout"].rstrip("s"))
    assert float(re.search(r"TIMEOUT_S = ([\d.]+)", source)[1]) < timeout_s


def test_dockerfile_sets_ffn_host_to_all_interfaces_inside_the_container_only() -> None:
    env = env_values(FINAL)
    assert env["FFN_HOST"] == "0.0.0.0"
    assert Settings.model_fields["host"].default == "127.0.0.1", "outside a container the default stays loopback"
    for name in env:
        if name.startswith("FFN_"):
            assert setting_name(name), f"{name} is no setting"
    assert "FFN_PORT" not in env, "FFN_PORT in the image would override a config file's port"
    assert env["MODELS_DIR"] == "/models"


def test_dockerignore_keeps_what_the_dockerfile_copies_and_drops_the_rest() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]

    def excluded(path: str) -> bool:
        # Docker: the last pattern that matches the path, or one of its parents, wins.
        result = False
        parts = path.split("/")
        for pattern in patterns:
            negate = pattern.startswith("!")
            pattern = pattern.lstrip("!").rstrip("/")
            candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
            if pattern.startswith("**/"):
                candidates += ["/".join(parts[n:]) for n in range(len(parts))]
                pattern = pattern[3:]
            if any(fnmatch(c, pattern) and c.count("/") == pattern.count("/") for c in candidates):
                result = not negate
        return result

    for copy in instructions("COPY"):
        source = re.sub(r"^(--[a-z-]+=\S+\s+)*", "", copy.args).split()[0]
        assert not excluded(source), f"{source} is copied but .dockerignore leaves it out"
        if (ROOT / source).is_dir():
            for f in (ROOT / source).rglob("*.py"):
                if "__pycache__" not in f.parts:
                    assert not excluded(str(f.relative_to(ROOT))), f
    for left_out in (
        ".git/HEAD",
        ".venv/bin/python",
        "tests/test_deploy.py",
        "deploy/models/weights.safetensors",
        "app/__pycache__/main.cpython-311.pyc",
        "docker-compose.yml",
    ):
        assert excluded(left_out), left_out


def test_dockerfile_passes_hadolint_where_installed() -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed")
    result = subprocess.run([hadolint, "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# --- the container's scripts, run as the image runs them ---------------------------------------


@contextmanager
def http_server(status: int) -> Iterator[tuple[int, list[str]]]:
    """A server on 127.0.0.1 answering every GET with `status`; yields its port and the paths asked."""
    paths: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            paths.append(self.path)
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], paths
    finally:
        server.shutdown()
        server.server_close()


def run_healthcheck(env: dict[str, str]) -> int:
    script = on_path(instructions("HEALTHCHECK")[0].exec_form()[0])
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FFN_") and k != "MODELS_DIR"}
    # A proxy in the environment must not carry the loopback probe.
    clean.update({"HTTP_PROXY": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9"})
    return subprocess.run(
        [sys.executable, str(script)], env={**clean, **env}, capture_output=True, timeout=30
    ).returncode


def test_healthcheck_script_passes_only_when_ready(tmp_path: Path) -> None:
    with http_server(200) as (port, paths):
        assert run_healthcheck({"FFN_PORT": str(port), "MODELS_DIR": str(tmp_path)}) == 0
        assert paths == [READY_PATH]
    with http_server(503) as (port, _):
        assert run_healthcheck({"FFN_PORT": str(port), "MODELS_DIR": str(tmp_path)}) == 1
    assert run_healthcheck({"FFN_PORT": str(free_port()), "MODELS_DIR": str(tmp_path)}) == 1


def test_healthcheck_script_finds_the_port_in_the_mounted_config(tmp_path: Path) -> None:
    with http_server(200) as (port, paths):
        (tmp_path / "config.toml").write_text(f"port = {port}\n")
        assert run_healthcheck({"MODELS_DIR": str(tmp_path)}) == 0
        other = tmp_path / "other.toml"
        other.write_text(f"port = {port}\n")
        (tmp_path / "config.toml").write_text("port = 1\n")
        assert run_healthcheck({"MODELS_DIR": str(tmp_path), "FFN_CONFIG": str(other)}) == 0
        assert len(paths) == 2


def run_entrypoint(tmp_path: Path, args: list[str], env: dict[str, str]) -> dict[str, Any]:
    """Run the entry script with stub console scripts on PATH; what the stub saw."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in CONSOLE_SCRIPTS:
        stub = bin_dir / name
        stub.write_text(
            f"#!{sys.executable}\n"
            "import json, os, sys\n"
            f"print(json.dumps({{'command': {name!r}, 'args': sys.argv[1:], 'pid': os.getpid(),"
            " 'config': os.environ.get('FFN_CONFIG')}))\n"
        )
        stub.chmod(0o755)
    entry = on_path(instructions("ENTRYPOINT")[0].exec_form()[0])
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FFN_")}
    process = subprocess.Popen(
        ["/bin/sh", str(entry), *args],
        env={**clean, "PATH": f"{bin_dir}:{clean['PATH']}", **env},
        stdout=subprocess.PIPE,
        text=True,
    )
    out, _ = process.communicate(timeout=30)
    assert process.returncode == 0
    seen = json.loads(out)
    seen["same_pid"] = seen["pid"] == process.pid
    return seen


def test_entrypoint_serves_demo_without_a_config_and_the_mounted_config_with_one(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    cmd = instructions("CMD")[0].exec_form()
    seen = run_entrypoint(tmp_path, cmd, {"MODELS_DIR": str(models)})
    assert seen["command"] == "ffn-serve" and seen["args"] == [] and seen["config"] is None
    assert seen["same_pid"], "the entry script must exec: the server has to be the process that gets SIGTERM"

    (models / "config.toml").write_text("")
    seen = run_entrypoint(tmp_path, cmd, {"MODELS_DIR": str(models)})
    assert seen["config"] == str(models / "config.toml")

    seen = run_entrypoint(tmp_path, cmd, {"MODELS_DIR": str(models), "FFN_CONFIG": "/elsewhere.toml"})
    assert seen["config"] == "/elsewhere.toml", "an explicit FFN_CONFIG wins"


def test_entrypoint_passes_flags_to_ffn_serve_and_runs_other_commands(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    seen = run_entrypoint(tmp_path, ["--port", "9000"], {"MODELS_DIR": str(models)})
    assert seen["command"] == "ffn-serve" and seen["args"] == ["--port", "9000"] and seen["same_pid"]
    seen = run_entrypoint(tmp_path, ["ffn-loadtest", "--duration", "1"], {"MODELS_DIR": str(models)})
    assert seen["command"] == "ffn-loadtest" and seen["args"] == ["--duration", "1"]


def test_entrypoint_starts_the_real_server_which_gets_ready_and_drains_on_sigterm(tmp_path: Path) -> None:
    """The container's start and stop, without the container: entry script, health check, SIGTERM."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    serve = bin_dir / "ffn-serve"
    serve.write_text(
        f'#!/bin/sh\nexec "{sys.executable}" -c "import sys; from app.cli import main; sys.exit(main())" "$@"\n'
    )
    serve.chmod(0o755)
    port = free_port()
    entry = on_path(instructions("ENTRYPOINT")[0].exec_form()[0])
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FFN_")}
    models = tmp_path / "models"
    models.mkdir()
    env = {
        **clean,
        "PATH": f"{bin_dir}:{clean['PATH']}",
        "PYTHONPATH": str(ROOT),
        "MODELS_DIR": str(models),  # empty: the built-in demo model
        "FFN_HOST": "127.0.0.1",  # the image says 0.0.0.0; a test stays on loopback
        "FFN_PORT": str(port),
        "FFN_GRPC_PORT": "0",  # any free port: 8001 may be taken on a shared machine
        "FFN_TORCH_THREADS": "1",
    }
    log = tmp_path / "server.log"
    with log.open("wb") as out:  # a file, not a pipe nobody reads while the server runs
        process = subprocess.Popen(
            ["/bin/sh", str(entry), "ffn-serve"], env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 180
        while run_healthcheck({"FFN_PORT": str(port), "MODELS_DIR": str(models)}) != 0:
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "not ready within 180 s"
            time.sleep(0.5)
        process.send_signal(signal.SIGTERM)  # what `docker stop` sends to PID 1
        process.wait(timeout=DRAIN_TIMEOUT_S + 10)
        assert process.returncode == 0, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


# --- docker compose ------------------------------------------------------------------------


def load_yaml(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


class ComposeLoader(yaml.SafeLoader):
    """PyYAML's safe loader, reading Compose's `!reset` tag as the plain value it tags."""


ComposeLoader.add_constructor("!reset", lambda loader, node: loader.construct_sequence(node))  # type: ignore[arg-type]


COMPOSE = load_yaml(ROOT / "docker-compose.yml")
COMPOSE_GPU = load_yaml(DEPLOY / "compose.gpu.yml")
COMPOSE_LB = yaml.load((DEPLOY / "compose.lb.yml").read_text(), Loader=ComposeLoader)
SERVICES = COMPOSE["services"]
SERVER = SERVICES["ffn"]


def duration_s(text: str) -> float:
    """A compose duration such as 30s, 1m30s or 2m."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, text
    return sum(float(n) * units[u] for n, u in parts)


def container_port(service: dict[str, Any]) -> int:
    """The port of a service's first mapping: its HTTP port (the server's second is gRPC's, 8001)."""
    mapping = service["ports"][0]
    return int(str(mapping).rsplit(":", 1)[1])


def test_compose_passes_only_real_settings_and_lets_the_config_file_apply() -> None:
    env = SERVER["environment"]
    assert isinstance(env, list), "a list of names: each is passed on only when set"
    for item in env:
        name, _, value = item.partition("=")
        if name == "FFN_METRICS_PORT":  # fixed, like the port: what the file exposes to a scraper
            assert SERVER["expose"] == [value], "the metrics port is exposed on the compose network"
            continue
        assert "=" not in item, f"{item}: a value here would override the mounted config.toml"
        assert setting_name(item), f"{item} is not an FFN_<setting>"
    passed = {setting_name(item) for item in env}
    assert not passed & {"host", "port", "config"}, "host, port and config are the image's, not the shell's"
    for service in SERVICES.values():
        for item in service.get("environment", []):
            assert not item.startswith("FFN_") or setting_name(item.split("=")[0]), item


def test_compose_health_check_is_the_images_on_the_service_port() -> None:
    healthcheck = SERVER["healthcheck"]
    assert healthcheck["test"] == ["CMD", *instructions("HEALTHCHECK")[0].exec_form()]
    assert container_port(SERVER) == SERVICE_PORT
    assert duration_s(healthcheck["start_period"]) >= 60, "leave time to load and warm the models"


def test_compose_stop_grace_period_outlasts_the_drain() -> None:
    assert duration_s(SERVER["stop_grace_period"]) > DRAIN_TIMEOUT_S
    assert SERVER["restart"] in ("always", "unless-stopped", "on-failure")


def test_compose_mounts_every_volume_read_only() -> None:
    for name, service in SERVICES.items():
        for volume in service.get("volumes", []):
            if isinstance(volume, str):
                assert volume.endswith(":ro"), (name, volume)
            else:
                assert volume["read_only"] is True, (name, volume)
    (models,) = SERVER["volumes"]
    assert models["target"] == env_values(FINAL)["MODELS_DIR"]


def test_compose_builds_cpu_by_default_and_reserves_gpus_in_the_override() -> None:
    assert SERVER["build"]["args"]["VARIANT"] == "cpu"
    assert "deploy" not in SERVER, "the default must run on a machine without a GPU"
    gpu = COMPOSE_GPU["services"]["ffn"]
    assert gpu["build"]["args"]["VARIANT"] == "cuda"
    assert gpu["image"].endswith(":cuda")
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert "count" in device or "device_ids" in device
    variants = {name.removeprefix("base-") for name in stages() if name.startswith("base-")}
    for service in [*SERVICES.values(), *COMPOSE_GPU["services"].values()]:
        if "build" in service:
            assert service["build"]["args"]["VARIANT"] in variants


def test_compose_loadtest_runs_the_console_script_once_the_service_is_healthy() -> None:
    loadtest = SERVICES["loadtest"]
    assert loadtest["profiles"] == ["loadtest"]
    assert loadtest["depends_on"]["ffn"]["condition"] == "service_healthy"
    assert loadtest["command"][0] in CONSOLE_SCRIPTS and loadtest["command"][0] == "ffn-loadtest"
    url = loadtest["command"][loadtest["command"].index("--url") + 1]
    assert re.fullmatch(rf"\$\{{LOADTEST_URL:-http://ffn:{SERVICE_PORT}\}}", url)
    assert loadtest["healthcheck"] == {"disable": True}
    # Its own image: the Dockerfile's torch-free `loadtest` stage, from the service's build context.
    assert loadtest["build"] == {**SERVER["build"], "target": "loadtest"} and loadtest["image"] != SERVER["image"]
    assert "loadtest" in stages()


def test_compose_loadtest_flags_are_ones_ffn_loadtest_accepts() -> None:
    code = "import sys; sys.argv[0] = 'ffn-loadtest'; from ffn_client.loadtest import main; sys.exit(main())"
    result = subprocess.run(
        [sys.executable, "-c", code, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert result.returncode == 0, result.stderr
    for flag in (a for a in SERVICES["loadtest"]["command"] if a.startswith("--")):
        assert flag in result.stdout, f"ffn-loadtest --help does not list {flag}"


def test_compose_load_balancer_profile_fronts_the_replicas() -> None:
    lb = COMPOSE_LB["services"]["lb"]
    assert lb["depends_on"]["ffn"]["condition"] == "service_healthy"
    assert READY_PATH in " ".join(lb["healthcheck"]["test"])
    conf = (DEPLOY / "nginx" / "ffn.conf").read_text()
    assert re.search(rf"^\s*proxy_pass http://\$replicas:{SERVICE_PORT};", conf, re.M), "every `ffn` replica"
    assert re.search(r"^\s*set \$replicas ffn;", conf, re.M)
    assert re.search(rf"^\s*listen {container_port(lb)};", conf, re.M)
    (conf_mount,) = lb["volumes"]
    assert (ROOT / conf_mount["source"]).is_file()
    body = re.search(r"client_max_body_size (\d+)m;", conf)
    assert body and int(body[1]) * 2**20 == Settings.model_fields["max_body_bytes"].default
    assert "non_idempotent" in conf and "http_503" in conf
    # One replica alone is published on PUBLISH (and gRPC on GRPC_PUBLISH); behind the balancer,
    # replicas publish nothing.
    assert SERVER["ports"] == ["${PUBLISH:-127.0.0.1:8000}:8000", "${GRPC_PUBLISH:-127.0.0.1:8001}:8001"]
    assert COMPOSE_LB["services"]["ffn"] == {"ports": []}  # `!reset []`, read by PyYAML as a plain list


@pytest.mark.parametrize(
    "files",
    [
        ["docker-compose.yml"],
        ["docker-compose.yml", "deploy/compose.gpu.yml"],
        ["docker-compose.yml", "deploy/compose.lb.yml"],
    ],
)
def test_compose_config_is_valid_for_docker_compose_itself(files: list[str]) -> None:
    from deploy.docker_tools import compose_v2

    command, why = compose_v2()
    if command is None:  # v1 refuses the file's top-level `name:` and has no `config --format json`
        pytest.skip(why)
    args = [*command, "--project-directory", str(ROOT)]
    for f in files:
        args += ["-f", str(ROOT / f)]
    args += ["--profile", "loadtest", "config", "--format", "json"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FFN_", "COMPOSE_"))}
    result = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    resolved = json.loads(result.stdout)["services"]
    assert set(resolved) == {"ffn", "loadtest"} | ({"lb"} if "deploy/compose.lb.yml" in files else set())
    # Unset in the shell: nothing passed on, but what the files themselves give a value to
    # (the metrics port; the GPU override's FFN_WORKERS default).
    fixed = {
        e.split("=")[0]
        for f in files
        for e in yaml.load((ROOT / f).read_text(), Loader=ComposeLoader)["services"]["ffn"].get("environment", [])
        if "=" in e
    }
    passed = {k: v for k, v in resolved["ffn"]["environment"].items() if k not in fixed}
    assert all(value is None for value in passed.values()), "unset: nothing overridden"
    assert resolved["ffn"]["volumes"][0]["read_only"] is True


def test_nginx_config_is_accepted_by_nginx_where_installed(tmp_path: Path) -> None:
    """Syntax only, with a local nginx, on the file as it is (the `ffn` name is looked up per request)."""
    nginx = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.path.exists(p)), None)
    if nginx is None:
        pytest.skip("nginx is not installed")
    conf = (DEPLOY / "nginx" / "ffn.conf").read_text()
    (tmp_path / "ffn.conf").write_text(conf)
    (tmp_path / "nginx.conf").write_text(
        f"pid {tmp_path}/nginx.pid;\nerror_log stderr;\nevents {{}}\n"
        f"http {{ access_log off; client_body_temp_path {tmp_path}; proxy_temp_path {tmp_path};"
        f" include {tmp_path}/ffn.conf; }}\n"
    )
    result = subprocess.run(
        [nginx, "-t", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


# --- Kubernetes ----------------------------------------------------------------------------


def manifests() -> list[tuple[Path, dict[str, Any]]]:
    found = []
    for path in sorted(K8S.rglob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                found.append((path, document))
    return found


def deployments() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p, d in manifests() if d["kind"] == "Deployment"]


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def resolve_port(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    (found,) = [p["containerPort"] for p in container["ports"] if p.get("name") == port]
    return found


def test_kubernetes_manifests_validate_against_the_kubernetes_schemas() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    core = [(p, d) for p, d in manifests() if not d["apiVersion"].startswith("serving.kserve.io/")]
    assert {d["kind"] for _, d in core} == {
        "Namespace",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "NetworkPolicy",
    }
    for path, document in core:
        for version in ("1.28.0", kubernetes_validate.latest_version()):
            try:
                kubernetes_validate.validate(document, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                where = ".".join(str(p) for p in exc.path)
                pytest.fail(f"{path.relative_to(ROOT)} (Kubernetes {version}) at {where}: {exc.message}")


def test_kubernetes_probes_hit_health_paths_on_the_served_port() -> None:
    pod_specs = [(p, d["spec"]["template"]["spec"]) for p, d in deployments()]
    kserve = [(p, d["spec"]["predictor"]) for p, d in manifests() if d["kind"] == "InferenceService"]
    assert len(pod_specs) == 2 and len(kserve) == 1
    for path, pod in pod_specs + kserve:
        (container,) = pod["containers"]
        port = int(env_of(container).get("FFN_PORT", SERVICE_PORT))
        assert container["ports"][0]["containerPort"] == port, path
        # The metrics port, where a Deployment names one, is the server's (FFN_METRICS_PORT), and
        # the one the Prometheus annotations point at: it needs no API key.
        named = {p.get("name"): p["containerPort"] for p in container["ports"][1:]}
        assert set(named) <= {"metrics", "grpc", "h2c"}, path  # h2c: how KServe names a gRPC port
        for name in {"grpc", "h2c"} & set(named):
            assert named[name] == int(env_of(container)["FFN_GRPC_PORT"]), path
        metrics_port = env_of(container).get("FFN_METRICS_PORT")
        if "metrics" in named:
            assert named["metrics"] == int(metrics_port or -1), path
        if path.parent.name != "kserve":
            annotations = next(d for p, d in deployments() if p == path)["spec"]["template"]["metadata"]["annotations"]
            assert annotations["prometheus.io/port"] == metrics_port, path
        assert container["readinessProbe"]["httpGet"]["path"] == READY_PATH, path
        assert container["livenessProbe"]["httpGet"]["path"] == LIVE_PATH, path
        # The server loads its weights before it listens: the liveness probe must wait for that.
        startup = container["startupProbe"]
        assert startup["httpGet"]["path"] == LIVE_PATH, path
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 120, path
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            assert resolve_port(container, container[probe]["httpGet"]["port"]) == port, (path, probe)


def test_kubernetes_grace_period_outlasts_prestop_and_drain() -> None:
    for path, pod in [(p, d["spec"]["template"]["spec"]) for p, d in deployments()] + [
        (p, d["spec"]["predictor"]) for p, d in manifests() if d["kind"] == "InferenceService"
    ]:
        (container,) = pod["containers"]
        drain = float(env_of(container).get("FFN_DRAIN_TIMEOUT_S", DRAIN_TIMEOUT_S))
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        sleep = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
        assert pod["terminationGracePeriodSeconds"] > drain + sleep, path


def test_kubernetes_env_sets_only_real_settings_with_valid_values(monkeypatch: pytest.MonkeyPatch) -> None:
    containers = [(p, d["spec"]["template"]["spec"]["containers"][0]) for p, d in deployments()]
    containers += [
        (p, d["spec"]["predictor"]["containers"][0]) for p, d in manifests() if d["kind"] == "InferenceService"
    ]
    for path, container in containers:
        for name in os.environ:
            if name.startswith("FFN_"):
                monkeypatch.delenv(name)
        for entry in container["env"]:
            if entry["name"].startswith("FFN_"):
                assert setting_name(entry["name"]), f"{path}: {entry['name']} is no setting"
                if "value" in entry and entry["name"] != "FFN_CONFIG":
                    monkeypatch.setenv(entry["name"], entry["value"])
        Settings()  # raises when a value does not validate
        limit = container["resources"]["limits"]["cpu"]
        workers = int(env_of(container).get("FFN_WORKERS", "1"))
        threads = int(env_of(container)["FFN_TORCH_THREADS"])
        assert workers * threads <= int(limit), f"{path}: more threads than CPUs"


def test_kubernetes_service_selects_the_pods_and_targets_their_port() -> None:
    (service,) = [d for _, d in manifests() if d["kind"] == "Service"]
    (_, cpu), (_, gpu) = sorted(deployments(), key=lambda pd: str(pd[0]))
    for deployment in (cpu, gpu):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items()
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        http, grpc = service["spec"]["ports"]
        assert resolve_port(container, http["targetPort"]) == int(env_of(container)["FFN_PORT"])
        assert resolve_port(container, grpc["targetPort"]) == int(env_of(container)["FFN_GRPC_PORT"])
        pod = deployment["spec"]["template"]["spec"]
        assert pod["enableServiceLinks"] is False, "service-link variables would start with FFN_SERVE_"
    (pdb,) = [d for _, d in manifests() if d["kind"] == "PodDisruptionBudget"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= cpu["spec"]["template"]["metadata"]["labels"].items()


def test_kubernetes_models_volume_is_read_only_at_the_images_path() -> None:
    for path, deployment in deployments():
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "models"]
        assert mount["mountPath"] == env_values(FINAL)["MODELS_DIR"] and mount["readOnly"] is True, path
        assert mount["name"] in {v["name"] for v in pod["volumes"]}


def test_kubernetes_gpu_variant_differs_from_cpu_only_in_image_resources_and_tolerations() -> None:
    cpu = load_yaml(K8S / "deployment.yaml")
    gpu = load_yaml(K8S / "gpu" / "deployment.yaml")
    gpu_pod = gpu["spec"]["template"]["spec"]
    (gpu_container,) = gpu_pod["containers"]
    assert gpu_container["image"].endswith(":cuda")
    assert gpu_container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert any(t["key"] == "nvidia.com/gpu" for t in gpu_pod["tolerations"])
    (cpu_container,) = cpu["spec"]["template"]["spec"]["containers"]
    assert cpu_container["image"].endswith(":cpu")
    assert "nvidia.com/gpu" not in cpu_container["resources"].get("limits", {})
    # More workers feed a GPU than share a CPU pod's cores (docs/deployment.md says why).
    assert int(env_of(gpu_container)["FFN_WORKERS"]) > int(env_of(cpu_container)["FFN_WORKERS"])
    for key in ("image", "resources"):
        del cpu_container[key], gpu_container[key]
    for container in (cpu_container, gpu_container):
        container["env"] = [e for e in container["env"] if e["name"] != "FFN_WORKERS"]
    del gpu_pod["tolerations"]
    assert cpu == gpu


def test_kserve_predictor_is_a_custom_container_speaking_v2() -> None:
    (isvc,) = [d for _, d in manifests() if d["kind"] == "InferenceService"]
    assert isvc["apiVersion"] == "serving.kserve.io/v1beta1"
    (container,) = isvc["spec"]["predictor"]["containers"]
    assert container["name"] == "kserve-container"
    env = env_of(container)
    assert env["FFN_CONFIG"].startswith("/mnt/models/"), "KServe's storage initializer fills /mnt/models"
    assert "STORAGE_URI" in env


# --- config example and docs ---------------------------------------------------------------


def test_config_example_parses_and_validates_as_settings() -> None:
    path = DEPLOY / "config.example.toml"
    values = read_config_file(path)
    settings = Settings(**values)
    assert settings.models, "the example shows [[models]] tables"
    for model in settings.models:
        assert model.weights is not None and model.weights.is_relative_to(DEPLOY)
    assert "host" not in values and "port" not in values, "the container decides where to listen"


def docs() -> str:
    return (ROOT / "docs" / "deployment.md").read_text()


def test_docs_settings_table_is_the_one_settings_gives() -> None:
    import runpy

    table = runpy.run_path(str(DEPLOY / "settings_table.py"))["table"]()
    found = re.search(r"<!-- settings-table:start -->\n(.*?)<!-- settings-table:end -->", docs(), re.S)
    assert found, "docs/deployment.md lacks the settings-table markers"
    assert found[1] == table, "the table is stale: paste the output of `python deploy/settings_table.py`"


def test_docs_name_only_files_that_exist() -> None:
    for name in sorted(set(re.findall(r"(?<![\w/.-])((?:deploy|docs|tests)/[\w./-]*\w)", docs()))):
        assert (ROOT / name).exists(), f"docs/deployment.md names {name}, which does not exist"
    for section in ("How these files were checked", "Kubernetes", "KServe", "docker compose"):
        assert section in docs()
