"""Build the image and run it for real on a Docker engine: the checks tests/test_docker.py runs.

    python deploy/docker_check.py                  # build, then every check
    python deploy/docker_check.py --no-build --checks balancer --json report.json

1. build: the Dockerfile (without its `# syntax=` line, which needs Docker Hub), both images; the
   image's environment holds no torch index (a build argument), its history is looked at.
2. models: the entry script stops the start (exit 2, a message) on a model folder the container
   user cannot read and on one holding files but no config.toml; a folder with only a README
   serves `demo`.
3. container: a model folder mounted read-only (weights written here, 0644), `--check` exit 0,
   healthy, an answer equal to numpy's carrying the model's digest, the documented `ffn-loadtest`
   command (the load-test image); `docker stop` under load on the host network: exit 0, and every
   request written answered (200 or 503: none lost).
3b. published: the same stop on a port published with `-p` (Docker's proxy in front), counted the
   same way: what the proxy does to new connections while the container stops.
4. read_only: `--read-only` with 2 workers: without a writable folder, one line and exit 2; with a
   tmpfs at /tmp, or at FFN_METRICS_DIR, healthy, answers, merged metrics, exit 0.
5. compose: docker-compose.yml as shipped (read-only root, tmpfs), `up --wait`, an answer, its
   `loadtest` service, exit codes 0; the GPU override keeps the load tester's image apart.
6. balancer: docker-compose.yml with deploy/compose.lb.yml as shipped, 3 replicas of 2 workers,
   none published on the host; keep-alive clients through nginx while one replica is stopped
   (a drain), one killed, one's worker crashes, every replica restarted one at a time (the
   rolling restart docs/deployment.md gives), and new weights rolled out (the file replaced,
   SIGHUP to every replica through compose): every request answered 200, none lost, and every
   replica reports the new digest. Then the documented load test through the balancer, after
   which 3 replicas still run; then `compose down` under load, its losses counted.
7. start_interval: deploy/compose.start-interval.yml on this engine (refused before Docker 25).

Every load here counts requests without retrying (deploy/docker_load.py): a retry hides a loss.
Exit status: 0 every check passed (or was skipped with its reason), 1 a check failed, 3 no Docker
engine answered. Runs with the project's environment (ffn_client for the load, numpy, safetensors).
Containers, networks and the folders it makes are removed at the end; images are kept (cache).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: deploy.*, ffn_client and ffn_testing from this checkout

from deploy.docker_load import load_during, transform_request  # noqa: E402
from deploy.docker_tools import (  # noqa: E402
    CheckFailed,
    compose_v2,
    docker,
    docker_cli,
    engine_reachable,
    engine_version,
    exit_code,
    logs,
    wait_exited,
    wait_healthy,
)
from ffn_client import Client, TransportError  # noqa: E402
from ffn_client.losses import Fates  # noqa: E402
from ffn_testing import free_port, metric_value  # noqa: E402

CHECK_MODEL, D_MODEL, D_FF = "check", 32, 64  # a tiny native model, checked against numpy
OCI_LABELS = ("title", "description", "version", "revision", "licenses")
LOADTEST_IMAGE = "ffn-loadtest:cpu"  # docker-compose.yml's name for the `loadtest` stage
# Creating or removing a container copies or deletes the whole image with the vfs storage driver:
# minutes on a busy machine (docker run -d once took over 120 s here).
SLOW_S = 900
COMPOSE_FILES = {
    "base": ["docker-compose.yml"],
    "lb": ["docker-compose.yml", "deploy/compose.lb.yml"],
    "gpu": ["docker-compose.yml", "deploy/compose.gpu.yml"],
    "start_interval": ["docker-compose.yml", "deploy/compose.start-interval.yml"],
}


def write_models(folder: Path, seed: int = 7) -> dict[str, np.ndarray]:
    """A tiny native model and its config.toml in `folder`, readable by the container's user; its weights.

    The weights file is replaced in one step (written beside, then renamed over), as an operator rolls
    out new weights under a running server."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    weights = {
        "layer1.weight": rng.standard_normal((D_FF, D_MODEL)).astype(np.float32) / np.sqrt(D_MODEL),
        "layer1.bias": rng.standard_normal(D_FF).astype(np.float32),
        "layer2.weight": rng.standard_normal((D_MODEL, D_FF)).astype(np.float32) / np.sqrt(D_FF),
        "layer2.bias": rng.standard_normal(D_MODEL).astype(np.float32),
    }
    save_file(weights, str(folder / ".check.safetensors.new"))
    os.replace(folder / ".check.safetensors.new", folder / "check.safetensors")
    (folder / "config.toml").write_text(
        f'[[models]]\nname = "{CHECK_MODEL}"\nweights = "check.safetensors"\nformat = "native"\nactivation = "relu"\n'
    )
    share(folder)
    return weights


def share(folder: Path) -> None:
    """Make `folder` readable by the container's user (mkdtemp makes 0700: UID 10001 could not enter it)."""
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def file_digest(folder: Path) -> str:
    """The digest a server reports for the check model in `folder` (ffn_core/digest.py's construction)."""
    from app.config.settings import ModelSpec
    from app.engine.registry import model_digest, read_weights

    spec = ModelSpec(name=CHECK_MODEL, weights=folder / "check.safetensors", activation="relu")
    return model_digest(spec, read_weights(spec))


def replica_digest(container: str) -> str:
    """The check model's digest as a replica reports it (GET /v1/models inside the container: no curl there)."""
    code = (
        "import json, urllib.request; "
        "print(json.load(urllib.request.urlopen('http://127.0.0.1:8000/v1/models'))['models'][0]['digest'])"
    )
    return docker("exec", container, "python", "-c", code)


def reference(weights: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """The FFN in float64 numpy: relu(x W1^T + b1) W2^T + b2."""
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    hidden = np.maximum(x.astype(np.float64) @ w["layer1.weight"].T + w["layer1.bias"], 0.0)
    return hidden @ w["layer2.weight"].T + w["layer2.bias"]


def no_loss(what: str, fates: Fates, allowed: set[int]) -> dict[str, object]:
    """The fates as reported; CheckFailed if a request was lost or answered outside `allowed`."""
    seen = fates.to_dict()
    if fates.lost or not set(fates.answered) <= allowed or not fates.answered[200]:
        raise CheckFailed(f"{what}: {seen}")
    if fates.closing[503] != fates.answered[503]:
        raise CheckFailed(f"{what}: a 503 kept its connection open: {seen}")
    return seen


class Checker:
    """One run of the checks; everything it starts is named after `prefix` and removed by `cleanup`."""

    def __init__(self, image: str) -> None:
        self.image = image
        self.prefix = f"ffn-check-{os.getpid()}"
        self.scratch = Path(tempfile.mkdtemp(prefix="ffn-check-"))
        self.folder = self.scratch / "models"
        self.folder.mkdir()
        self.weights = write_models(self.folder)
        self.scratch.chmod(0o755)
        self.containers: list[str] = []
        self.projects: list[Callable[[], object]] = []
        self.results: dict[str, Any] = {}
        self.request = transform_request(CHECK_MODEL, D_MODEL)

    def cleanup(self) -> None:
        for down in self.projects:
            down()
        for name in self.containers:
            docker("rm", "-f", name, check=False, timeout=SLOW_S)
        shutil.rmtree(self.scratch, ignore_errors=True)

    # ----- helpers ---------------------------------------------------------------------------

    def new_folder(self, name: str, files: dict[str, str], mode: int = 0o755) -> Path:
        folder = self.scratch / name
        folder.mkdir()
        for file, text in files.items():
            (folder / file).write_text(text)
        share(folder)
        folder.chmod(mode)
        return folder

    def run_replica(self, name: str, *options: str, models: Path | None = None) -> str:
        """A detached server container on the host network, `name`, serving `models` (the check model)."""
        self.containers.append(name)
        docker(
            "run",
            "-d",
            "--name",
            name,
            "--stop-timeout",
            "30",
            "-v",
            f"{models or self.folder}:/models:ro",
            *options,
            self.image,
            timeout=SLOW_S,
        )
        return name

    def on_host(self, name: str, *options: str, models: Path | None = None) -> int:
        """run_replica on 127.0.0.1:<a free port>; the port."""
        port = free_port()
        grpc = f"FFN_GRPC_PORT={free_port()}"  # the host's network: 8001 may be taken
        self.run_replica(
            name, "--network", "host", "-e", "FFN_HOST=127.0.0.1", "-e", f"FFN_PORT={port}", "-e", grpc, *options,
            models=models,
        )  # fmt: skip
        return port

    def run_to_exit(self, *options: str) -> tuple[int, str, str]:
        """`docker run --rm` that is expected to stop by itself: its exit code, stdout and stderr."""
        result = subprocess.run(
            [*docker_cli(), "run", "--rm", *options], capture_output=True, text=True, timeout=SLOW_S
        )
        return result.returncode, result.stdout.strip(), result.stderr.strip()

    def check_answer(self, port: int) -> None:
        x = np.random.default_rng(1).standard_normal((5, D_MODEL)).astype(np.float32)
        with Client(f"http://127.0.0.1:{port}") as client:
            y = client.transform(CHECK_MODEL, x, encoding="binary")
        np.testing.assert_allclose(y, reference(self.weights, x), rtol=1e-4, atol=1e-5)
        answer = httpx.post(
            f"http://127.0.0.1:{port}/v1/models/{CHECK_MODEL}/transform",
            json={"inputs": x.tolist()},
            timeout=30,
            trust_env=False,
        )
        if answer.headers.get("x-model-digest") != file_digest(self.folder):
            raise CheckFailed(f"X-Model-Digest {answer.headers.get('x-model-digest')}, not {file_digest(self.folder)}")

    def stop(self, name: str) -> dict[str, Any]:
        """`docker stop` (SIGTERM, then 30 s): its exit code and the seconds it took."""
        started = time.perf_counter()
        docker("stop", "-t", "30", name, timeout=60)
        return {"exit_code": exit_code(name), "stop_s": round(time.perf_counter() - started, 1)}

    def compose(self, files: str, project: str, env: dict[str, str]) -> Callable[..., subprocess.CompletedProcess[str]]:
        """A `docker compose` command line for `files` (COMPOSE_FILES) and `project`; CheckFailed without v2."""
        command, why = compose_v2()
        if command is None:
            raise CheckFailed(why)
        base = [*command, "--project-directory", str(ROOT), "-p", project]
        for file in COMPOSE_FILES[files]:
            base += ["-f", str(ROOT / file)]
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("FFN_", "COMPOSE_"))}

        def run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
            return subprocess.run([*base, *args], capture_output=True, text=True, env={**clean, **env}, timeout=timeout)

        return run

    def up(self, files: str, project: str, env: dict[str, str], *args: str) -> Callable[..., Any]:
        """`compose up -d --no-build --wait *args`, taken down at cleanup; the compose command."""
        if not docker("images", "-q", LOADTEST_IMAGE):
            raise CheckFailed(f"no {LOADTEST_IMAGE} image: run without --no-build once")
        compose = self.compose(files, project, env)
        self.projects.append(lambda: compose("down", "--remove-orphans", "-t", "30"))
        up = compose("up", "-d", "--no-build", "--wait", *args)
        if up.returncode != 0:
            raise CheckFailed(f"docker compose up --wait exited {up.returncode}: {up.stderr[-2000:]}")
        return compose

    # ----- the checks ------------------------------------------------------------------------

    def build(self) -> None:
        """The server image, then the load tester's; what the image keeps of the build's arguments."""
        dockerfile = self.scratch / "Dockerfile"  # outside the build context
        dockerfile.write_text(re.sub(r"\A# syntax=.*\n", "", (ROOT / "Dockerfile").read_text()))
        args = ["build", "--network", "host", "-f", str(dockerfile)]
        revision = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
        args += ["--build-arg", f"REVISION={revision or 'unknown'}"]
        index = os.environ.get("DOCKER_CHECK_TORCH_INDEX")
        if index:  # a local index of CPU torch wheels
            args += ["--build-arg", f"CPU_TORCH_INDEX={index}"]
        started = time.perf_counter()
        docker(*args, "-t", self.image, str(ROOT), timeout=3600)
        self.results["build_s"] = round(time.perf_counter() - started, 1)
        docker(*args, "--target", "loadtest", "-t", LOADTEST_IMAGE, str(ROOT), timeout=1800)
        index = index or "https://download.pytorch.org/whl/cpu"
        env = json.loads(docker("image", "inspect", "-f", "{{json .Config.Env}}", self.image))
        history = docker("history", "--no-trunc", "--format", "{{.CreatedBy}}", self.image)
        self.results["image"] = {
            "size_mb": round(int(docker("image", "inspect", "-f", "{{.Size}}", self.image)) / 2**20),
            "loadtest_size_mb": round(int(docker("image", "inspect", "-f", "{{.Size}}", LOADTEST_IMAGE)) / 2**20),
            "index_in_env": any(index in e or "TORCH_INDEX" in e for e in env),
            "index_in_history": index in history,
        }
        if self.results["image"]["index_in_env"]:
            raise CheckFailed(f"the torch index stays in the image's environment: {env}")
        self.check_labels_and_ports()

    def check_labels_and_ports(self) -> None:
        """The OCI labels and the exposed ports, as `docker image inspect` shows them."""
        labels = json.loads(docker("image", "inspect", "-f", "{{json .Config.Labels}}", self.image)) or {}
        ports = sorted(json.loads(docker("image", "inspect", "-f", "{{json .Config.ExposedPorts}}", self.image)))
        oci = {key.rsplit(".", 1)[1]: value for key, value in labels.items() if key.startswith("org.opencontainers")}
        self.results["image"].update({"labels": oci, "exposed": ports})
        if set(oci) != set(OCI_LABELS) or ports != ["8000/tcp", "8001/tcp", "8002/tcp"]:
            raise CheckFailed(f"OCI labels {oci}, exposed ports {ports}")

    def check_models(self) -> None:
        """A model folder that cannot be used stops the start; only an empty one serves `demo`."""
        seen: dict[str, Any] = {}
        unreadable = self.new_folder("unreadable", {"config.toml": ""}, mode=0o700)  # another owner's
        misnamed = self.new_folder("misnamed", {"config.yaml": "", "check.safetensors": ""})
        for name, folder, expected in (
            ("unreadable", unreadable, "cannot read the model folder /models as uid 10001"),
            ("misnamed", misnamed, "holds check.safetensors config.yaml but no config.toml"),
        ):
            code, _, output = self.run_to_exit("-v", f"{folder}:/models:ro", self.image)
            seen[name] = {"exit_code": code, "message": output}
            if code != 2 or expected not in output or "Traceback" in output:
                raise CheckFailed(f"model folder {name}: exit {code}, {output!r}")
        readme = self.new_folder("readme-only", {"README.md": "the models go here\n"})
        port = self.on_host(f"{self.prefix}-demo", models=readme)
        wait_healthy(f"{self.prefix}-demo")
        with Client(f"http://127.0.0.1:{port}") as client:
            seen["readme_only_serves"] = [m["name"] for m in client.models()]
        docker("rm", "-f", f"{self.prefix}-demo", timeout=SLOW_S)
        if seen["readme_only_serves"] != ["demo"]:
            raise CheckFailed(f"a folder with only a README: {seen}")
        self.results["models"] = seen

    def check_container(self) -> None:
        code, output, errors = self.run_to_exit("-v", f"{self.folder}:/models:ro", self.image, "--check")
        self.results["check"] = {"exit_code": code, "output": output}
        if code != 0 or file_digest(self.folder) not in output:
            raise CheckFailed(f"ffn-serve --check in the image: exit {code}: {output} {errors[-1000:]}")
        name = f"{self.prefix}-one"
        port = self.on_host(name)
        self.results["healthy_after_s"] = wait_healthy(name)
        self.check_answer(port)
        self.results["answer_matches_numpy"] = True
        # The load tester as docs/deployment.md runs it: its own image, on the host network.
        code, output, errors = self.run_to_exit(
            "--network", "host", LOADTEST_IMAGE, "ffn-loadtest", "--url", f"http://127.0.0.1:{port}",
            "--model", CHECK_MODEL, "-n", "100", "-q", "--json", "-",
        )  # fmt: skip
        if code != 0:
            raise CheckFailed(f"ffn-loadtest in {LOADTEST_IMAGE} exited {code}: {output[-1000:]} {errors[-1000:]}")
        self.results["loadtest_image"] = json.loads(output)["counts"]
        fates, done = load_during(
            port, self.request, [("stop", lambda: self.stop(name))], clients=8, settle=200, stop_when_refused=True
        )
        self.results["stop"] = {**done["stop"]["result"], **no_loss("docker stop under load", fates, {200, 503})}
        if self.results["stop"]["exit_code"] != 0:
            raise CheckFailed(f"docker stop under load: {self.results['stop']}")

    def check_published(self) -> None:
        """`docker stop` under load on a port published with `-p`: Docker's proxy stands between the clients
        and the server. Counted as on the host network (check_container), not failed on: what it loses is
        what docs/deployment.md reports."""
        network = f"{self.prefix}-net"  # this engine has no default bridge; any user-defined one has the proxy
        docker("network", "create", network)
        self.projects.append(lambda: docker("network", "rm", network, check=False))
        name, port = f"{self.prefix}-published", free_port()
        self.run_replica(name, "--network", network, "-p", f"127.0.0.1:{port}:8000", "-e", "FFN_GRPC=false")
        wait_healthy(name)
        self.check_answer(port)
        fates, done = load_during(
            port, self.request, [("stop", lambda: self.stop(name))], clients=8, settle=200, stop_when_refused=True
        )
        seen = fates.to_dict()
        self.results["published"] = {**done["stop"]["result"], **seen}
        if done["stop"]["result"]["exit_code"] != 0 or not fates.answered[200]:
            raise CheckFailed(f"docker stop with -p under load: {self.results['published']}")

    def check_read_only(self) -> None:
        """A read-only root file system with 2 workers: one line without a writable folder, else serving."""
        workers = ["--read-only", "-e", "FFN_WORKERS=2", "-e", "FFN_TORCH_THREADS=1"]
        code, _, output = self.run_to_exit("-v", f"{self.folder}:/models:ro", *workers, self.image)
        seen: dict[str, Any] = {"no_tmpfs": {"exit_code": code, "message": output}}
        if code != 2 or len(output.splitlines()) != 1 or "FFN_METRICS_DIR" not in output:
            raise CheckFailed(f"--read-only without a tmpfs: exit {code}, {output!r}")
        variants = {
            "tmpfs_tmp": ["--tmpfs", "/tmp"],
            "metrics_dir": ["--tmpfs", "/run/ffn-metrics", "-e", "FFN_METRICS_DIR=/run/ffn-metrics"],
        }
        started = time.perf_counter()
        ports = {key: self.on_host(f"{self.prefix}-ro-{key}", *workers, *extra) for key, extra in variants.items()}
        for key, port in ports.items():
            name = f"{self.prefix}-ro-{key}"
            wait_healthy(name)
            healthy_s = round(time.perf_counter() - started, 1)  # both started together
            self.check_answer(port)
            self.check_answer(port)
            page = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30, trust_env=False).text
            answered = metric_value(page, "ffn_requests_total", model=CHECK_MODEL, outcome="ok")
            seen[key] = {"healthy_after_s": healthy_s, "answered_ok": answered, **self.stop(name)}  # 4 expected
            if seen[key]["exit_code"] != 0 or answered != 4:  # two check_answer calls of two requests each
                raise CheckFailed(f"--read-only {key}: {seen[key]}\n{logs(name)}")
        self.results["read_only"] = seen

    def check_compose(self) -> None:
        command, why = compose_v2()
        if command is None:
            self.results["compose"] = {"skipped": why}
            return
        port = free_port()
        env = {
            "PUBLISH": f"127.0.0.1:{port}",
            "GRPC_PUBLISH": f"127.0.0.1:{free_port()}",
            "MODELS_DIR": str(self.folder),
        }
        started = time.perf_counter()
        compose = self.up("base", f"{self.prefix}-compose", env)
        healthy_s = round(time.perf_counter() - started, 1)
        x = np.ones((2, D_MODEL), np.float32)
        with Client(f"http://127.0.0.1:{port}") as client:
            np.testing.assert_allclose(
                client.transform(CHECK_MODEL, x), reference(self.weights, x), rtol=1e-4, atol=1e-5
            )
        load = compose(
            "--profile", "loadtest", "run", "--rm", "--no-deps", "loadtest",
            "ffn-loadtest", "--url", "http://ffn:8000", "--model", CHECK_MODEL, "-n", "200", "-q", "--json", "-",
        )  # fmt: skip
        if load.returncode != 0:
            raise CheckFailed(
                f"compose's loadtest exited {load.returncode}: {load.stdout[-1000:]} {load.stderr[-1000:]}"
            )
        counts = json.loads(load.stdout)["counts"]
        (container,) = compose("ps", "-q", "ffn").stdout.split()
        read_only = docker("inspect", "-f", "{{.HostConfig.ReadonlyRootfs}}", container) == "true"
        stop = compose("stop", "-t", "30")
        code = exit_code(container)
        compose("down")
        gpu = json.loads(
            self.compose("gpu", f"{self.prefix}-gpu", env)("--profile", "loadtest", "config", "--format", "json").stdout
        )
        images = {name: (s["image"], s["build"].get("target")) for name, s in gpu["services"].items()}
        self.results["compose"] = {
            "version": why,
            "healthy_after_s": healthy_s,
            "read_only_root": read_only,
            "loadtest": counts,
            "exit_code": code,
            "gpu_override_images": images,
        }
        if stop.returncode != 0 or code != 0 or counts["ok"] != 200 or not read_only:
            raise CheckFailed(f"compose: {self.results['compose']}; {stop.stderr[-2000:]}")
        if len({image for image, _ in images.values()}) != len(images):
            raise CheckFailed(f"the GPU override gives two different builds one tag: {images}")

    def check_balancer(self) -> None:
        """The load-balancer override as shipped, under load, across a stop, a kill and a crash."""
        command, why = compose_v2()
        if command is None:
            self.results["balancer"] = {"skipped": why}
            return
        port = free_port()
        env = {
            "LB_PUBLISH": f"127.0.0.1:{port}",
            "MODELS_DIR": str(self.folder),
            "FFN_WORKERS": "2",  # a worker to crash while the replica lives on
            "FFN_TORCH_THREADS": "1",
            "FFN_MODEL_CONTROL": "explicit",  # SIGHUP reads the config again: the weights' roll-out
        }
        compose = self.up("lb", f"{self.prefix}-lb", env, "--scale", "ffn=3")
        replicas = compose("ps", "-q", "ffn").stdout.split()
        published = {r: docker("port", r) for r in replicas}
        if len(replicas) != 3 or any(published.values()):
            raise CheckFailed(f"3 replicas, none published on the host: {published}")
        wait_ready(f"http://127.0.0.1:{port}")
        shown = subprocess.run(
            [*docker_cli(), "exec", compose("ps", "-q", "lb").stdout.strip(), "nginx", "-v"],
            capture_output=True,
            text=True,
        )  # nginx -v writes to stderr
        fates, done = load_during(
            port,
            self.request,
            [
                ("stop", lambda: self.stop_and_start(replicas[0])),
                ("kill", lambda: self.kill_and_restart(replicas[1])),
                ("crash", lambda: self.crash_a_worker(replicas[2])),
                ("rolling_restart", lambda: self.rolling_restart(replicas)),
                ("rollout", lambda: self.roll_out(compose, replicas)),
                ("after", lambda: None),
            ],
            clients=16,
            settle=1000,
            stop_when_refused=False,
        )
        done.pop("after")
        self.results["balancer"] = {
            "nginx": (shown.stdout + shown.stderr).strip(),
            "replicas": len(replicas),
            "published": [],
            **{name: action["result"] for name, action in done.items()},
            **no_loss("3 replicas behind nginx", fates, {200}),
        }
        # Every replica reports the new weights' digest once the load is over, too.
        digests = {replica_digest(r) for r in compose("ps", "-q", "ffn").stdout.split()}
        if digests != {file_digest(self.folder)}:
            raise CheckFailed(f"after the roll-out the replicas report {digests}, not {file_digest(self.folder)}")
        self.results["balancer"]["loadtest"] = self.documented_load_test(compose)
        self.results["balancer"]["down"] = self.down_under_load(compose, port)

    def rolling_restart(self, replicas: list[str]) -> dict[str, Any]:
        """docs/deployment.md's rolling restart: each replica in turn, the next once it is healthy again."""
        seconds = []
        for replica in replicas:
            started = time.perf_counter()
            docker("restart", "-t", "30", replica, timeout=SLOW_S)
            wait_healthy(replica)
            seconds.append(round(time.perf_counter() - started, 1))
        return {"healthy_again_s": seconds}

    def roll_out(self, compose: Callable[..., subprocess.CompletedProcess[str]], replicas: list[str]) -> dict[str, Any]:
        """New weights to every replica: the file replaced, SIGHUP through compose; until each reports their digest."""
        before = {replica_digest(r) for r in replicas}
        self.weights = write_models(self.folder, seed=8)
        after = file_digest(self.folder)
        started = time.perf_counter()
        hup = compose("kill", "-s", "SIGHUP", "ffn")
        if hup.returncode != 0:
            raise CheckFailed(f"compose kill -s SIGHUP ffn exited {hup.returncode}: {hup.stderr}")
        while {replica_digest(r) for r in replicas} != {after}:
            if time.perf_counter() - started > 240:
                raise CheckFailed(f"not every replica serves {after} 240 s after SIGHUP")
            time.sleep(0.5)
        return {
            "before": sorted(before),
            "after": after,
            "every_replica_after_s": round(time.perf_counter() - started, 1),
        }

    def documented_load_test(self, compose: Callable[..., subprocess.CompletedProcess[str]]) -> dict[str, Any]:
        """The load test through the balancer as docs/deployment.md runs it; the replicas must stay 3."""
        load = compose(
            "--profile", "loadtest", "run", "--rm", "loadtest",
            "ffn-loadtest", "--url", "http://lb:8080", "--model", CHECK_MODEL, "-n", "200", "-q", "--json", "-",
        )  # fmt: skip
        replicas = compose("ps", "-q", "ffn").stdout.split()
        if load.returncode != 0 or len(replicas) != 3:
            raise CheckFailed(f"the load test through nginx: exit {load.returncode}, {len(replicas)} replicas after it")
        return {**json.loads(load.stdout)["counts"], "replicas_after": len(replicas)}

    def down_under_load(self, compose: Callable[..., subprocess.CompletedProcess[str]], port: int) -> dict[str, Any]:
        """`compose down` while kept-alive clients send through nginx: counted, not failed on (docs say what it loses)."""
        fates, done = load_during(
            port,
            self.request,
            [("down", lambda: compose("down", "-t", "30").returncode)],
            clients=8,
            settle=200,
            stop_when_refused=True,
        )
        return {"exit_code": done["down"]["result"], **fates.to_dict()}

    def stop_and_start(self, name: str) -> dict[str, Any]:
        """Stop a replica (it drains, exit 0), start it again, until healthy."""
        stopped = self.stop(name)
        if stopped["exit_code"] != 0:
            raise CheckFailed(f"replica stop: {stopped}\n{logs(name)}")
        docker("start", name, timeout=SLOW_S)
        return {**stopped, "healthy_again_s": wait_healthy(name)}

    def kill_and_restart(self, name: str) -> dict[str, Any]:
        """SIGKILL a replica (Docker counts a kill as a manual stop: no restart policy), start it, until healthy."""
        docker("kill", name)
        code = wait_exited(name)
        docker("start", name, timeout=SLOW_S)
        return {"exit_code": code, "healthy_again_s": wait_healthy(name)}

    def crash_a_worker(self, name: str) -> dict[str, Any]:
        """SIGKILL one of a replica's worker processes (the supervisor is PID 1); until a new one is ready."""
        listing = "for p in $(cat /proc/1/task/1/children); do echo $p $(tr '\\0' ' ' < /proc/$p/cmdline); done"
        workers = [
            line.split()[0]
            for line in docker("exec", name, "sh", "-c", listing).splitlines()
            if "spawn_main" in line  # not multiprocessing's resource tracker, should one run
        ]
        if len(workers) != 2:
            raise CheckFailed(f"{name} runs worker processes {workers}, not 2")
        docker("exec", name, "sh", "-c", f"kill -9 {workers[0]}")  # no kill(1) in the image: the shell's
        started = time.perf_counter()
        while time.perf_counter() - started < 240:
            ready = set(re.findall(r"worker \d+ \(pid (\d+)\) ready", logs(name, tail=200)))
            if ready - set(workers):
                return {"killed_pid": int(workers[0]), "replaced_after_s": round(time.perf_counter() - started, 1)}
            time.sleep(0.5)
        raise CheckFailed(f"no worker replaced the one killed in {name}:\n{logs(name)}")

    def check_start_interval(self) -> None:
        """What this engine makes of deploy/compose.start-interval.yml (a Docker 25 feature)."""
        command, why = compose_v2()
        if command is None:
            self.results["start_interval"] = {"skipped": why}
            return
        version = engine_version()
        env = {
            "PUBLISH": f"127.0.0.1:{free_port()}",
            "GRPC_PUBLISH": f"127.0.0.1:{free_port()}",
            "MODELS_DIR": str(self.folder),
        }
        seen: dict[str, Any] = {"engine": ".".join(map(str, version))}
        if version < (25,):
            compose = self.compose("start_interval", f"{self.prefix}-si", env)
            self.projects.append(lambda: compose("down", "--remove-orphans"))
            up = compose("up", "-d", "--no-build")
            running = compose("ps", "-q").stdout.split()
            # Compose 2.40 says why and creates no container, yet exits 0: the message is the answer.
            seen["refused"] = "start_interval" in up.stderr and not running
            seen["compose_exit_code"] = up.returncode
            seen["message"] = up.stderr.strip().splitlines()[-1] if up.stderr.strip() else ""
            if not seen["refused"]:
                raise CheckFailed(f"compose accepted start_interval on Docker {seen['engine']}: {up.stderr}")
        else:
            started = time.perf_counter()
            self.up("start_interval", f"{self.prefix}-si", env)
            seen["healthy_after_s"] = round(time.perf_counter() - started, 1)
        self.results["start_interval"] = seen


def wait_ready(url: str, limit_s: float = 60) -> None:
    """The client's own readiness wait, its failure a CheckFailed."""
    with Client(url, timeout=2.0, max_retries=0) as client:
        try:
            client.wait_ready(limit_s, interval=0.5)
        except TransportError as exc:
            raise CheckFailed(f"{url}/v2/health/ready did not answer 200 within {limit_s:g} s") from exc


CHECKS = "models,container,published,read_only,compose,balancer,start_interval"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deploy/docker_check.py", description=__doc__.split("\n")[0])
    parser.add_argument("--image", default="ffn-serve:cpu")
    parser.add_argument("--no-build", action="store_true", help="use the images as they are")
    parser.add_argument(
        "--checks", default=CHECKS, help="which checks after the build, comma-separated (default %(default)s)"
    )
    parser.add_argument("--json", metavar="FILE", help="write what was seen as JSON")
    args = parser.parse_args(argv)
    why = engine_reachable()
    if why:
        print(f"docker_check: {why}", file=sys.stderr)
        return 3
    checker = Checker(args.image)
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
    except (CheckFailed, AssertionError, TransportError) as exc:
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
