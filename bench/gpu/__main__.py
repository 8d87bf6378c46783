"""The GPU benchmark in one command: the model in-process, the service by workers against the echo baseline, the targets.

    bash bench/gpu/run.sh                          # on the GPU machine: the CUDA tests, then this
    python3 -m bench.gpu --out bench/gpu/results   # this alone
    python3 -m bench.gpu --quick --out /tmp/q      # seconds on any CPU: proves the command still runs

Writes into --out: inprocess.json, service.json, targets.json, report.md (the markdown for
docs/benchmarks.md, also printed last), gpu.png and, with --profile, profile.txt.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from app.config.settings import Settings
from bench.gpu import inprocess, report, service
from ffn_core import FFNConfig, build_ffn, save_ffn


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python3 -m bench.gpu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="a tiny run of every part (CPU tests run it)")
    p.add_argument("--out", type=Path, default=Path("bench/gpu/results"), help="results folder")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--d-ff", type=int, default=3072)
    p.add_argument("--activation", default="gelu")
    p.add_argument("--gated", action="store_true", help="gated (GLU) variant: the fused W1‖V path")
    p.add_argument(
        "--modes", default=",".join(inprocess.MODES), help="comma-separated, of " + ",".join(inprocess.MODES)
    )
    p.add_argument("--max-rows", type=int, default=16384, help="in-process batch rows go 1, 2, 4, ... up to this")
    p.add_argument("--budget", type=float, default=0.2, help="seconds of timing per in-process cell")
    p.add_argument("--workers", default="1,2,4,8", help="comma-separated worker counts for the service")
    p.add_argument("--rows", default="1,16,256", help="comma-separated rows per request for the service")
    p.add_argument("--concurrency", type=int, default=64, help="connections of every throughput cell")
    p.add_argument("--seconds", type=float, default=4.0, help="measured seconds per service cell")
    p.add_argument(
        "--service-dtype",
        default=None,
        help="compute dtype of the served model (default: bfloat16 "
        "on a GPU, float32 on a CPU); the clients send float32",
    )
    p.add_argument("--cores", type=int, help="use only the first N cores: half serve, half load")
    p.add_argument("--peak-tflops", type=float, help="dense bf16 peak, for a GPU the table does not know")
    p.add_argument("--profile", action="store_true", help="torch.profiler tables of a bf16 forward at 8192 rows")
    p.add_argument(
        "--shared-engine",
        action="store_true",
        help="also serve as N fronts and one engine process (server ffn+engine, issue 30) at each worker count",
    )
    p.add_argument("--skip-inprocess", action="store_true")
    p.add_argument("--skip-service", action="store_true")
    p.add_argument(
        "--generator",
        choices=["auto", "wrk", "ffn-loadtest"],
        default="auto",
        help="load generator; auto: wrk where it is installed, else ffn-loadtest",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.d_model, args.d_ff, args.max_rows, args.budget = 64, 256, 4, 0.01
        args.modes, args.workers, args.rows = "float32,bfloat16", "1", "16"
        args.concurrency, args.seconds = 4, 0.5
    if args.generator == "auto":
        args.generator = "wrk" if shutil.which("wrk") else "ffn-loadtest"
    return args


def environment(device: torch.device, generator: str) -> dict:
    cuda = device.type == "cuda"
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if cuda else f"CPU ({platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "load_generator": generator,
        "load_average": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
    }


def save_cells(cells: list, path: Path) -> None:
    """Write measured cells (dataclasses) as JSON, replacing the file whole so a reader never sees half of it."""
    partial = path.with_suffix(".json.part")
    partial.write_text(json.dumps([dataclasses.asdict(c) for c in cells], indent=1))
    partial.replace(path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = (
        torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if args.device == "auto"
        else torch.device(args.device)
    )
    args.out.mkdir(parents=True, exist_ok=True)
    config = FFNConfig(args.d_model, args.d_ff, args.activation, gated=args.gated)
    torch.manual_seed(0)
    base = build_ffn(config).requires_grad_(False)
    rows_list = [2**i for i in range(args.max_rows.bit_length()) if 2**i <= args.max_rows]
    workers = [int(w) for w in args.workers.split(",")]
    notes = []
    if "workers" not in Settings.model_fields and any(w > 1 for w in workers):
        notes.append("this build has no `workers` setting (FFN_WORKERS): the service ran at 1 worker only")
        workers = [1]
    env = environment(device, args.generator)
    print(f"bench.gpu: {env}", flush=True)

    cells: list[inprocess.Cell] = []
    if not args.skip_inprocess:
        cells = inprocess.measure(
            base, args.modes.split(","), rows_list, device, args.budget, progress=lambda line: print(line, flush=True)
        )
        save_cells(cells, args.out / "inprocess.json")
    drift: list[inprocess.Invariance] = []
    if not args.skip_inprocess:
        for compute in (torch.float32, torch.bfloat16):
            drift += inprocess.invariance(base, device, compute)
        save_cells(drift, args.out / "invariance.json")
    if args.profile:
        text = inprocess.profile_forward(base, "bfloat16", min(8192, args.max_rows), device)
        (args.out / "profile.txt").write_text(text)

    service_cells: list[service.ServiceCell] = []
    if not args.skip_service:
        dtype = args.service_dtype or ("bfloat16" if device.type == "cuda" else "float32")
        with tempfile.TemporaryDirectory() as tmp:
            weights = Path(tmp) / "ffn.safetensors"
            save_ffn(base, weights)
            service_cells = service.measure(
                weights,
                dtype,
                args.d_model,
                workers,
                [int(r) for r in args.rows.split(",")],
                args.concurrency,
                args.seconds,
                args.cores,
                args.generator,
                progress=lambda line: print(line, flush=True),
                measured=lambda so_far: save_cells(so_far, args.out / "service.json"),
                servers=("ffn", service.SHARED, "echo") if args.shared_engine else ("ffn", "echo"),
            )
        env["service_dtype"] = dtype

    peak = args.peak_tflops or report.bf16_peak_tflops(env["device"])
    found = report.targets(cells, service_cells, env["device"], peak, args.concurrency)
    (args.out / "targets.json").write_text(json.dumps([dataclasses.asdict(t) for t in found], indent=1))
    markdown = render(args, env, config, cells, drift, service_cells, found, notes)
    (args.out / "report.md").write_text(markdown)
    if cells or service_cells:
        report.plot(cells, service_cells, args.out / "gpu.png")
    print()
    print(markdown)
    return 0


def render(
    args: argparse.Namespace,
    env: dict,
    config: FFNConfig,
    cells: list[inprocess.Cell],
    drift: list[inprocess.Invariance],
    service_cells: list[service.ServiceCell],
    found: list[report.Target],
    notes: list[str],
) -> str:
    """report.md: what ran where, the tables, the targets."""
    server_cores, client_cores = service.split_cores(args.cores)
    parts = [
        f"Machine: {env['device']}, torch {env['torch']}"
        + (f" (CUDA {env['cuda']})" if env["cuda"] else "")
        + f", {env['cpus']} CPUs, Python {env['python']}; {env['date']}; 1-min load average {env['load_average']} "
        "at the start.",
        f"Model: {config.variant} FFN, d_model {config.d_model}, d_ff {config.d_ff}.",
        "",
        "### In-process rows/s (eager, CUDA graphs, and the runner from float32 host rows)",
        "",
        report.inprocess_table(cells) if cells else "(skipped)",
        "",
        "### A row batched against the same row alone (batch sizes 2 to 1000, several positions)",
        "",
        report.invariance_table(drift) if drift else "(skipped)",
        "",
        f"### The service against the echo baseline (binary float32 requests, served model in "
        f"{env.get('service_dtype', '-')})",
        "",
        f"Server on cores {server_cores[0]}-{server_cores[-1]}, load generator ({env['load_generator']}) on cores "
        f"{client_cores[0]}-{client_cores[-1]}; {args.seconds:g} s per cell after a {service.warm_up_seconds(args.seconds):g} s warm-up; closed loop with "
        f"C connections.",
        "",
        report.service_table(service_cells) if service_cells else "(skipped)",
        "",
        "### Targets",
        "",
        report.targets_table(found),
    ]
    parts += [f"\nNote: {note}." for note in notes]
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    sys.exit(main())
