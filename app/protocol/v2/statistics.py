"""The statistics extension's answer, in Triton's shape, read from the Prometheus registry's samples.

No counters of its own: every number is a sample that /metrics exports too, read through
`registry.collect()`, so the two always agree (and stay right wherever the samples come from).
Samples of one model are summed over any other label, but the last-inference time, which is
the latest.

compute_input and compute_output count every successful request, as Triton's do (perf_analyzer
refuses statistics whose three compute counts differ), with zero time: what Triton times there
(gathering a batch's inputs and copying them to the device, copying the outputs back) happens
inside the forward pass, which compute_infer times whole. Decoding and encoding the HTTP body
are not counted there either: they fall outside `success` (from arrival at the batcher to the
answer), and queue + compute must stay within success for perf_analyzer's server overhead.
What the service does not have is zero, never invented: the response cache, batch_stats (no
per-batch-size timings) and response_stats.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry

from app.engine.facade import ModelFacade
from app.observe.metrics import samples_by_model

_NOT_MEASURED = {"count": 0, "ns": 0}


def model_stats(registry: CollectorRegistry, models: Iterable[ModelFacade]) -> dict[str, list[dict[str, Any]]]:
    """{"model_stats": [...]}: one entry per model, version 1."""
    samples = samples_by_model(registry.collect())
    return {"model_stats": [_model_stat(served, samples[served.name]) for served in models]}


def _duration(count: float, seconds: float) -> dict[str, int]:
    return {"count": int(count), "ns": round(seconds * 1e9)}


def _model_stat(served: ModelFacade, s: defaultdict[str, float]) -> dict[str, Any]:
    succeeded = s["ffn_request_seconds_count"]
    return {
        "name": served.name,
        "version": str(served.version),
        "last_inference": round(s["ffn_last_inference_timestamp_seconds"] * 1000),  # ms since the epoch; 0: never
        "inference_count": int(s["ffn_batch_rows_sum"]),  # rows computed: each row is one inference
        "execution_count": int(s["ffn_compute_seconds_count"]),  # forward passes
        "inference_stats": {
            "success": _duration(succeeded, s["ffn_request_seconds_sum"]),
            "fail": _duration(s["ffn_failed_request_seconds_count"], s["ffn_failed_request_seconds_sum"]),
            "queue": _duration(s["ffn_queue_seconds_count"], s["ffn_queue_seconds_sum"]),
            # Inside compute_infer's forward pass: counted per request, with no time of their own.
            "compute_input": _duration(succeeded, 0.0),
            # As in Triton, per request: each request counts its batch's whole forward pass.
            "compute_infer": _duration(succeeded, s["ffn_request_compute_seconds_total"]),
            "compute_output": _duration(succeeded, 0.0),
            "cache_hit": _NOT_MEASURED,
            "cache_miss": _NOT_MEASURED,
        },
        "response_stats": {},
        "batch_stats": [],
        "memory_usage": [_memory_usage(served)],
        "digest": served.digest,  # HTTP's JSON; gRPC's ModelStatistics has no field for it
    }


def _memory_usage(served: ModelFacade) -> dict[str, Any]:
    """The weights' bytes on their device, as Triton reports a model's memory at load."""
    device = served.device
    return {
        "type": "GPU" if device.type == "cuda" else "CPU",
        "id": device.index or 0,
        "byte_size": served.weight_bytes,
    }
