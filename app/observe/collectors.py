"""Scrape-time collectors: build info, every server process's resources, GPU memory; the GPUs' readings.

They are read when /metrics is rendered, not counted as requests pass, so they cost nothing
between scrapes. With worker processes each scrape lists every process (the supervisor and each
worker, labelled by pid and role), read from /proc by whichever worker answers; the supervisor
keeps the list of pids in a file beside the merged metrics (`write_processes`).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import platform
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import ProcessCollector
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from app import __version__

PROCESSES_FILE = "processes.json"  # in the multiprocess metrics folder; its collector reads only *.db files


class BuildInfoCollector(Collector):
    """`ffn_build_info{version, torch, cuda, python} 1`: what is running, for dashboards and alerts."""

    def collect(self) -> Iterable[Metric]:
        info = GaugeMetricFamily(
            "ffn_build_info",
            "The running ffn-serve: its version and those of torch, CUDA and Python.",
            labels=["version", "torch", "cuda", "python"],
        )
        info.add_metric([__version__, *torch_versions(), platform.python_version()], 1)
        return [info]


def torch_versions() -> tuple[str, str]:
    """torch's version and the CUDA it was built with ("none"): from torch where it is loaded, else
    read from its torch/version.py, so that a front of an engine process (shared_engine), which
    answers scrapes and computes nothing, never imports torch (seconds, some 200 MiB) for a label."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.__version__, torch.version.cuda or "none"
    spec = importlib.util.find_spec("torch")  # finds the package without running it
    if spec is None or spec.origin is None:
        return "none", "none"
    text = (Path(spec.origin).parent / "version.py").read_text()
    version = re.search(r"^__version__\s*=\s*'([^']*)'", text, re.MULTILINE)
    cuda = re.search(r"^cuda(?:: [^=]*)?\s*=\s*'([^']*)'", text, re.MULTILINE)
    return (version.group(1) if version else "unknown"), (cuda.group(1) if cuda else "none")


def write_processes(folder: Path, supervisor: int, workers: Iterable[int]) -> None:
    """Record the supervisor's and the live workers' pids for the process metrics (atomically)."""
    temporary = folder / f".{PROCESSES_FILE}.{os.getpid()}"
    temporary.write_text(json.dumps({"supervisor": supervisor, "workers": sorted(workers)}))
    temporary.replace(folder / PROCESSES_FILE)


def read_processes(folder: Path) -> list[tuple[int, str]]:
    """(pid, role) of every server process named by `write_processes`; this process alone if none."""
    try:
        recorded = json.loads((folder / PROCESSES_FILE).read_text())
    except (OSError, ValueError):
        return [(os.getpid(), "worker")]
    return [(recorded["supervisor"], "supervisor"), *((pid, "worker") for pid in recorded["workers"])]


class ProcessesCollector(Collector):
    """prometheus_client's process metrics (RSS, CPU seconds, open fds...) for several processes,
    each series labelled by `pid` and `role` (server: the one process; supervisor; worker).

    `folder` is the multiprocess metrics folder, where the supervisor lists its processes; None
    means this process only.
    """

    def __init__(self, folder: Path | None = None) -> None:
        self._folder = folder

    def _processes(self) -> list[tuple[int, str]]:
        return read_processes(self._folder) if self._folder is not None else [(os.getpid(), "server")]

    def collect(self) -> Iterable[Metric]:
        merged: dict[str, Metric] = {}
        for pid, role in self._processes():
            # The library's reader of /proc/<pid>/stat, limits and fd; it yields nothing for a
            # process that has gone (a worker restarting between the list and the read).
            for family in ProcessCollector(pid=functools.partial(int, pid), registry=None).collect():
                target = merged.get(family.name)
                if target is None:
                    target = merged[family.name] = Metric(family.name, family.documentation, family.type)
                for sample in family.samples:
                    labels = {**sample.labels, "pid": str(pid), "role": role}
                    target.add_sample(sample.name, labels, sample.value)
        return list(merged.values())


def devices_in_use() -> list[int]:
    """The CUDA devices where this process already holds memory: reading them creates no CUDA context.

    None in a process that has not loaded torch (a front of an engine process): it holds no device memory."""
    if "torch" not in sys.modules:
        return []
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return []
    return [index for index in range(torch.cuda.device_count()) if torch.cuda.memory_reserved(index) > 0]


class GpuMemoryCollector(Collector):
    """`ffn_gpu_memory_used_bytes` and `_total_bytes` per device the service computes on, from `gpus()`
    (read_gpus in a process with models; a front's engines' last report).

    Device-wide figures (cudaMemGetInfo), so they include every worker's CUDA context and any
    other process on the GPU: what tells whether one more worker fits. Only devices where the
    process already holds memory are read, so a scrape never creates a CUDA context.
    """

    def __init__(self, gpus: Callable[[], list[GpuReading]]) -> None:
        self._gpus = gpus

    def collect(self) -> Iterable[Metric]:
        gpus = self._gpus()
        if not gpus:
            return []
        used = GaugeMetricFamily(
            "ffn_gpu_memory_used_bytes", "GPU memory in use on the device, by every process.", labels=["device"]
        )
        total = GaugeMetricFamily("ffn_gpu_memory_total_bytes", "GPU memory of the device.", labels=["device"])
        for gpu in gpus:
            used.add_metric([gpu.device], gpu.used_bytes)
            total.add_metric([gpu.device], gpu.total_bytes)
        return [used, total]


@dataclass(frozen=True)
class GpuReading:
    """One GPU's figures at a scrape, as the nv_gpu_* series show them."""

    uuid: str  # "GPU-<uuid>", as nvidia-smi -L and Triton write it
    utilization: float | None  # 0.0 to 1.0 over NVML's last sample period; None: NVML could not say
    used_bytes: int  # device-wide: every process's memory on it
    total_bytes: int
    power_watts: float | None  # None: NVML could not say
    device: str  # "cuda:N", torch's index on the host that read it


def read_gpus() -> list[GpuReading]:
    """Triton's figures of each GPU this process computes on (`devices_in_use`), for the nv_gpu_* series."""
    devices = devices_in_use()
    if not devices:
        return []
    import torch

    readings = []
    for index in devices:
        free, capacity = torch.cuda.mem_get_info(index)
        readings.append(
            GpuReading(
                uuid=f"GPU-{torch.cuda.get_device_properties(index).uuid}",
                utilization=_from_nvml(torch.cuda.utilization, index, 100.0),  # percent
                used_bytes=capacity - free,
                total_bytes=capacity,
                power_watts=_from_nvml(torch.cuda.power_draw, index, 1000.0),  # milliwatts
                device=f"cuda:{index}",
            )
        )
    return readings


def _from_nvml(read: Callable[[int], float], index: int, per_unit: float) -> float | None:
    """An NVML figure through torch (which maps CUDA's device index to NVML's); None when NVML cannot
    give it: nvidia-ml-py missing, a driver without NVML, or a device that does not report it."""
    try:
        return read(index) / per_unit
    except Exception:  # pynvml's NVMLError, ModuleNotFoundError, RuntimeError: the series is left out
        return None
