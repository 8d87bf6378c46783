"""ffn-serve against mosec, the best general framework on this workload, in one run: rows/s over HTTP.

    python -m bench.mosec_baseline                                  # r = 16, C = 16, 3 alternating rounds
    python -m bench.mosec_baseline --rows 1 16 --concurrency 16 64 --repeats 5 --json out/mosec.json

The same model (768/3072 GELU float32 unless told) is served by ffn-serve (its native route, JSON and
binary bodies) and by mosec (bench/mosec_app.py: one worker, mosec's dynamic batching, JSON both
ways), each pinned to the server core with one torch thread, each loaded in turn by wrk from the
client core with the same JSON body. Rounds alternate between the servers, and each cell's median
is reported with its range; before any load, each server's answer to one request is checked
against the model run in this process. Needs `wrk` and `pip install 'ffn-serve[bench]'` (mosec).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import median

import httpx
import numpy as np
import torch

from bench.serve import REPO_ROOT, pinned, request_body, run_wrk, server_env
from ffn_client.encodings import encode_request
from ffn_core import FFNConfig, build_ffn, save_ffn
from ffn_testing import start_server

MOSEC_PORT = 18_431


@dataclass
class Cell:
    server: str  # "ffn-serve" or "mosec" (with its JSON library)
    encoding: str
    rows_per_request: int
    concurrency: int
    round: int
    rows_per_s: float
    p50_ms: float
    p99_ms: float
    errors: int


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[16])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--d-ff", type=int, default=3072)
    parser.add_argument("--mosec-json", nargs="+", choices=("orjson", "stdlib"), default=["orjson"])
    parser.add_argument("--server-cpus", default="0")
    parser.add_argument("--client-cpus", default="1")
    parser.add_argument("--json", type=Path, help="write the cells here")
    return parser.parse_args(argv)


@contextlib.contextmanager
def mosec_server(weights: Path, json_library: str, cpus: str) -> Iterator[str]:
    """bench/mosec_app.py on MOSEC_PORT, pinned to `cpus`, ready; its base URL. Stopped after the block."""
    env = os.environ | {"FFN_WEIGHTS": str(weights), "FFN_MOSEC_JSON": json_library, "OMP_NUM_THREADS": "1"}
    command = [*pinned(cpus), sys.executable, "-m", "bench.mosec_app"]
    command += ["--address", "127.0.0.1", "--port", str(MOSEC_PORT), "--log-level", "warning", "--timeout", "30000"]
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{MOSEC_PORT}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"mosec exited {process.returncode}: {process.stderr.read().decode()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("mosec was not ready within 120 s")
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def check_answer(url: str, body: bytes, headers: dict[str, str], expected: np.ndarray, key: str) -> None:
    """One request's answer, JSON, against the model run here: a wrong server is not measured."""
    response = httpx.post(url, content=body, headers=headers, timeout=30)
    response.raise_for_status()
    got = np.asarray(response.json()[key], dtype=np.float32).reshape(expected.shape)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def measure(args: argparse.Namespace, folder: Path) -> list[Cell]:
    torch.manual_seed(0)
    model = build_ffn(FFNConfig(args.d_model, args.d_ff, "gelu")).requires_grad_(False)
    weights = folder / "ffn.safetensors"
    save_ffn(model, weights)
    (folder / "ffn.toml").write_text('[[models]]\nname = "ffn"\nweights = "ffn.safetensors"\n')
    cells: list[Cell] = []

    def load(server: str, url: str, encoding: str, rows: int, concurrency: int, round_: int) -> None:
        body, headers = request_body(encoding, rows, args.d_model, folder)
        run_wrk(url, body, headers, concurrency, 1, args.client_cpus)  # warm-up
        result = run_wrk(url, body, headers, concurrency, args.seconds, args.client_cpus)
        seconds = result["duration_us"] / 1e6
        ok = result["requests"] - result["status_errors"]
        cell = Cell(
            server,
            encoding,
            rows,
            concurrency,
            round_,
            ok * rows / seconds,
            result["p50_us"] / 1000,
            result["p99_us"] / 1000,
            result["status_errors"] + result["socket_errors"],
        )
        cells.append(cell)
        print(
            f"round {round_}: {server} {encoding} r={rows} C={concurrency}: {cell.rows_per_s:,.0f} rows/s", flush=True
        )

    def answers_right(url: str, rows: int) -> None:
        """A JSON request of `rows` rows, answered as the model here answers it: a wrong server is not measured."""
        x = np.random.default_rng(rows).standard_normal((rows, args.d_model)).astype(np.float32)
        with torch.inference_mode():
            expected = model(torch.from_numpy(x)).numpy()
        request = encode_request("ffn", x, "json")
        check_answer(url, request.body, dict(request.headers), expected, "outputs")

    for round_ in range(1, args.repeats + 1):
        with start_server(
            server_env(0.0, 1024), folder / "ffn.toml", prefix=pinned(args.server_cpus), ready_timeout=120.0
        ) as served:
            url = f"{served.url}/v1/models/ffn/transform"
            for rows in args.rows:
                answers_right(url, rows)
                for encoding in ("json", "binary"):
                    for concurrency in args.concurrency:
                        load("ffn-serve", url, encoding, rows, concurrency, round_)
        for library in args.mosec_json:
            with mosec_server(weights, library, args.server_cpus) as base:
                url = f"{base}/inference"
                for rows in args.rows:
                    answers_right(url, rows)
                    for concurrency in args.concurrency:
                        load(f"mosec ({library})", url, "json", rows, concurrency, round_)
    return cells


def table(cells: list[Cell]) -> str:
    """Each server and cell: median rows/s (range), p50 and p99 medians, errors; then ffn-serve as a multiple of mosec."""
    lines = [
        "| server | encoding | r | C | rows/s, median (range) | p50 ms | p99 ms | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    groups: dict[tuple[str, str, int, int], list[Cell]] = {}
    for cell in cells:
        groups.setdefault((cell.server, cell.encoding, cell.rows_per_request, cell.concurrency), []).append(cell)
    medians = {}
    for (server, encoding, rows, concurrency), group in groups.items():
        rates = [c.rows_per_s for c in group]
        medians[server, encoding, rows, concurrency] = median(rates)
        lines.append(
            f"| {server} | {encoding} | {rows} | {concurrency} | {median(rates):,.0f} ({min(rates):,.0f}–{max(rates):,.0f}) "
            f"| {median(c.p50_ms for c in group):.2f} | {median(c.p99_ms for c in group):.2f} "
            f"| {sum(c.errors for c in group)} |"
        )
    lines += ["", "| r | C | baseline | ffn-serve JSON × | ffn-serve binary × |", "|---:|---:|---|---:|---:|"]
    for server, encoding, rows, concurrency in medians:
        if server.startswith("mosec"):
            base = medians[server, encoding, rows, concurrency]
            ours_json = medians.get(("ffn-serve", "json", rows, concurrency), float("nan"))
            ours_binary = medians.get(("ffn-serve", "binary", rows, concurrency), float("nan"))
            lines.append(f"| {rows} | {concurrency} | {server} | {ours_json / base:.1f} | {ours_binary / base:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not shutil.which("wrk"):
        print("bench.mosec_baseline needs wrk (apt-get install wrk)", file=sys.stderr)
        return 2
    try:
        import mosec  # noqa: F401
    except ImportError:
        print("bench.mosec_baseline needs mosec: pip install 'ffn-serve[bench]'", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        cells = measure(args, Path(tmp))
    print()
    print(table(cells))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"cells": [asdict(c) for c in cells]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
