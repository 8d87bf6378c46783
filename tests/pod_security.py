"""The `restricted` Pod Security Standard, as rules over a pod spec (Kubernetes 1.25 and later).

Kubernetes' own admission (namespace label `pod-security.kubernetes.io/enforce: restricted`)
checks these at apply time; with no cluster here, this is the same list, from
https://kubernetes.io/docs/concepts/security/pod-security-standards/ (baseline and restricted).
"""

from __future__ import annotations

from typing import Any

RESTRICTED_VOLUME_TYPES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
ALLOWED_SECCOMP = {"RuntimeDefault", "Localhost"}


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """What in `pod` (a PodSpec) the restricted level forbids; empty when it passes."""
    found = []
    pod_context = pod.get("securityContext", {})
    containers = [
        *pod.get("initContainers", []),
        *pod.get("containers", []),
        *pod.get("ephemeralContainers", []),
    ]
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            found.append(f"{field} is true")
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUME_TYPES:
            found.append(f"volume {volume['name']} is of type {sorted(kinds)}")
    for sysctl in pod_context.get("sysctls", []):
        if sysctl["name"] not in SAFE_SYSCTLS:
            found.append(f"sysctl {sysctl['name']}")
    if pod_context.get("runAsUser") == 0:
        found.append("the pod runs as UID 0")
    pod_seccomp = pod_context.get("seccompProfile", {}).get("type")
    if pod_seccomp is not None and pod_seccomp not in ALLOWED_SECCOMP:
        found.append(f"pod seccomp profile {pod_seccomp}")
    for container in containers:
        name = container["name"]
        context = container.get("securityContext", {})
        if context.get("privileged"):
            found.append(f"{name}: privileged")
        if context.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation is not false")
        if context.get("procMount", "Default") != "Default":
            found.append(f"{name}: procMount {context['procMount']}")
        capabilities = context.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []):
            found.append(f"{name}: capabilities do not drop ALL")
        if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: adds capabilities {capabilities['add']}")
        if context.get("runAsNonRoot", pod_context.get("runAsNonRoot")) is not True:
            found.append(f"{name}: runAsNonRoot is not true")
        if context.get("runAsUser") == 0:
            found.append(f"{name}: runs as UID 0")
        seccomp = context.get("seccompProfile", {}).get("type", pod_seccomp)
        if seccomp not in ALLOWED_SECCOMP:
            found.append(f"{name}: seccomp profile {seccomp}")
        selinux = context.get("seLinuxOptions", pod_context.get("seLinuxOptions", {}))
        if selinux.get("user") or selinux.get("role"):
            found.append(f"{name}: sets an SELinux user or role")
        for port in container.get("ports", []):
            if port.get("hostPort"):
                found.append(f"{name}: hostPort {port['hostPort']}")
    return found
