"""The image built and run on a real Docker engine: deploy/docker_check.py, when one is there.

The engine run is opt-in, DOCKER_CHECK=1 (.ci/run sets it when an engine answers): it builds
both images (about 2-3 minutes on a cold cache here) and runs every check of docker_check.py
(about 10 minutes here): the model folder's refusals, one container drained under load, a
read-only root with two workers, compose as shipped, three replicas behind nginx as shipped
across a stop, a kill and a crash, and what the engine makes of a start interval. Without it,
or without an engine, the test skips at once. The checks that need no engine run always.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.docker_tools import compose_v2, engine_reachable, index_unreachable, torch_index

ROOT = Path(__file__).resolve().parent.parent
CONF = (ROOT / "deploy" / "nginx" / "ffn.conf").read_text()


def directives() -> list[str]:
    """The nginx config's directives, comments dropped."""
    return [line.split("#")[0].strip() for line in CONF.splitlines() if line.split("#")[0].strip()]


def test_nginx_config_needs_no_newer_nginx_and_finds_replicas_by_name() -> None:
    """No `resolve` (nginx 1.27.3+): the name goes through a variable, looked up at request time."""
    assert not any(re.search(r"\bresolve\b", d) for d in directives())
    assert "set $replicas ffn;" in directives() and "proxy_pass http://$replicas:8000;" in directives()
    (resolver,) = [d for d in directives() if d.startswith("resolver ")]
    assert "127.0.0.11" in resolver and re.search(r"valid=\d+s", resolver), "Docker's DNS, looked up again"


def test_nginx_config_retries_a_vanished_replica_elsewhere() -> None:
    """A stopped replica's address stops answering: connects time out. That must go to another replica."""
    retry_on = CONF.split("proxy_next_upstream ", 1)[1].split(";")[0].split()
    assert {"error", "timeout", "http_503", "non_idempotent"} <= set(retry_on)
    connect = float(CONF.split("proxy_connect_timeout ", 1)[1].split("s;")[0])
    assert connect <= 2, "a connect inside one host or cluster takes well under a second"


def test_compose_v1_is_reported_not_used() -> None:
    command, why = compose_v2()
    assert (command is None) == ("Compose v2" in why and "needs" in why)


@pytest.mark.skipif(
    os.environ.get("DOCKER_CHECK") != "1", reason="opt-in: DOCKER_CHECK=1 (.ci/run sets it where an engine answers)"
)
def test_image_on_a_real_engine_loses_no_request_and_refuses_what_it_cannot_use(tmp_path: Path) -> None:
    why = engine_reachable() or index_unreachable(torch_index())
    if why:
        pytest.skip(why)
    report_path = tmp_path / "docker.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "docker_check.py"), "--json", str(report_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=3000,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    seen = json.loads(report_path.read_text())
    # The torch index is a build argument: not in the image's environment.
    assert seen["image"]["index_in_env"] is False
    # OCI labels and every port the image serves.
    assert set(seen["image"]["labels"]) == {"title", "description", "version", "revision", "licenses"}
    assert seen["image"]["exposed"] == ["8000/tcp", "8001/tcp", "8002/tcp"]
    # The smoke test in the image, naming the model's digest.
    assert seen["check"]["exit_code"] == 0 and "finite; sha256:" in seen["check"]["output"]
    # A model folder that cannot be used stops the start; only an empty one serves `demo`.
    assert seen["models"]["unreadable"]["exit_code"] == seen["models"]["misnamed"]["exit_code"] == 2
    assert seen["models"]["readme_only_serves"] == ["demo"]
    # One container: healthy, numpy's answer, the documented load-test command, a drain losing nothing.
    assert seen["answer_matches_numpy"] is True and seen["loadtest_image"]["ok"] == 100
    stop = seen["stop"]
    assert stop["exit_code"] == 0 and stop["lost"] == 0 and stop["answered"]["200"] > 0
    assert set(stop["answered"]) <= {"200", "503"} and stop["closing"].get("503") == stop["answered"].get("503")
    # A read-only root with two workers: one line without a writable folder, serving with one.
    assert seen["read_only"]["no_tmpfs"]["exit_code"] == 2
    for variant in ("tmpfs_tmp", "metrics_dir"):
        assert seen["read_only"][variant]["exit_code"] == 0 and seen["read_only"][variant]["answered_ok"] == 4
    # Published with -p: counted (Docker's proxy loses requests on a stop; docs/deployment.md says so).
    assert seen["published"]["exit_code"] == 0 and seen["published"]["answered"]["200"] > 0
    compose = seen["compose"]  # Compose v2 only; without it, a skip with its reason
    if "skipped" not in compose:
        assert compose["exit_code"] == 0 and compose["loadtest"]["ok"] == 200 and compose["read_only_root"] is True
    lb = seen["balancer"]
    if "skipped" not in lb:
        assert lb["replicas"] == 3 and lb["lost"] == 0 and set(lb["answered"]) == {"200"}
        assert lb["stop"]["exit_code"] == 0 and lb["kill"]["exit_code"] == 137 and lb["crash"]["killed_pid"] > 0
        # New weights rolled out under that load: every replica moved to the new digest.
        assert (
            lb["rollout"]["after"] not in lb["rollout"]["before"] and len(lb["rolling_restart"]["healthy_again_s"]) == 3
        )
        # The documented load test through nginx leaves the replicas as they were.
        assert lb["loadtest"]["ok"] == 200 and lb["loadtest"]["replicas_after"] == 3
