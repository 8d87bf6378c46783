"""Triton's perf_analyzer (NVIDIA's, nobody here wrote it) against a real ffn-serve with system shared memory.

Its shared-memory runs register regions for the inputs and outputs and, when they end,
unregister every system and every CUDA region; a server that refuses the CUDA half made every
such run end with "Unable to unregister all shared memory regions" (issue 31, item 6). Both
protocols, a fixed count of requests (no stability windows to wait for on a busy machine), its
inputs zeros (its random bytes hold NaN, which the service refuses).

perf_analyzer is taken from the PATH, or from scripts/perf-analyzer.sh's folder once that script
has fetched it (`bash scripts/perf-analyzer.sh --version`); the tests skip, saying so, where
neither is there: they never download it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ffn_client import Client
from ffn_testing import ServerProcess, start_server

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "perf-analyzer.sh"
REQUESTS = 40


def perf_analyzer() -> list[str]:
    """The command that runs perf_analyzer here, without downloading anything; skip when there is none."""
    if shutil.which("perf_analyzer"):
        return ["perf_analyzer"]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    home = Path(os.environ.get("PERF_ANALYZER_HOME", cache / "perf-analyzer"))
    fetched = home / "pa" / "perf_analyzer" / "bin" / "perf_analyzer"
    loader = home / "tx" / "usr" / "lib" / "x86_64-linux-gnu" / "ld-linux-x86-64.so.2"
    if fetched.exists() and loader.exists():
        return ["bash", str(SCRIPT)]
    pytest.skip(f"perf_analyzer is not installed: `bash scripts/perf-analyzer.sh --version` fetches it into {home}")


def succeeded(server: ServerProcess) -> int:
    """The server's own count of the demo model's successful requests (the statistics extension)."""
    with Client(server.url) as client:
        return int(client.statistics("demo")[0]["inference_stats"]["success"]["count"])


@pytest.fixture(scope="module")
def command() -> list[str]:
    return perf_analyzer()


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with start_server(env={"FFN_SHARED_MEMORY": "true", "FFN_WARMUP": "0", "FFN_LOG_LEVEL": "warning"}) as srv:
        yield srv


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_shared_memory_run_ends_clean(command: list[str], server: ServerProcess, protocol: str) -> None:
    address = f"127.0.0.1:{server.port if protocol == 'http' else server.grpc_port}"
    argv = [
        *command,
        *("-m", "demo", "-u", address, "-i", protocol),
        *("--shared-memory", "system", "--input-data", "zero", "--shape", "input:1,512"),
        *("--concurrency-range", "1", "--request-count", str(REQUESTS)),
    ]
    before = succeeded(server)
    run = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert "Unable to unregister" not in output, output
    assert succeeded(server) - before == REQUESTS  # every request it sent was answered, and counted
    # Its reading of the server's statistics: the difference of two snapshots it takes while its
    # load thread already runs, so at concurrency 1 the first request can fall before the first
    # snapshot and the last after the second (a CI run read 39 of 40 over gRPC).
    read = re.search(r"Server:\s+Inference count: \d+\s+Execution count: \d+\s+Successful request count: (\d+)", output)
    assert read is not None, output
    assert REQUESTS - 2 <= int(read.group(1)) <= REQUESTS, output
    # What it registered it unregistered, system regions and (none) CUDA ones alike.
    assert httpx.get(f"{server.url}/v2/systemsharedmemory/status").json() == []
    assert httpx.get(f"{server.url}/v2/cudasharedmemory/status").json() == []


def test_its_ssl_options_infer_over_mutual_tls_on_both_doors(command: list[str], tmp_path: Path) -> None:
    """perf_analyzer's build has SSL options (--ssl-grpc-*, --ssl-https-*): both doors over mutual TLS (issue 42)."""
    import trustme

    ca = trustme.CA()
    server_pair, client_pair = ca.issue_cert("127.0.0.1"), ca.issue_cert("perf-analyzer")
    files = {name: tmp_path / f"{name}.pem" for name in ("ca", "cert", "key", "client-cert", "client-key")}
    ca.cert_pem.write_to_path(str(files["ca"]))
    server_pair.cert_chain_pems[0].write_to_path(str(files["cert"]))
    server_pair.private_key_pem.write_to_path(str(files["key"]))
    client_pair.cert_chain_pems[0].write_to_path(str(files["client-cert"]))
    client_pair.private_key_pem.write_to_path(str(files["client-key"]))
    env = {
        "FFN_TLS_CERT_FILE": str(files["cert"]),
        "FFN_TLS_KEY_FILE": str(files["key"]),
        "FFN_TLS_CLIENT_CA_FILE": str(files["ca"]),
        "FFN_WARMUP": "0",
        "FFN_LOG_LEVEL": "warning",
    }
    client_pem = tmp_path / "client.pem"
    client_pem.write_bytes(files["client-key"].read_bytes() + files["client-cert"].read_bytes())
    ssl = {
        "grpc": [
            *("--ssl-grpc-use-ssl", "true", "--ssl-grpc-root-certifications-file", str(files["ca"])),
            *("--ssl-grpc-private-key-file", str(files["client-key"])),
            *("--ssl-grpc-certificate-chain-file", str(files["client-cert"])),
        ],
        "http": [
            *("--ssl-https-verify-peer", "1", "--ssl-https-verify-host", "2"),
            *("--ssl-https-ca-certificates-file", str(files["ca"])),
            *("--ssl-https-client-certificate-file", str(files["client-cert"])),
            *("--ssl-https-client-certificate-type", "PEM"),
            *("--ssl-https-private-key-file", str(files["client-key"]), "--ssl-https-private-key-type", "PEM"),
        ],
    }
    with start_server(env=env, verify=files["ca"], cert=client_pem) as server:
        for protocol in ("grpc", "http"):
            address = f"127.0.0.1:{server.grpc_port}" if protocol == "grpc" else f"https://127.0.0.1:{server.port}"
            argv = [
                *command,
                *("-m", "demo", "-u", address, "-i", protocol, *ssl[protocol]),
                *("--input-data", "zero", "--shape", "input:1,512"),
                *("--concurrency-range", "1", "--request-count", str(REQUESTS)),
            ]
            run = subprocess.run(argv, capture_output=True, text=True, timeout=300)
            output = run.stdout + run.stderr
            assert run.returncode == 0, output
            read = re.search(r"Successful request count: (\d+)", output)
            assert read is not None and REQUESTS - 2 <= int(read.group(1)) <= REQUESTS, output
        # Without its client certificate the gRPC door refuses it in the handshake.
        refused = subprocess.run(
            [*command, "-m", "demo", "-u", f"127.0.0.1:{server.grpc_port}", "-i", "grpc", *ssl["grpc"][:4]],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert refused.returncode != 0 or "failed to connect" in refused.stdout + refused.stderr
