"""Build the image and run it for real on a Docker engine: the checks tests/test_docker.py runs.

    python deploy/docker_check.py                  # build, container, load balancer, compose
    python deploy/docker_check.py --no-build --json report.json

1. build: the Dockerfile (without its `# syntax=` line, which needs Docker Hub), timed; image size.
2. container: a model folder mounted read-only at /models (weights written here, 0644), healthy
   within the start period, an answer equal to numpy's; `docker stop` under load: exit code 0,
   and no request lost (each one answered 200, or refused: 503 while draining, or no connection).
3. balancer: three replicas behind nginx with deploy/nginx/ffn.conf on one network, 16 clients
   sending 3,000 requests, one replica stopped midway: 0 failed requests. nginx older than 1.27.3
   (Debian's 1.22 here) has no `resolve`: it then runs a copy without it, which resolves the
   replicas once at start, so the stopped replica's address stays in the upstream. That is the
   harder case: every request sent there must go elsewhere.
4. compose: `docker compose up --wait` of docker-compose.yml, a request, `down`; Compose v2 only
   (the file uses v2's top-level `name:`): with v1 alone, this check is skipped and says so.

Exit status: 0 every check passed (or was skipped with its reason), 1 a check failed, 3 no Docker
engine answered. Runs with the project's environment (ffn_client for the load, numpy, safetensors).
Containers, the network and the folder it makes are removed at the end; images are kept (cache).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: deploy.docker_tools and ffn_client from this checkout

from deploy.docker_tools import (  # noqa: E402
    CheckFailed,
    compose_v2,
    docker,
    docker_cli,
    engine_reachable,
    nginx_conf_for,
)
from ffn_client import Client, TransportError  # noqa: E402
from ffn_client.testing import free_port  # noqa: E402

CHECK_MODEL, D_MODEL, D_FF = "check", 32, 64  # a tiny native model, checked against numpy
LOADTEST_IMAGE = "ffn-loadtest:cpu"  # docker-compose.yml's name for the `loadtest` stage
REFUSED = {"503", "connect"}  # not lost: the server never took these requests


def write_models(folder: Path) -> dict[str, np.ndarray]:
    """A tiny native model and its config.toml in `folder`, readable by the container's user; its weights."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(7)
    d_model, d_ff = D_MODEL, D_FF
    weights = {
        "layer1.weight": rng.standard_normal((d_ff, d_model)).astype(np.float32) / np.sqrt(d_model),
        "layer1.bias": rng.standard_normal(d_ff).astype(np.float32),
        "layer2.weight": rng.standard_normal((d_model, d_ff)).astype(np.float32) / np.sqrt(d_ff),
        "layer2.bias": rng.standard_normal(d_model).astype(np.float32),
    }
    save_file(weights, str(folder / "check.safetensors"))
    (folder / "config.toml").write_text(
        f'[[models]]\nname = "{CHECK_MODEL}"\nweights = "check.safetensors"\nformat = "native"\nactivation = "relu"\n'
    )
    folder.chmod(0o755)  # mkdtemp makes 0700: UID 10001 could not enter it
    for path in folder.iterdir():
        path.chmod(0o644)
    return weights


def reference(weights: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """The FFN in float64 numpy: relu(x W1^T + b1) W2^T + b2."""
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    hidden = np.maximum(x.astype(np.float64) @ w["layer1.weight"].T + w["layer1.bias"], 0.0)
    return hidden @ w["layer2.weight"].T + w["layer2.bias"]


class Checker:
    """One run of the checks; everything it starts is named after `prefix` and removed by `cleanup`."""

    def __init__(self, image: str, nginx_image: str) -> None:
        self.image, self.nginx_image = image, nginx_image
        self.prefix = f"ffn-check-{os.getpid()}"
        self.folder = Path(tempfile.mkdtemp(prefix="ffn-check-"))
        self.weights = write_models(self.folder)
        self.containers: list[str] = []
        self.networks: list[str] = []
        self.results: dict[str, Any] = {}

    def cleanup(self) -> None:
        for name in self.containers:
            docker("rm", "-f", name, check=False)
        for network in self.networks:
            docker("network", "rm", network, check=False)
        shutil.rmtree(self.folder, ignore_errors=True)

    def build(self) -> None:
        """The server image, then the load tester's (the `loadtest` stage, which compose's loadtest runs)."""
        dockerfile = self.folder / "Dockerfile"  # beside the models, outside the build context
        dockerfile.write_text(re.sub(r"\A# syntax=.*\n", "", (ROOT / "Dockerfile").read_text()))
        args = ["build", "--network", "host", "-f", str(dockerfile)]
        if os.environ.get("DOCKER_CHECK_TORCH_INDEX"):  # a local index of CPU torch wheels
            args += ["--build-arg", f"CPU_TORCH_INDEX={os.environ['DOCKER_CHECK_TORCH_INDEX']}"]
        started = time.perf_counter()
        docker(*args, "-t", self.image, str(ROOT), timeout=3600)
        self.results["build_s"] = round(time.perf_counter() - started, 1)
        docker(*args, "--target", "loadtest", "-t", LOADTEST_IMAGE, str(ROOT), timeout=1800)
        self.results["loadtest_image_mb"] = round(
            int(docker("image", "inspect", "-f", "{{.Size}}", LOADTEST_IMAGE)) / 2**20
        )

    def run_replica(self, name: str, *options: str) -> str:
        self.containers.append(name)
        docker(
            "run", "-d", "--name", name, "--stop-timeout", "30", "-v", f"{self.folder}:/models:ro", *options, self.image
        )
        return name

    def wait_healthy(self, name: str, limit_s: float = 240) -> float:
        """Seconds until Docker's health check says healthy; CheckFailed with the logs if it never does."""
        started = time.perf_counter()
        while time.perf_counter() - started < limit_s:
            state = json.loads(docker("inspect", "-f", "{{json .State}}", name))
            if state.get("Health", {}).get("Status") == "healthy":
                return round(time.perf_counter() - started, 1)
            if not state["Running"]:
                raise CheckFailed(
                    f"{name} exited {state['ExitCode']} before healthy:\n{docker('logs', '--tail', '30', name, check=False)}"
                )
            time.sleep(0.5)
        raise CheckFailed(
            f"{name} not healthy after {limit_s:g} s:\n{docker('logs', '--tail', '30', name, check=False)}"
        )

    def stop(self, name: str) -> tuple[int, float]:
        """`docker stop` (SIGTERM, then 30 s): the exit code and the seconds it took."""
        started = time.perf_counter()
        docker("stop", "-t", "30", name, timeout=60)
        return int(docker("inspect", "-f", "{{.State.ExitCode}}", name)), round(time.perf_counter() - started, 1)

    def check_container(self) -> None:
        port = free_port()
        name = self.run_replica(
            f"{self.prefix}-one",
            "--network",
            "host",
            "-e",
            "FFN_HOST=127.0.0.1",
            "-e",
            f"FFN_PORT={port}",
            "-e",
            f"FFN_GRPC_PORT={free_port()}",  # the host's network: 8001 may be taken
        )
        self.results["image_size_mb"] = round(int(docker("image", "inspect", "-f", "{{.Size}}", self.image)) / 2**20)
        self.results["healthy_after_s"] = self.wait_healthy(name)
        url = f"http://127.0.0.1:{port}"
        x = np.random.default_rng(1).standard_normal((5, D_MODEL)).astype(np.float32)
        with Client(url) as client:
            y = client.transform(CHECK_MODEL, x, encoding="binary")
        np.testing.assert_allclose(y, reference(self.weights, x), rtol=1e-4, atol=1e-5)
        self.results["answer_matches_numpy"] = True
        report = load_while(url, lambda ok: ok >= 200, lambda: self.stop(name), concurrency=8, duration=4.0)
        exit_code, stop_s = report.pop("action")
        self.results["stop"] = {"exit_code": exit_code, "stop_s": stop_s, **report}
        lost = {k: v for k, v in report["errors"].items() if k not in REFUSED}
        if exit_code != 0 or lost or report["ok"] == 0:
            raise CheckFailed(f"docker stop under load: exit code {exit_code}, lost {lost}, {report}")

    def check_balancer(self) -> None:
        network = f"{self.prefix}-net"
        docker("network", "create", network)
        self.networks.append(network)
        replicas = [
            self.run_replica(f"{self.prefix}-r{i}", "--network", network, "--network-alias", "ffn") for i in range(3)
        ]
        for name in replicas:
            self.wait_healthy(name)
        shown = subprocess.run(
            [*docker_cli(), "run", "--rm", self.nginx_image, "nginx", "-v"], capture_output=True, text=True, timeout=120
        )  # nginx -v writes to stderr
        found = re.search(r"nginx/(\d+)\.(\d+)\.(\d+)", shown.stdout + shown.stderr)
        version = tuple(int(v) for v in found.groups()) if found else (0, 0, 0)
        conf = self.folder / "nginx.conf"
        conf.write_text(nginx_conf_for(version))
        conf.chmod(0o644)
        port = free_port()
        self.containers.append(f"{self.prefix}-lb")
        docker(
            "run",
            "-d",
            "--name",
            f"{self.prefix}-lb",
            "--network",
            network,
            "-p",
            f"127.0.0.1:{port}:8080",
            "-v",
            f"{conf}:/etc/nginx/conf.d/default.conf:ro",
            self.nginx_image,
        )
        url = f"http://127.0.0.1:{port}"
        wait_ready(url)
        report = load_while(url, lambda ok: ok >= 1000, lambda: self.stop(replicas[1]), concurrency=16, requests=3000)
        exit_code, stop_s = report.pop("action")
        self.results["balancer"] = {
            "nginx": ".".join(map(str, version)),
            "resolve": version >= (1, 27, 3),
            "replica_exit_code": exit_code,
            "stop_s": stop_s,
            **report,
        }
        if report["errors"] or exit_code != 0 or report["sent"] != 3000:
            raise CheckFailed(f"scale-down behind nginx: {self.results['balancer']}")

    def check_compose(self) -> None:
        command, why = compose_v2()
        if command is None:
            self.results["compose"] = {"skipped": why}
            return
        project, port = f"{self.prefix}-compose", free_port()
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("FFN_", "COMPOSE_"))},
            "PUBLISH": f"127.0.0.1:{port}",
            "MODELS_DIR": str(self.folder),
        }
        base = [*command, "--project-directory", str(ROOT), "-f", str(ROOT / "docker-compose.yml"), "-p", project]

        def compose(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([*base, *args], capture_output=True, text=True, env=env, timeout=600)

        if not docker("images", "-q", LOADTEST_IMAGE):
            raise CheckFailed(f"no {LOADTEST_IMAGE} image: run without --no-build once")

        try:
            started = time.perf_counter()
            up = compose("up", "-d", "--no-build", "--wait")
            if up.returncode != 0:
                raise CheckFailed(f"{why}: docker compose up --wait exited {up.returncode}: {up.stderr[-2000:]}")
            healthy_s = round(time.perf_counter() - started, 1)
            x = np.ones((2, D_MODEL), np.float32)
            with Client(f"http://127.0.0.1:{port}") as client:
                np.testing.assert_allclose(
                    client.transform(CHECK_MODEL, x), reference(self.weights, x), rtol=1e-4, atol=1e-5
                )
            load = compose(
                "--profile",
                "loadtest",
                "run",
                "--rm",
                "--no-deps",
                "loadtest",
                "ffn-loadtest",
                "--url",
                "http://ffn:8000",
                "--model",
                CHECK_MODEL,
                "-n",
                "200",
                "-q",
                "--json",
                "-",
            )
            if load.returncode != 0:
                raise CheckFailed(
                    f"compose's loadtest exited {load.returncode}: {load.stdout[-1000:]} {load.stderr[-1000:]}"
                )
            counts = json.loads(load.stdout)["counts"]
            containers = compose("ps", "-q", "ffn").stdout.split()
            stop = compose("stop")
            codes = [int(docker("inspect", "-f", "{{.State.ExitCode}}", c)) for c in containers]
            self.results["compose"] = {
                "version": why,
                "healthy_after_s": healthy_s,
                "loadtest": counts,
                "exit_codes": codes,
            }
            if stop.returncode != 0 or codes != [0] * len(containers) or counts["ok"] != 200:
                raise CheckFailed(
                    f"compose stop exited {stop.returncode}: {stop.stderr[-2000:]}; {self.results['compose']}"
                )
        finally:
            compose("down", "--remove-orphans")


def wait_ready(url: str, limit_s: float = 60) -> None:
    """The client's own readiness wait, its failure a CheckFailed."""
    with Client(url, timeout=2.0, max_retries=0) as client:
        try:
            client.wait_ready(limit_s, interval=0.5)
        except TransportError as exc:
            raise CheckFailed(f"{url}/v2/health/ready did not answer 200 within {limit_s:g} s") from exc


def load_while(url: str, when: Callable[[int], bool], action: Callable[[], Any], **bounds: Any) -> dict[str, Any]:
    """Closed-loop load on `url`; once `when(ok so far)` holds, `action` runs in a thread. The counts, and its result."""
    from ffn_client.load import LoadConfig, Progress, run_load

    done: dict[str, Any] = {}
    thread: threading.Thread | None = None

    def progress(p: Progress) -> None:
        nonlocal thread
        if thread is None and when(p.ok):
            thread = threading.Thread(target=lambda: done.setdefault("action", action()), daemon=True)
            thread.start()

    config = LoadConfig(url=url, model=CHECK_MODEL, d_model=D_MODEL, rows=(4, 4), metrics_url="", timeout=60, **bounds)
    report = asyncio.run(run_load(config, progress))
    if thread is None:
        raise CheckFailed(f"the load ended before its action was due: {report.to_dict()['counts']}")
    thread.join(90)
    if "action" not in done:
        raise CheckFailed("the action during the load did not finish")
    return {
        "sent": report.sent,
        "ok": report.ok,
        "errors": report.errors,
        "causes": report.error_causes,
        "p99_ms": round(report.latency_ms["p99"], 1),
        "action": done["action"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deploy/docker_check.py", description=__doc__.split("\n")[0])
    parser.add_argument("--image", default="ffn-serve:cpu")
    parser.add_argument("--nginx-image", default="nginx:1.28-alpine")
    parser.add_argument("--no-build", action="store_true", help="use the image as it is")
    parser.add_argument(
        "--checks",
        default="container,balancer,compose",
        help="which checks after the build, comma-separated (default %(default)s)",
    )
    parser.add_argument("--json", metavar="FILE", help="write what was seen as JSON")
    args = parser.parse_args(argv)
    why = engine_reachable()
    if why:
        print(f"docker_check: {why}", file=sys.stderr)
        return 3
    checker = Checker(args.image, args.nginx_image)
    failed = None
    steps = ([] if args.no_build else [checker.build]) + [
        getattr(checker, f"check_{name}") for name in args.checks.split(",")
    ]
    try:
        for step in steps:
            print(f"docker_check: {step.__name__} ...", file=sys.stderr, flush=True)
            started = time.perf_counter()
            step()
            checker.results.setdefault("seconds", {})[step.__name__] = round(time.perf_counter() - started, 1)
    except (CheckFailed, AssertionError) as exc:
        failed = f"{step.__name__}: {exc}"
        checker.results["failed"] = failed
    finally:
        checker.cleanup()
    text = json.dumps(checker.results, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    if failed:
        print(f"docker_check: FAILED {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
