"""What torch's small CPU calls cost warm, and cold: after other memory traffic, as they run in the server.

    python -m bench.cold                   # one torch thread, the medians of 300 timings each
    taskset -c 0 python -m bench.cold      # on the server core, as bench.transport pins the server

In the server, the near-free model's pass takes several times what the same pass takes in a
loop: between two batches the requests' own work (and the host's other processes) leave torch's
code and data out of the caches. Each call here is timed warm (back to back) and cold (after a
sweep over `--sweep-mib` MiB of other memory), the median of `--repeat` timings. Among them,
GELU with oneDNN on (torch's default for float32 on the CPU) and off (ATen's own kernel), on the
near-free model's hidden layer and on the real model's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F

from ffn_core import FFNConfig, build_ffn


@dataclass(frozen=True)
class Timing:
    call: str
    warm_us: float
    cold_us: float


@contextmanager
def onednn(enabled: bool) -> Iterator[None]:
    previous = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = enabled
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = previous


def median_us(call: Callable[[], object], repeat: int, sweep: np.ndarray | None) -> float:
    """The median time of `call`, each after a pass over `sweep` when given (cold), else back to back (warm)."""
    times = []
    for _ in range(repeat):
        if sweep is not None:
            sweep.sum()
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def calls() -> list[tuple[str, bool, Callable[[], object]]]:
    """(name, oneDNN on, call) for each call timed."""
    torch.manual_seed(0)
    near_free = build_ffn(FFNConfig(768, 8, "gelu")).requires_grad_(False)
    x = torch.randn(16, 768)
    small, large = torch.randn(16, 8), torch.randn(256, 3072)
    return [
        ("near-free model's pass, 16 rows", True, lambda: near_free(x)),
        ("x + 1, 16 x 768", True, lambda: x + 1),
        ("GELU, 16 x 8, oneDNN", True, lambda: F.gelu(small)),
        ("GELU, 16 x 8, ATen", False, lambda: F.gelu(small)),
        ("GELU, 256 x 3072, oneDNN", True, lambda: F.gelu(large)),
        ("GELU, 256 x 3072, ATen", False, lambda: F.gelu(large)),
    ]


def measure(repeat: int, sweep_mib: float) -> list[Timing]:
    sweep = np.ones(int(sweep_mib * 2**20) // 8)
    timings = []
    with torch.inference_mode():
        for name, enabled, call in calls():
            with onednn(enabled):
                call()  # untimed: the first call builds what later ones reuse
                warm = median_us(call, repeat, None)
                cold = median_us(call, repeat, sweep)
            timings.append(Timing(name, warm, cold))
    return timings


def table(timings: list[Timing]) -> str:
    lines = ["| call | warm µs | cold µs | cold ÷ warm |", "|---|---:|---:|---:|"]
    for t in timings:
        lines.append(f"| {t.call} | {t.warm_us:,.1f} | {t.cold_us:,.1f} | {t.cold_us / t.warm_us:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=300)
    parser.add_argument("--sweep-mib", type=float, default=2.0, help="memory swept between cold calls")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the server runs one)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {args.threads} thread(s); medians of {args.repeat}; cold: after {args.sweep_mib:g} MiB swept"
    )
    print()
    print(table(measure(args.repeat, args.sweep_mib)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
