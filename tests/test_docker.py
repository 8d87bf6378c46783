"""The image built and run on a real Docker engine: deploy/docker_check.py, when one is there.

The engine run is opt-in, DOCKER_CHECK=1 (.ci/run sets it when an engine answers): it
builds the image (about 2-3 minutes on a cold cache here) and starts five containers. Without
it, or without an engine, the test skips at once. The load balancer check runs nginx from the
engine's nginx:1.28-alpine image; where that is an older nginx (Debian's 1.22 stand-in on the
development machine), without `resolve`, as docker_check.py explains.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.docker_tools import compose_v2, engine_reachable, index_unreachable, nginx_conf_for, torch_index

ROOT = Path(__file__).resolve().parent.parent


def test_nginx_copy_for_older_nginx_drops_resolve_only():
    original = (ROOT / "deploy" / "nginx" / "ffn.conf").read_text()
    assert nginx_conf_for((1, 28, 0)) == original
    older = nginx_conf_for((1, 22, 1))
    directives = [line.split("#")[0] for line in older.splitlines()]
    assert not any(" resolve" in line for line in directives)
    assert [line for line in directives if "server ffn:8000" in line] == [
        "    server ffn:8000 max_fails=1 fail_timeout=5s;"
    ]
    assert older == original.replace("server ffn:8000 resolve ", "server ffn:8000 ")


def test_nginx_config_retries_a_vanished_replica_elsewhere():
    """A stopped replica's address stops answering: connects time out. That must go to another replica."""
    conf = (ROOT / "deploy" / "nginx" / "ffn.conf").read_text()
    retry_on = conf.split("proxy_next_upstream ", 1)[1].split(";")[0].split()
    assert {"error", "timeout", "http_503", "non_idempotent"} <= set(retry_on)
    connect = float(conf.split("proxy_connect_timeout ", 1)[1].split("s;")[0])
    assert connect <= 2, "a connect inside one host or cluster takes well under a second"
    assert "max_fails=0" not in conf, "a replica that failed must be set aside, not tried again on every request"


def test_compose_v1_is_reported_not_used():
    command, why = compose_v2()
    assert (command is None) == ("Compose v2" in why and "needs" in why)


@pytest.mark.skipif(
    os.environ.get("DOCKER_CHECK") != "1", reason="opt-in: DOCKER_CHECK=1 (.ci/run sets it where an engine answers)"
)
def test_image_builds_serves_drains_and_scales_down_without_a_failed_request(tmp_path):
    why = engine_reachable() or index_unreachable(torch_index())
    if why:
        pytest.skip(why)
    report_path = tmp_path / "docker.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "docker_check.py"), "--json", str(report_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=1800,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    seen = json.loads(report_path.read_text())
    assert seen["answer_matches_numpy"] is True and seen["healthy_after_s"] > 0
    stop = seen["stop"]
    assert stop["exit_code"] == 0 and stop["ok"] > 0
    assert set(stop["errors"]) <= {"503", "connect"}  # refused after SIGTERM, never lost
    lb = seen["balancer"]
    assert (lb["sent"], lb["ok"], lb["errors"], lb["replica_exit_code"]) == (3000, 3000, {}, 0)
    compose = seen["compose"]  # Compose v2 only; v1 (Debian's, here) is a skip with its reason
    assert "skipped" in compose or (compose["exit_codes"] == [0] and compose["loadtest"]["ok"] == 200)
