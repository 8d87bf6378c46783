"""A native request body's decode and its answer's encode, in-process: µs per request by encoding and rows.

    python -m bench.codec                               # r in {1, 16, 256}, d_model 768, JSON and raw
    python -m bench.codec --against ../before --repeat 5  # and another checkout's, in alternating rounds

No HTTP and no model: the protocol core alone (app/protocol/native.py), as the lean path and the
full path call it, on one float32 body per cell. Each round runs in a process of its own (for
`--against`, with the other checkout's `app` first on its path); each cell is the median of a
round's timings, and the table shows the median of the rounds with their range.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import timeit
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
D_MODEL = 768


def one_round(rows_list: list[int], encodings: list[str], seconds: float) -> dict[str, dict[str, float]]:
    """µs per decode and per encode for each cell, in this process (whose `app` is the checkout measured)."""
    import numpy as np
    import orjson

    from app.protocol import native

    cells: dict[str, dict[str, float]] = {}
    for rows in rows_list:
        x = np.random.default_rng(rows).standard_normal((rows, D_MODEL)).astype(np.float32)
        for encoding in encodings:
            if encoding == "json":
                body = orjson.dumps({"inputs": x.tolist()})

                def decode(body: bytes = body) -> object:
                    return native.decode_json(body, D_MODEL, 1 << 20)

            else:
                body = x.tobytes()
                layout = native.raw_layout(f"{rows},{D_MODEL}", "float32", D_MODEL)

                def decode(body: bytes = body, layout: native.RawLayout = layout) -> object:
                    return layout.rows_of(body)

            decoded = decode()
            output = x * 2  # an answer of the same shape, not a view of the request

            def encode(decoded: object = decoded, encoding: str = encoding, output: np.ndarray = output) -> object:
                return native.encode("ffn", output, decoded, encoding)  # type: ignore[arg-type]

            cells[f"{encoding} r={rows}"] = {
                "decode_us": _median_us(decode, seconds),
                "encode_us": _median_us(encode, seconds),
            }
    return cells


def _median_us(work: object, seconds: float, runs: int = 5) -> float:
    """The median of `runs` timings of `work`, each of as many calls as fill a `runs`-th of `seconds`."""
    timer = timeit.Timer(work)  # type: ignore[arg-type]
    once = timer.timeit(1)
    number = max(1, int(seconds / runs / max(once, 1e-9)))
    return statistics.median(t / number for t in timer.repeat(runs, number)) * 1e6


def run_round(checkout: Path, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """One round in a fresh process whose `app` is `checkout`'s."""
    code = (
        "import json, runpy, sys; sys.path.insert(0, sys.argv[1]); "
        "module = runpy.run_path(sys.argv[2]); "
        "print(json.dumps(module['one_round'](json.loads(sys.argv[3]), json.loads(sys.argv[4]), float(sys.argv[5]))))"
    )
    command = [
        sys.executable,
        "-c",
        code,
        str(checkout.resolve()),
        str(Path(__file__).resolve()),
        json.dumps(args.rows),
        json.dumps(args.encodings),
        str(args.seconds),
    ]
    out = subprocess.run(command, capture_output=True, text=True, check=True, cwd=checkout).stdout
    return json.loads(out.strip().splitlines()[-1])


def table(results: dict[str, list[dict[str, dict[str, float]]]]) -> str:
    names = list(results)
    lines = [
        "| cell | " + " | ".join(f"{name}: decode µs | {name}: encode µs" for name in names) + " |",
        "|---|" + "---:|---:|" * len(names),
    ]
    for cell in results[names[0]][0]:
        figures = []
        for name in names:
            for stage in ("decode_us", "encode_us"):
                values = [round_[cell][stage] for round_ in results[name]]
                figures.append(f"{statistics.median(values):,.1f} ({min(values):,.1f}–{max(values):,.1f})")
        lines.append(f"| {cell} | " + " | ".join(figures) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--encodings", nargs="+", choices=("json", "raw"), default=["json", "raw"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=1.0, help="timing per cell and round, about")
    parser.add_argument("--against", type=Path, help="another checkout, measured in the same rounds")
    args = parser.parse_args(argv)
    checkouts = {"this": REPO_ROOT} | ({"other": args.against} if args.against else {})
    results: dict[str, list[dict[str, dict[str, float]]]] = {name: [] for name in checkouts}
    for round_ in range(1, args.repeat + 1):
        for name, checkout in checkouts.items():
            results[name].append(run_round(checkout, args))
            print(f"round {round_}: {name} measured", file=sys.stderr, flush=True)
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
