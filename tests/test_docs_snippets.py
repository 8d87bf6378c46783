"""Every code block of README.md and docs/*.md runs here, or says why not (issue 29 item 10).

A fenced block is run by its language: `python` as a script, `sh`/`bash` as a bash script (`set -e`),
`console` as its `$ ` commands, each of whose shown output lines must appear in what it printed;
`toml` is read as a config file and validated as Settings; `json` must parse. Untagged and `text`
blocks are text (file trees, diagrams, log lines). A block that needs Docker, a GPU, a cluster or minutes of benchmark
is preceded by `<!-- docs-test: skip: <why> -->`; a Python block that goes on from the previous
one (its `client`, its `x`) by `<!-- docs-test: continues -->`. Blocks that talk to a server talk
to one shared by this module (the demo model, shared memory on), its address put in place of the
docs' 127.0.0.1:8000 and :8001.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from app.config.settings import Settings, read_config_file
from ffn_testing import ServerProcess, free_port, start_server

pytestmark = pytest.mark.server

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!-- docs-test: (skip: .+|continues) -->$")
RUN_S = 180


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence
    language: str
    text: str
    marker: str | None  # "skip: why", "continues", or None

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks() -> list[Block]:
    found = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            opening = re.match(r"^\s*```(\S*)\s*$", lines[i])
            if opening:
                start, body = i, []
                i += 1
                while not re.match(r"^\s*```\s*$", lines[i]):
                    body.append(lines[i])
                    i += 1
                before = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
                marker = MARKER.match(before)
                found.append(Block(path, start + 1, opening[1], "\n".join(body) + "\n", marker[1] if marker else None))
            i += 1
    return found


BLOCKS = blocks()
RUNNABLE = [
    b
    for b in BLOCKS
    if b.language not in ("", "text") and b.marker != "continues" and not (b.marker or "").startswith("skip")
]


def test_every_block_is_run_or_says_why_not() -> None:
    for block in BLOCKS:
        assert block.language in ("", "text", "python", "sh", "bash", "console", "toml", "json"), (
            f"{block.name}: a ```{block.language} block: give it a language this test runs, or mark it skipped"
        )
        if block.marker and block.marker.startswith("skip:"):
            assert len(block.marker) > len("skip: ") + 8, f"{block.name}: say why it is skipped"
    assert RUNNABLE, "blocks to run"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with start_server(env={"FFN_SHARED_MEMORY": "true", "FFN_LOG_LEVEL": "warning"}) as running:
        yield running


def localised(text: str, server: ServerProcess) -> str:
    """The block with the docs' default addresses replaced by the shared server's."""
    for host in ("127.0.0.1", "localhost"):
        text = text.replace(f"{host}:8000", f"127.0.0.1:{server.port}")
        text = text.replace(f"{host}:8001", f"127.0.0.1:{server.grpc_port}")
    return text


def environment(server: ServerProcess) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FFN_")}
    bin_folder = str(Path(sys.executable).parent)
    env.update(
        {
            "PATH": f"{bin_folder}:{env.get('PATH', '')}",
            "PYTHONPATH": str(ROOT),
            # A server a block starts itself listens where the docs' addresses now point elsewhere.
            "FFN_PORT": "0",
            "FFN_GRPC_PORT": "0",
        }
    )
    return env


def python_of(block: Block) -> str:
    """The block, after the blocks it continues (a `continues` block's predecessors, in order)."""
    same_file = [b for b in BLOCKS if b.path == block.path and b.language == "python"]
    index = same_file.index(block)
    chain = [block]
    for later in same_file[index + 1 :]:
        if later.marker != "continues":
            break
        chain.append(later)
    return "".join(b.text for b in chain)


def run(
    command: list[str], server: ServerProcess, cwd: Path, stdin: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=RUN_S,
        env={**environment(server), **(env or {})},
        cwd=cwd,
    )


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.name for b in RUNNABLE])
def test_the_block_runs(block: Block, server: ServerProcess, tmp_path: Path) -> None:
    text = localised(block.text, server)
    if block.language == "json":
        json.loads(text)
    elif block.language == "toml":
        (tmp_path / "ffn.toml").write_text(text)
        values = read_config_file(tmp_path / "ffn.toml")
        Settings(**values)
    elif block.language == "python":
        result = run([sys.executable, "-"], server, tmp_path, stdin=localised(python_of(block), server))
        assert result.returncode == 0, f"{block.name}:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    elif block.language in ("sh", "bash"):
        env = None
        if re.search(r"^\s*bash scripts/serve\.sh .*&", block.text, re.M):  # it starts its own server
            port, grpc_port = free_port(), free_port()
            text = block.text.replace(":8000", f":{port}").replace(":8001", f":{grpc_port}")
            env = {"FFN_PORT": str(port), "FFN_GRPC_PORT": str(grpc_port)}
        # As a user's shell runs it: -e, without pipefail (`curl ... | head -c 120` ends curl with SIGPIPE).
        # In a folder of its own (what it writes, such as curl's out.bin, stays out of the checkout),
        # but for the scripts it runs from the checkout, as the README runs them.
        cwd = ROOT if "scripts/" in text else tmp_path
        result = run(["bash", "-e", "-c", text], server, cwd, env=env)
        assert result.returncode == 0, f"{block.name}:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    else:  # console: `$ ` lines are commands; the others, what they print
        check_console(block, text, server, tmp_path)


def check_console(block: Block, text: str, server: ServerProcess, cwd: Path) -> None:
    shown: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            shown.append((line[2:], []))
        elif shown and line.strip():
            shown[-1][1].append(line.strip())
    assert shown, f"{block.name}: a console block with no `$ ` command"
    for command, output in shown:
        result = run(["bash", "-c", command], server, ROOT if "ffn-extract" not in command else cwd)
        printed = " ".join((result.stdout + result.stderr).split())
        for expected in output:
            if "..." in expected:  # an elided line: its first part must be there
                expected = expected.split("...")[0].strip()
            assert " ".join(expected.split()) in printed, f"{block.name}: {expected!r} not in:\n{printed[-3000:]}"
