"""Where a request's CPU goes, stage by stage: py-spy samples of a server under load, classified.

`record(pid, seconds, ...)` runs `py-spy record --nonblocking -f raw` against a running server
(sampling without pausing it; py-spy itself runs on the client cores); `classify(text)` turns
its collapsed stacks into samples per stage; `breakdown(samples, cpu_ms_per_request)` spreads
the server's measured CPU per request over the stages in proportion. Each sample goes to the
stage of its innermost frame that names one (STAGES, in order of precedence within a frame):
the model's own frames are `compute` wherever they are called from, the finiteness check of the
input is `decode` and that of the answer `encode`, and so on. py-spy counts a thread only while
it is not idle (its own heuristic), so the shares are of busy time.

The stages follow a request's path (docs/architecture.md): read, decode, admission, batch
assembly, the hop to the device thread and back, compute, split, encode, write; beside them the
metrics, the hand-off between a front and an engine process (shared_engine), the edge (guard,
fast path, handler), uvicorn's protocol and the event loop itself.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

# (stage, function names, places in a file path); a frame whose function is named, or whose file
# path holds a place, matches. Within one frame the first rule that matches names the stage.
Rule = tuple[str, frozenset[str], tuple[str, ...]]
STAGES: list[Rule] = [
    (
        "read",
        frozenset({"read_body", "Request.stream", "RequestResponseCycle.receive", "HttpToolsProtocol.on_body"}),
        (),
    ),
    (
        "decode",
        frozenset(
            {
                "_decode",
                "decode",
                "decode_raw",
                "decode_json",
                "decode_npy",
                "view_rows",
                "check_finite",
                "request_encoding",
                "response_encoding",
                "check_content",
                "parse_shape_header",
                "parse_dtype_header",
                "NativePlan.decode",
                "RawLayout.rows_of",
                "native_plan",
                "raw_layout",
            }
        ),
        (),
    ),
    ("compute", frozenset({"ModelRunner.launch", "ModelRunner._forward_plain"}), ("ffn_core/", "torch/nn/modules/")),
    ("split", frozenset({"Batcher._split"}), ()),
    (
        "encode",
        frozenset(
            {
                "encode",
                "answer_as_array",
                "check_finite_output",
                "raw_bytes",
                "Response.__init__",
                "Response.init_headers",
                "Response.render",
                "NativePlan.encode",
            }
        ),
        (),
    ),
    (
        "write",
        frozenset({"RequestResponseCycle.send", "Response.__call__", "LeanRequest._answer", "LeanDoor.head"}),
        (),
    ),
    (
        "metrics",
        frozenset(
            {
                "Counting.__exit__",
                "Outcomes.counter",
                "Batcher._count_pass",
                "count_failure",
                "observe_many",
                "LeanDoor.ended",
                "LeanDoor._flush",
            }
        ),
        ("prometheus_client/",),
    ),
    (
        "device-thread handoff",
        frozenset(
            {
                "ThreadPoolExecutor.submit",
                "_worker",
                "run_in_executor",
                "wrap_future",
                "_chain_future",
                "_copy_future_state",
                "_call_set_state",
                "call_soon_threadsafe",
            }
        ),
        (),
    ),
    (
        "batch assembly",
        frozenset(
            {
                "Batcher._collect",
                "Batcher._run",
                "Batcher._in_slot",
                "Batcher._compute",
                "WorkQueue.take",
                "ModelRunner._gather_on_host",
            }
        ),
        (),
    ),
    (
        "admission",
        frozenset(
            {
                "Batcher.submit",
                "Batcher._admit",
                "Batcher._answer",
                "WorkQueue.push",
                "ServedModel.infer",
                "ServedModel.infer_soon",
                "Batcher.submit_soon",
                "Batcher.submit_array",
                "ServedModel.check_serving",
                "deadline_from",
                "unless_disconnected",
            }
        ),
        (),
    ),
    # A front's and an engine's side of the hand-off between them (shared_engine): the messages,
    # the arena's copies, the engine's grouping of a frame's requests.
    ("hand-off", frozenset(), ("app/handoff/",)),
    (
        "edge: guard, fast path, handler",
        frozenset(),
        (
            "app/http/edge.py",
            "app/http/endpoints.py",
            "app/http/native/routes.py",
            "app/http/v2/routes.py",
            "app/http/transport/lean.py",
            "starlette/",
            "fastapi/",
            "bench/gpu/echo.py",
        ),
    ),
    ("HTTP protocol (uvicorn)", frozenset(), ("uvicorn/", "app/http/transport/protocol.py", "httptools")),
    ("event loop", frozenset({"Runner.run"}), ("asyncio/", "uvloop", "runners.py", "selectors.py")),
]
ORDER = [stage for stage, _, _ in STAGES] + ["other"]

_FRAME = re.compile(r"^(?P<function>.*?) \((?P<where>.*)\)$")


def stage_of(frames: list[str]) -> str:
    """The stage of one stack (outermost frame first), from its innermost frame that matches a rule."""
    for frame in reversed(frames):
        match = _FRAME.match(frame)
        function, where = (match["function"], match["where"]) if match else (frame, "")
        for stage, names, places in STAGES:
            if function in names or any(place in where for place in places):
                return stage
    return "other"


def classify(raw: str) -> Counter[str]:
    """Samples per stage from py-spy's raw (collapsed) output: one `frame;frame;... count` per line."""
    samples: Counter[str] = Counter()
    for line in raw.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        if frames and frames[0].startswith("thread ("):
            frames = frames[1:]  # --threads: the thread's name comes first
        samples[stage_of(frames)] += int(count)
    return samples


def breakdown(samples: Counter[str], cpu_ms_per_request: float) -> dict[str, tuple[float, float]]:
    """stage -> (share of the samples, µs of CPU per request), in ORDER; the shares add up to 1."""
    total = sum(samples.values())
    if total == 0:
        return {}
    return {
        stage: (samples[stage] / total, 1000.0 * cpu_ms_per_request * samples[stage] / total)
        for stage in ORDER
        if samples[stage]
    }


def py_spy() -> str | None:
    """The py-spy command: beside this interpreter (a virtual environment's bin), else on the PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


@dataclass
class Recording:
    """A py-spy run in progress and the file it writes its stacks to."""

    process: subprocess.Popen[str]
    path: Path

    def finish(self) -> str:
        """Wait for py-spy and return its raw stacks; RuntimeError with py-spy's words if it could not sample."""
        _, error = self.process.communicate(timeout=120)
        try:
            raw = self.path.read_text()
        finally:
            self.path.unlink(missing_ok=True)
        if self.process.returncode != 0 or not raw:
            raise RuntimeError(f"py-spy failed ({self.process.returncode}): {error.strip()[-500:]}")
        return raw


def record(pid: int, seconds: float, prefix: list[str], rate: int = 250) -> Recording:
    """Start sampling `pid` for `seconds`, py-spy behind `prefix` (e.g. taskset for the client cores)."""
    command = py_spy()
    if command is None:
        raise FileNotFoundError("py-spy is not installed (pip install py-spy)")
    handle, name = tempfile.mkstemp(prefix="py-spy-", suffix=".txt")
    os.close(handle)
    process = subprocess.Popen(
        [
            *prefix,
            command,
            "record",
            "--pid",
            str(pid),
            "--rate",
            str(rate),
            "--duration",
            str(max(1, round(seconds))),
            "--format",
            "raw",
            "--nonblocking",
            "--threads",
            "--output",
            name,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    return Recording(process, Path(name))
