"""The journey of one request through a real server: the project files it enters, per door.

Starts `ffn-serve` (one process, on a free port, model control on) under a profiler hook
(`sys.setprofile` and `threading.setprofile`) that records the file of every Python function
called while recording is on, and keeps those of the project (app/, ffn_core/). For each journey
it warms the path up, turns recording on (SIGUSR1), sends one request, waits for its answer,
turns recording off (SIGUSR2, which writes what was recorded), and prints the files entered:

- native binary: POST /v1/models/demo/transform, raw float32 rows in and out;
- V2 JSON: POST /v2/models/demo/infer with JSON tensors;
- gRPC ModelInfer: the same rows over gRPC (raw_input_contents);
- model reload: POST /v2/repository/models/demo/load (the demo model again: a new copy, warmed).

    python3 -m bench.journey             # the table
    python3 -m bench.journey --files     # and each journey's files

What the count measures is layers, not work: each file a request enters is a layer a reader
follows it through (text-embeddings-inference's router takes about five: handler, Infer, queue,
batching task, backend). A background task that wakes while recording (the loop watch, a
heartbeat) is left out by name (BACKGROUND); each journey is recorded three times and the smallest
set kept. Recorded on the event loop's thread, where the request's layers run (sys.setprofile);
the device thread's work is the model's, and the server runs every pass there (inline_forward_us
0), whatever the host's speed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROJECT = (str(ROOT / "app") + os.sep, str(ROOT / "ffn_core") + os.sep)
D_MODEL = 512  # the demo model's
LIMITS = {"native binary": 14, "V2 JSON": 15, "gRPC ModelInfer": 17, "model reload": 19}
# Answers uncompressed, as ffn_client asks: httpx's default Accept-Encoding would have them compressed.
IDENTITY = {"accept-encoding": "identity"}
RECORD_ENV = "FFN_JOURNEY_FILE"  # where the served process writes what it recorded
# Timers that wake on their own whatever the requests do: the loop watch's tick, a worker's heartbeat.
BACKGROUND = frozenset({"LoopWatch._tick", "Control.heartbeat"})


# ----- the served process: a profiler hook around ffn-serve --------------------------------------


def serve(argv: list[str]) -> None:
    """Run ffn-serve with the recording hook (this module run with --serve)."""
    recorded: set[str] = set()
    recording = threading.Event()
    out = Path(os.environ[RECORD_ENV])

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and recording.is_set():
            filename = frame.f_code.co_filename
            if filename.startswith(PROJECT) and frame.f_code.co_qualname not in BACKGROUND:
                recorded.add(
                    filename + (f"::{frame.f_code.co_qualname}" if os.environ.get("FFN_JOURNEY_FUNCTIONS") else "")
                )

    def start(*_: object) -> None:
        recorded.clear()
        recording.set()

    def stop(*_: object) -> None:
        recording.clear()
        out.write_text(json.dumps(sorted(name.removeprefix(str(ROOT) + os.sep) for name in recorded)))

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    # threading.setprofile(hook)
    sys.setprofile(hook)
    from app.cli import main

    sys.argv = ["ffn-serve", *argv]
    main()


# ----- the client: one request per journey, recorded ---------------------------------------------


def _rows(n: int) -> Any:
    import numpy as np

    return np.random.default_rng(0).standard_normal((n, D_MODEL)).astype(np.float32)


async def _native(server: Any) -> None:
    import httpx

    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        headers = {"content-type": "application/octet-stream", "accept": "application/octet-stream"}
        headers |= IDENTITY
        response = await client.post(
            "/v1/models/demo/transform", content=_rows(4).tobytes(), headers={**headers, "x-shape": f"4,{D_MODEL}"}
        )
        assert response.status_code == 200, response.text


async def _v2_json(server: Any) -> None:
    import httpx

    x = _rows(4)
    body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        response = await client.post("/v2/models/demo/infer", json=body, headers=IDENTITY)
        assert response.status_code == 200, response.text


async def _grpc(server: Any) -> None:
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc

    x = _rows(4)
    request = pb.ModelInferRequest(model_name="demo", raw_input_contents=[x.tobytes()])
    request.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    async with grpc.aio.insecure_channel(server.grpc_target) as channel:
        await service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=60)


async def _reload(server: Any) -> None:
    import httpx

    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        response = await client.post("/v2/repository/models/demo/load", json={}, headers=IDENTITY)
        assert response.status_code == 200, response.text


JOURNEYS = {"native binary": _native, "V2 JSON": _v2_json, "gRPC ModelInfer": _grpc, "model reload": _reload}


async def _record(server: Any, out: Path, send: Any) -> list[str]:
    out.unlink(missing_ok=True)
    os.kill(server.proc.pid, signal.SIGUSR1)
    await asyncio.sleep(0.05)  # the handler runs between the server's bytecodes: let it
    await send(server)
    os.kill(server.proc.pid, signal.SIGUSR2)
    for _ in range(200):
        if out.exists() and out.stat().st_size:
            return list(json.loads(out.read_text()))
        await asyncio.sleep(0.02)
    raise RuntimeError("the served process wrote nothing: is it the journey wrapper?")


async def journeys(rounds: int = 3, *, functions: bool = False) -> dict[str, list[str]]:
    """Each journey's project files: the smallest of `rounds` recordings (background wake-ups excluded).

    `functions`: each function entered (file::name) instead of each file, to see why a file is entered.
    """
    from ffn_testing import start_server

    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "recorded.json"
        env = {RECORD_ENV: str(out), "FFN_MODEL_CONTROL": "explicit", "FFN_LOG_LEVEL": "warning"}
        # The pass on the device's thread, as on a GPU and for any pass over inline_forward_us: on
        # the loop's thread its files (runner, graphs, staging, ffn_core's model: the model's work,
        # not a layer) were recorded or not by how fast the host ran the start's timing pass.
        env |= {"FFN_INLINE_FORWARD_US": "0"}
        env |= {"FFN_JOURNEY_FUNCTIONS": "1"} if functions else {}
        command = [sys.executable, "-m", "bench.journey", "--serve"]
        with start_server(env=env, command=command, cwd=ROOT) as server:
            found: dict[str, list[str]] = {}
            for name, send in JOURNEYS.items():
                for _ in range(3):  # warm: imports, caches and first-call paths are not the journey
                    await send(server)
                recordings = [await _record(server, out, send) for _ in range(rounds)]
                found[name] = min(recordings, key=len)
                time.sleep(0.1)
            return found


def table(found: dict[str, list[str]]) -> str:
    lines = ["| journey | project files entered | at most |", "|---|---|---|"]
    lines += [f"| {name} | {len(files)} | {LIMITS[name]} |" for name, files in found.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--serve"]:
        serve(args[1:])
        return 0
    parser = argparse.ArgumentParser(prog="python3 -m bench.journey", description=__doc__.splitlines()[0])
    parser.add_argument("--files", action="store_true", help="list each journey's files")
    parser.add_argument("--functions", action="store_true", help="list each function entered (and count those)")
    options = parser.parse_args(args)
    found = asyncio.run(journeys(functions=options.functions))
    print(table(found))
    if options.files or options.functions:
        for name, files in found.items():
            print(f"\n{name} ({len(files)}):")
            print("\n".join(f"  {file}" for file in files))
    return 0 if all(len(files) <= LIMITS[name] for name, files in found.items()) else 1


if __name__ == "__main__":
    sys.exit(main())
