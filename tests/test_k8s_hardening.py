"""The Kubernetes manifests' hardening: every pod passes the `restricted` Pod Security level.

The Deployments (CPU, GPU) and the KServe predictor run as the same locked-down pod: non-root,
no privilege escalation, no capability, the runtime's seccomp profile, a read-only root with
an emptyDir at /tmp (the worker processes' metrics files), no service links, no API token, a
preStop pause, probes with timeouts above 1 s. Everything lives in the `ffn-serve` namespace,
which enforces `restricted`; a NetworkPolicy admits only the service, gRPC and metrics ports.
Where checkov is installed, it finds nothing but the image digest (docs/deployment.md says why).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.pod_security import restricted_violations

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
NAMESPACE = "ffn-serve"
# checkov's findings that do not apply, each explained in docs/deployment.md.
CHECKOV_NOT_APPLICABLE = {"CKV_K8S_43"}  # image digest: the image is the one you build and push


def documents() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p in sorted(K8S.rglob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


def pod_specs() -> list[tuple[str, dict[str, Any]]]:
    """(where, PodSpec) of every pod the manifests make: the Deployments' and KServe's predictor."""
    found = []
    for path, doc in documents():
        where = f"{path.relative_to(ROOT)} {doc['kind']}"
        if doc["kind"] == "Deployment":
            found.append((where, doc["spec"]["template"]["spec"]))
        elif doc["kind"] == "InferenceService":
            found.append((where, doc["spec"]["predictor"]))  # a PodSpec inline, plus KServe's fields
    return found


def test_every_pod_passes_the_restricted_pod_security_level() -> None:
    pods = pod_specs()
    assert len(pods) == 4  # the CPU, GPU and TLS deployments and the KServe predictor
    for where, pod in pods:
        assert restricted_violations(pod) == [], where


def test_the_restricted_rules_catch_what_the_old_kserve_predictor_lacked() -> None:
    """The checker is not vacuous: the predictor as it was (no securityContext) fails it."""
    (_, predictor) = next(p for p in pod_specs() if "InferenceService" in p[0])
    bare = {k: v for k, v in predictor.items() if k != "securityContext"}
    bare["containers"] = [{k: v for k, v in c.items() if k != "securityContext"} for c in predictor["containers"]]
    assert set(restricted_violations(bare)) == {
        "kserve-container: allowPrivilegeEscalation is not false",
        "kserve-container: capabilities do not drop ALL",
        "kserve-container: runAsNonRoot is not true",
        "kserve-container: seccomp profile None",
    }


def test_every_pod_has_a_read_only_root_no_token_no_service_links_and_a_writable_tmp() -> None:
    for where, pod in pod_specs():
        (container,) = pod["containers"]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True, where
        assert pod["enableServiceLinks"] is False, where
        assert pod["automountServiceAccountToken"] is False, where
        assert container["imagePullPolicy"] == "Always", where
        (tmp,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == tmp["name"]]
        assert "emptyDir" in volume and volume["emptyDir"].get("sizeLimit"), where


def test_every_pod_pauses_before_sigterm_and_gives_its_probes_more_than_a_second() -> None:
    for where, pod in pod_specs():
        (container,) = pod["containers"]
        assert container["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep", where
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            assert container[probe]["timeoutSeconds"] >= 2, (where, probe)


def test_the_kserve_predictor_is_hardened_like_the_deployment() -> None:
    (_, deployment), *_ = [p for p in pod_specs() if p[0].startswith("deploy/k8s/deployment.yaml")]
    (_, predictor) = next(p for p in pod_specs() if "InferenceService" in p[0])
    assert predictor["securityContext"] == deployment["securityContext"]
    (mine,), (theirs,) = predictor["containers"], deployment["containers"]
    assert mine["securityContext"] == theirs["securityContext"]
    assert mine["lifecycle"] == theirs["lifecycle"]
    assert predictor["terminationGracePeriodSeconds"] == deployment["terminationGracePeriodSeconds"]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        for field in ("periodSeconds", "timeoutSeconds", "failureThreshold"):
            assert mine[probe][field] == theirs[probe][field], (probe, field)


def test_everything_lives_in_a_namespace_that_enforces_restricted() -> None:
    (namespace,) = [d for _, d in documents() if d["kind"] == "Namespace"]
    assert namespace["metadata"]["name"] == NAMESPACE
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for path, doc in documents():
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == NAMESPACE, path
    # `kubectl apply -f deploy/k8s/` goes in file order: the namespace must come first.
    assert sorted(p.name for p in K8S.glob("*.yaml"))[0] == "00-namespace.yaml"


def test_the_network_policy_admits_only_the_service_grpc_and_metrics_ports() -> None:
    (policy,) = [d for _, d in documents() if d["kind"] == "NetworkPolicy"]
    spec = policy["spec"]
    assert set(spec["policyTypes"]) == {"Ingress", "Egress"} and spec["egress"] == []
    (rule,) = spec["ingress"]
    assert {p["port"] for p in rule["ports"]} == {"http", "grpc", "metrics"}
    for path, doc in documents():
        if doc["kind"] == "Deployment":
            labels = doc["spec"]["template"]["metadata"]["labels"]
            assert spec["podSelector"]["matchLabels"].items() <= labels.items(), path
            (container,) = doc["spec"]["template"]["spec"]["containers"]
            assert {p["name"] for p in container["ports"]} == {"http", "grpc", "metrics"}, path


def test_namespace_and_network_policy_validate_against_the_kubernetes_schemas() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for doc in [d for _, d in documents() if d["kind"] in ("Namespace", "NetworkPolicy")]:
        for version in ("1.28.0", kubernetes_validate.latest_version()):
            kubernetes_validate.validate(doc, version, strict=True)


def test_checkov_finds_nothing_that_applies_where_installed() -> None:
    checkov = shutil.which("checkov")
    if checkov is None:
        pytest.skip("checkov is not installed")
    result = subprocess.run(
        [checkov, "-d", str(K8S), "--framework", "kubernetes", "--skip-download", "--quiet", "--output", "json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads(result.stdout)
    failed = {check["check_id"] for check in report["results"]["failed_checks"]}
    assert failed <= CHECKOV_NOT_APPLICABLE, failed
