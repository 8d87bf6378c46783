"""Triton's metric names beside the ffn_* series: `nv_inference_*` per model, `nv_gpu_*` per GPU.

Triton's Grafana dashboards, alerts written for Triton, and perf_analyzer's `--collect-metrics`
read these names. Nothing counts them: they are written when /metrics is rendered, from the
samples that scrape collected (every worker's, merged), so they agree exactly with the ffn_*
series and the V2 statistics extension, which read the same samples
(app/protocol/v2/statistics.py gives each Triton figure the same source):

    nv_inference_request_success             ffn_request_seconds_count (requests the batcher answered)
    nv_inference_request_failure             ffn_failed_request_seconds_count (failed at the batcher)
    nv_inference_count                       ffn_batch_rows_sum (rows computed: a row is an inference)
    nv_inference_exec_count                  ffn_compute_seconds_count (forward passes)
    nv_inference_request_duration_us         ffn_request_seconds_sum
    nv_inference_queue_duration_us           ffn_queue_seconds_sum
    nv_inference_compute_infer_duration_us   ffn_request_compute_seconds_total
    nv_inference_compute_input_duration_us,  0: the copies Triton times there happen inside
    nv_inference_compute_output_duration_us     the forward pass, which compute_infer times whole

Labels are Triton's: `model` and `version` (the version served now: after a load, a model's
series go on under its new version with the totals so far), and `gpu_uuid`. The text is written
here, not by prometheus_client, whose exposition would add `_total` to the counters' names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.metrics_core import Metric

from app.observe.collectors import GpuReading
from app.observe.metrics import samples_by_model

MICROSECONDS = 1e6


@dataclass(frozen=True)
class Series:
    """One of Triton's per-model counters: its name, its help text and the ffn_* sample it reads."""

    name: str
    help: str
    sample: str | None  # None: a time the service does not measure apart (always 0)
    scale: float = 1.0


INFERENCE_SERIES = (
    Series("nv_inference_request_success", "Requests the batcher answered, each counted once whatever its rows.",
           "ffn_request_seconds_count"),
    Series("nv_inference_request_failure",
           "Requests that failed at the batcher (queue full or too large, deadline, client gone, model error, "
           "draining), each counted once.", "ffn_failed_request_seconds_count"),
    Series("nv_inference_count", "Inferences performed: rows computed (a request of n rows counts n).",
           "ffn_batch_rows_sum"),
    Series("nv_inference_exec_count", "Forward passes (batches) run; count / exec_count is the mean batch.",
           "ffn_compute_seconds_count"),
    Series("nv_inference_request_duration_us",
           "Microseconds from each answered request's arrival at the batcher to its answer, summed.",
           "ffn_request_seconds_sum", MICROSECONDS),
    Series("nv_inference_queue_duration_us",
           "Microseconds requests waited in the queue before their batch started, summed.",
           "ffn_queue_seconds_sum", MICROSECONDS),
    Series("nv_inference_compute_input_duration_us",
           "Always 0: the input copies run inside the forward pass, counted in compute_infer.", None),
    Series("nv_inference_compute_infer_duration_us",
           "Microseconds of forward passes summed over answered requests (each its batch's whole pass).",
           "ffn_request_compute_seconds_total", MICROSECONDS),
    Series("nv_inference_compute_output_duration_us",
           "Always 0: the output copies run inside the forward pass, counted in compute_infer.", None),
)  # fmt: skip


@dataclass(frozen=True)
class Gauge:
    name: str
    help: str
    read: Callable[[GpuReading], float | None]


GPU_SERIES = (
    Gauge("nv_gpu_utilization", "GPU utilization, 0.0 to 1.0 (NVML's last sample period).", lambda g: g.utilization),
    Gauge("nv_gpu_memory_total_bytes", "GPU memory of the device, in bytes.", lambda g: g.total_bytes),
    Gauge("nv_gpu_memory_used_bytes", "GPU memory in use on the device by every process, in bytes.",
          lambda g: g.used_bytes),
    Gauge("nv_gpu_power_usage", "GPU power draw, in watts.", lambda g: g.power_watts),
)  # fmt: skip


@dataclass
class TritonNames:
    """Writes Triton's series from a scrape's samples: `versions()` names the models served and their
    version, `gpus()` reads the GPUs this process computes on (app/observe/collectors.py: read_gpus)."""

    versions: Callable[[], Mapping[str, int]]
    gpus: Callable[[], list[GpuReading]]

    def render(self, families: Iterable[Metric]) -> str:
        """Triton's text: each served model's nv_inference_* from `families` (a scrape's), then the GPUs'."""
        return self.inference_text(families) + self.gpu_text()

    def inference_text(self, families: Iterable[Metric]) -> str:
        served = sorted(self.versions().items())
        if not served:
            return ""
        samples = samples_by_model(families)
        lines: list[str] = []
        for series in INFERENCE_SERIES:
            lines += _header(series.name, series.help, "counter")
            for model, version in served:
                value = 0.0 if series.sample is None else samples[model][series.sample] * series.scale
                lines.append(_sample(series.name, {"model": model, "version": str(version)}, round(value)))
        return _text(lines)

    def gpu_text(self) -> str:
        """nv_gpu_* of each GPU read now; a figure NVML could not give is left out, its series too if no GPU has it."""
        gpus = self.gpus()
        lines: list[str] = []
        for gauge in GPU_SERIES:
            known = [(gpu.uuid, value) for gpu in gpus if (value := gauge.read(gpu)) is not None]
            if known:
                lines += _header(gauge.name, gauge.help, "gauge")
                lines += [_sample(gauge.name, {"gpu_uuid": uuid}, value) for uuid, value in known]
        return _text(lines)


def _text(lines: list[str]) -> str:
    return "".join(line + "\n" for line in lines)


def _header(name: str, help_text: str, kind: str) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


def _sample(name: str, labels: Mapping[str, str], value: float) -> str:
    inside = ",".join(f'{key}="{_escape(text)}"' for key, text in sorted(labels.items()))
    return f"{name}{{{inside}}} {_number(value)}"


def _number(value: float) -> str:
    """Whole numbers in digits, as Triton writes them (perf_analyzer's parser reads no exponent: it reads
    8.589934592e+10 bytes as 8), others as Python's shortest repr."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
