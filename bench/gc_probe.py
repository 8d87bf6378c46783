"""ffn-serve with every garbage-collector pass timed: `python -m bench.gc_probe [ffn-serve flags]`.

For bench/tail.py. Each pass's start (time.time()), generation and duration go to the JSON file
named by BENCH_GC_LOG when the server exits. BENCH_GC_FREEZE=0 turns the server's gc.freeze()
into a no-op, to measure the service as it was without it.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import sys
import time
from typing import Any

PAUSES: list[tuple[float, int, float]] = []  # (start, generation, seconds)
_started = [0.0, 0.0]


def _time_pass(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _started[:] = [time.time(), time.perf_counter()]
    else:
        PAUSES.append((_started[0], info["generation"], time.perf_counter() - _started[1]))


def _write() -> None:
    with open(os.environ["BENCH_GC_LOG"], "w") as f:
        json.dump(PAUSES, f)


if __name__ == "__main__":
    gc.callbacks.append(_time_pass)
    atexit.register(_write)
    if os.environ.get("BENCH_GC_FREEZE") == "0":
        gc.freeze = lambda: None
    from app.cli import main

    sys.exit(main(sys.argv[1:]))
