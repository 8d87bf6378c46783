"""TLS on both doors, against real servers and real clients, with certificates made here (trustme).

- FFN_TLS_CERT_FILE and FFN_TLS_KEY_FILE: HTTPS only on the HTTP port, TLS only on the gRPC port;
  a cleartext request on either gets no answer. curl, httpx, ffn_client, tritonclient.http and
  tritonclient.grpc, grpcurl; answers checked against the float64 numpy reference.
- FFN_TLS_CLIENT_CA_FILE: a client without a certificate is refused on both doors in the
  handshake, one with a certificate the CA signed is served.
- Files that cannot serve: exit 2, one line naming the file, before anything loads.
- Rotation: new files and a SIGHUP (or the files' change alone) serve the new certificate to new
  connections on both doors, in the same process; a connection opened before goes on; a pair
  that does not match is refused with one log line and the old one kept. The same with workers.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import gevent.ssl
import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ffn_client import Client
from ffn_testing import HOST, ServerProcess, free_port, start_server
from tests.reference import assert_close, demo_reference

pytestmark = pytest.mark.server

D_MODEL = 512
WAIT_S = 60.0  # the bound of every wait for an event: the machine may be loaded


@dataclass(frozen=True)
class Pki:
    """One CA, the server's certificate and key for 127.0.0.1, and a client's certificate, as files."""

    ca: trustme.CA
    folder: Path

    @property
    def ca_file(self) -> Path:
        return self.folder / "ca.pem"

    @property
    def cert_file(self) -> Path:
        return self.folder / "server.pem"

    @property
    def key_file(self) -> Path:
        return self.folder / "server.key"

    @property
    def client_file(self) -> Path:
        """The client's certificate and key in one PEM file (curl's --cert, httpx's cert, grpcurl's -cert and -key)."""
        return self.folder / "client.pem"

    def env(self, mutual: bool = False) -> dict[str, str]:
        env = {"FFN_TLS_CERT_FILE": str(self.cert_file), "FFN_TLS_KEY_FILE": str(self.key_file)}
        if mutual:
            env["FFN_TLS_CLIENT_CA_FILE"] = str(self.ca_file)
        return env

    def issue_server(self, folder: Path | None = None, name: str = "ffn-serve") -> bytes:
        """A new certificate and key for 127.0.0.1 written over the server's files (or into `folder`); its DER."""
        cert = self.ca.issue_cert(HOST, "localhost", common_name=name)
        target = folder or self.folder
        # Written beside and renamed: the server never reads a half-written file, as with a Kubernetes secret.
        for pem, path in (
            (cert.private_key_pem, target / "server.key"),
            (cert.cert_chain_pems[0], target / "server.pem"),
        ):
            pem.write_to_path(str(path) + ".new")
            os.replace(str(path) + ".new", path)
        return ssl.PEM_cert_to_DER_cert(cert.cert_chain_pems[0].bytes().decode())


def make_pki(folder: Path) -> Pki:
    folder.mkdir(parents=True, exist_ok=True)
    pki = Pki(trustme.CA(), folder)
    pki.ca.cert_pem.write_to_path(str(pki.ca_file))
    pki.issue_server()
    client = pki.ca.issue_cert("client@ffn-serve.test")
    client.private_key_and_cert_chain_pem.write_to_path(str(pki.client_file))
    client.cert_chain_pems[0].write_to_path(str(folder / "client.crt"))
    client.private_key_pem.write_to_path(str(folder / "client.key"))
    return pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def tls_server(pki: Pki, metrics_port: int) -> Iterator[ServerProcess]:
    env = pki.env() | {"FFN_METRICS_PORT": str(metrics_port)}
    with start_server(env=env, verify=pki.ca_file) as server:
        yield server


@pytest.fixture(scope="module")
def mtls_server(pki: Pki) -> Iterator[ServerProcess]:
    with start_server(env=pki.env(mutual=True), verify=pki.ca_file, cert=pki.client_file) as server:
        yield server


def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, D_MODEL)).astype(np.float32)


def client_context(pki: Pki, mutual: bool = False) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki.ca_file))
    if mutual:
        context.load_cert_chain(str(pki.client_file))
    return context


def cleartext_answer(port: int) -> bytes:
    """What a cleartext HTTP/1.1 request on `port` gets back before the server closes the connection."""
    with socket.create_connection((HOST, port), timeout=WAIT_S) as sock:
        sock.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
        return received


def peer_certificate(port: int, pki: Pki, alpn: str | None = None) -> bytes:
    """The DER certificate a new TLS connection to `port` is shown (with the client certificate, for mutual TLS)."""
    context = client_context(pki, mutual=True)
    if alpn is not None:
        context.set_alpn_protocols([alpn])  # grpc core speaks HTTP/2 only
    with socket.create_connection((HOST, port), timeout=WAIT_S) as raw:
        with context.wrap_socket(raw, server_hostname=HOST) as tls:
            der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def grpc_health(target: str, credentials: grpc.ChannelCredentials | None) -> str:
    channel = grpc.secure_channel(target, credentials) if credentials is not None else grpc.insecure_channel(target)
    with channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=WAIT_S)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)


def credentials(pki: Pki, mutual: bool = False) -> grpc.ChannelCredentials:
    if not mutual:
        return grpc.ssl_channel_credentials(root_certificates=pki.ca_file.read_bytes())
    pem = pki.client_file.read_bytes()
    return grpc.ssl_channel_credentials(pki.ca_file.read_bytes(), private_key=pem, certificate_chain=pem)


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {WAIT_S:g} s: {what}"
        time.sleep(0.1)


# ----- TLS: both doors -----------------------------------------------------------------------------


def test_readiness_answers_over_https_and_cleartext_gets_no_answer(tls_server: ServerProcess, pki: Pki) -> None:
    answer = httpx.get(tls_server.url + "/v2/health/ready", verify=client_context(pki), timeout=WAIT_S)
    assert answer.status_code == 200
    assert tls_server.url.startswith("https://")
    # The TLS layer reads the request's bytes as a broken handshake and closes: no HTTP at all, not a redirect.
    assert b"HTTP/" not in cleartext_answer(tls_server.port)
    assert "listening on https://127.0.0.1" in tls_server.logs()


def test_the_metrics_port_serves_https_too(tls_server: ServerProcess, pki: Pki, metrics_port: int) -> None:
    page = httpx.get(f"https://{HOST}:{metrics_port}/metrics", verify=client_context(pki), timeout=WAIT_S)
    assert page.status_code == 200 and "ffn_requests_total" in page.text
    assert b"HTTP/" not in cleartext_answer(metrics_port)
    assert f"metrics on https://127.0.0.1:{metrics_port}/metrics" in tls_server.logs()


def test_curl_with_the_ca(tls_server: ServerProcess, pki: Pki) -> None:
    result = subprocess.run(
        ["curl", "-sS", "--cacert", str(pki.ca_file), "-w", "%{http_code}", tls_server.url + "/v2/health/ready"],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("200")
    # Without the CA, curl refuses the server: verification is on, as it should be.
    unknown = subprocess.run(["curl", "-sS", tls_server.url + "/v2/health/ready"], capture_output=True, timeout=WAIT_S)
    assert unknown.returncode == 60  # CURLE_PEER_FAILED_VERIFICATION


def test_ffn_client_transforms_over_https(tls_server: ServerProcess, pki: Pki) -> None:
    x = rows(3)
    with Client(tls_server.url, verify=pki.ca_file) as client:
        assert_close(client.transform("demo", x), demo_reference(x))


async def test_async_client_transforms_over_https(tls_server: ServerProcess, pki: Pki) -> None:
    from ffn_client import AsyncClient

    x = rows(2, seed=5)
    async with AsyncClient(tls_server.url, verify=str(pki.ca_file)) as client:
        assert_close(await client.transform("demo", x), demo_reference(x))


def test_large_bodies_over_https_are_answered_right_one_after_another(tls_server: ServerProcess, pki: Pki) -> None:
    # Bodies of 800 KB on one connection: each one's rest is read straight into its buffer through
    # the TLS transport (app/http/transport/direct_body.py), and the next head read after it.
    with Client(tls_server.url, verify=pki.ca_file) as client:
        for seed in range(3):
            x = rows(400, seed=seed)
            assert_close(client.transform("demo", x), demo_reference(x))


def test_tritonclient_http_infers_over_https(tls_server: ServerProcess, pki: Pki) -> None:
    x = rows(4, seed=1)
    client = triton_http.InferenceServerClient(
        tls_server.url.removeprefix("https://"),
        ssl=True,
        ssl_options={"ca_certs": str(pki.ca_file)},
        ssl_context_factory=gevent.ssl.create_default_context,
    )
    try:
        request = triton_http.InferInput("input", list(x.shape), "FP32")
        request.set_data_from_numpy(x, binary_data=True)
        answer = client.infer("demo", [request]).as_numpy("output")
    finally:
        client.close()
    assert_close(answer, demo_reference(x))


def test_tritonclient_grpc_infers_over_tls_and_cleartext_is_refused(tls_server: ServerProcess, pki: Pki) -> None:
    x = rows(5, seed=2)
    client = triton_grpc.InferenceServerClient(tls_server.grpc_target, ssl=True, root_certificates=str(pki.ca_file))
    try:
        request = triton_grpc.InferInput("input", list(x.shape), "FP32")
        request.set_data_from_numpy(x)
        answer = client.infer("demo", [request]).as_numpy("output")
    finally:
        client.close()
    assert_close(answer, demo_reference(x))
    with pytest.raises(grpc.RpcError) as refused:
        grpc_health(tls_server.grpc_target, None)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_grpcurl_with_the_ca(tls_server: ServerProcess, pki: Pki) -> None:
    grpcurl = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or "grpcurl"
    result = subprocess.run(
        [grpcurl, "-cacert", str(pki.ca_file), tls_server.grpc_target, "grpc.health.v1.Health/Check"],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert result.returncode == 0, result.stderr
    assert '"status": "SERVING"' in result.stdout


# ----- mutual TLS ----------------------------------------------------------------------------------


def test_mutual_tls_refuses_a_client_without_a_certificate_on_both_doors(mtls_server: ServerProcess, pki: Pki) -> None:
    with pytest.raises(httpx.TransportError):
        httpx.get(mtls_server.url + "/v2/health/ready", verify=client_context(pki), timeout=WAIT_S).raise_for_status()
    curl = subprocess.run(
        ["curl", "-sS", "--cacert", str(pki.ca_file), mtls_server.url + "/v2/health/ready"],
        capture_output=True,
        timeout=WAIT_S,
    )
    assert curl.returncode != 0 and b"200" not in curl.stdout
    with pytest.raises(grpc.RpcError) as refused:
        grpc_health(mtls_server.grpc_target, credentials(pki))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_refuses_a_certificate_another_ca_signed(mtls_server: ServerProcess, tmp_path: Path) -> None:
    stranger = make_pki(tmp_path / "stranger")
    context = ssl.create_default_context(cafile=str(stranger.ca_file))
    context.load_cert_chain(str(stranger.client_file))
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # this client trusts any server: only the server's refusal is tested
    with pytest.raises(httpx.TransportError):
        httpx.get(mtls_server.url + "/v2/health/ready", verify=context, timeout=WAIT_S).raise_for_status()


def test_mutual_tls_serves_a_client_with_a_certificate_on_both_doors(mtls_server: ServerProcess, pki: Pki) -> None:
    x = rows(3, seed=3)
    with Client(mtls_server.url, verify=pki.ca_file, cert=pki.client_file) as client:
        assert client.ready()
        assert_close(client.transform("demo", x, encoding="v2-json"), demo_reference(x))
    curl = subprocess.run(
        [
            "curl",
            "-sS",
            "--cacert",
            str(pki.ca_file),
            "--cert",
            str(pki.client_file),
            "-w",
            "%{http_code}",
            mtls_server.url + "/v2/health/ready",
        ],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert curl.stdout.endswith("200"), curl.stderr
    assert grpc_health(mtls_server.grpc_target, credentials(pki, mutual=True)) == "SERVING"
    client_grpc = triton_grpc.InferenceServerClient(
        mtls_server.grpc_target,
        ssl=True,
        root_certificates=str(pki.ca_file),
        private_key=str(pki.client_file),
        certificate_chain=str(pki.client_file),
    )
    try:
        request = triton_grpc.InferInput("input", list(x.shape), "FP32")
        request.set_data_from_numpy(x)
        assert_close(client_grpc.infer("demo", [request]).as_numpy("output"), demo_reference(x))
    finally:
        client_grpc.close()
    client_http = triton_http.InferenceServerClient(
        mtls_server.url.removeprefix("https://"),
        ssl=True,
        ssl_options={"ca_certs": str(pki.ca_file), "certfile": str(pki.client_file), "keyfile": str(pki.client_file)},
        ssl_context_factory=gevent.ssl.create_default_context,
    )
    try:
        request_http = triton_http.InferInput("input", list(x.shape), "FP32")
        request_http.set_data_from_numpy(x, binary_data=False)
        assert_close(client_http.infer("demo", [request_http]).as_numpy("output"), demo_reference(x))
    finally:
        client_http.close()


# ----- ffn-loadtest --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("protocol", "engine"), [("http", "raw"), ("http", "httpx"), ("grpc", "raw"), ("grpc-stream", "raw")]
)
def test_loadtest_with_cacert_cert_and_key_over_mutual_tls(
    mtls_server: ServerProcess, pki: Pki, protocol: str, engine: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from ffn_client.loadtest import main

    # The client certificate and its key in two files, as --cert and --key take them.
    cert, key = pki.folder / "client.crt", pki.folder / "client.key"
    url = mtls_server.url if protocol == "http" else f"grpc://{mtls_server.grpc_target}"
    tls = ["--cacert", str(pki.ca_file), "--cert", str(cert), "--key", str(key)]
    args = ["--protocol", protocol, "--engine", engine, "--url", url, "--metrics-url", mtls_server.url + "/metrics"]
    code = main([*args, *tls, "-n", "20", "-c", "4", "-q", "--json", "-"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    assert report["counts"] == {"sent": 20, "ok": 20, "errors": {}}
    assert report["config"]["d_model"] == D_MODEL  # asked over TLS too
    # Without the client certificate: nothing measured, as for a server that cannot be reached.
    assert main([*args, "--cacert", str(pki.ca_file), "-n", "3", "-q", "--timeout", "10"]) == 1


# ----- files that cannot serve -------------------------------------------------------------------


def run_cli(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    child = {k: v for k, v in os.environ.items() if not k.startswith("FFN_")} | env
    return subprocess.run(
        [sys.executable, "-m", "app.cli", "--port", "0", "--grpc-port", "0"],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        env=child,
    )


def test_a_key_that_does_not_match_exits_2_naming_the_file(pki: Pki, tmp_path: Path) -> None:
    other = make_pki(tmp_path / "other")
    result = run_cli({"FFN_TLS_CERT_FILE": str(pki.cert_file), "FFN_TLS_KEY_FILE": str(other.key_file)})
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"ffn-serve: invalid setting tls_key_file {other.key_file}: the key does not match the certificate in "
        f"{pki.cert_file}"
    ]


def test_an_expired_certificate_exits_2_naming_the_file(tmp_path: Path) -> None:
    from datetime import UTC, datetime, timedelta

    ca = trustme.CA()
    old = ca.issue_cert(HOST, not_after=datetime.now(UTC) - timedelta(days=1))
    cert, key = tmp_path / "old.pem", tmp_path / "old.key"
    old.cert_chain_pems[0].write_to_path(str(cert))
    old.private_key_pem.write_to_path(str(key))
    result = run_cli({"FFN_TLS_CERT_FILE": str(cert), "FFN_TLS_KEY_FILE": str(key)})
    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert line.startswith(f"ffn-serve: invalid setting tls_cert_file {cert}: the certificate expired on ")


@pytest.mark.parametrize("which", ["FFN_TLS_CERT_FILE", "FFN_TLS_KEY_FILE", "FFN_TLS_CLIENT_CA_FILE"])
def test_a_missing_file_exits_2_naming_it(pki: Pki, tmp_path: Path, which: str) -> None:
    env = pki.env(mutual=True) | {which: str(tmp_path / "absent.pem")}
    result = run_cli(env)
    assert result.returncode == 2
    setting = which.removeprefix("FFN_").lower()
    assert result.stderr.splitlines() == [
        f"ffn-serve: invalid setting {setting} {tmp_path / 'absent.pem'}: cannot read it: No such file or directory"
    ]


def test_one_of_the_pair_alone_exits_2(pki: Pki) -> None:
    result = run_cli({"FFN_TLS_CERT_FILE": str(pki.cert_file)})
    assert result.returncode == 2
    assert "tls_cert_file is set but tls_key_file is not" in result.stderr
    assert len(result.stderr.splitlines()) == 1


# ----- rotation ------------------------------------------------------------------------------------


def keep_alive(server: ServerProcess, pki: Pki) -> http.client.HTTPSConnection:
    """One HTTPS connection, kept open, that has had one answer."""
    connection = http.client.HTTPSConnection(
        HOST, server.port, context=client_context(pki, mutual=True), timeout=WAIT_S
    )
    connection.request("GET", "/v2/health/ready")
    answer = connection.getresponse()
    answer.read()
    assert answer.status == 200
    return connection


def still_answers(connection: http.client.HTTPSConnection, shown: bytes) -> None:
    """The connection opened before the rotation: the same socket, the old certificate, a 200."""
    sock = connection.sock
    assert isinstance(sock, ssl.SSLSocket)
    connection.request("GET", "/v2/health/ready")
    answer = connection.getresponse()
    answer.read()
    assert answer.status == 200
    assert connection.sock is sock
    assert sock.getpeercert(binary_form=True) == shown


@pytest.fixture
def rotating_pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path / "pki")


def test_sighup_rotates_both_doors_and_open_connections_go_on(rotating_pki: Pki) -> None:
    pki = rotating_pki
    with start_server(env=pki.env(mutual=True), verify=pki.ca_file, cert=pki.client_file) as server:
        old = peer_certificate(server.port, pki)
        assert peer_certificate(server.grpc_port or 0, pki, alpn="h2") == old
        before = keep_alive(server, pki)
        pid = server.pid
        new = pki.issue_server(name="rotated")
        server.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: peer_certificate(server.port, pki) == new, "the HTTP door shows the new certificate")
        wait_for(lambda: peer_certificate(server.grpc_port or 0, pki, alpn="h2") == new, "the gRPC door shows it")
        assert server.pid == pid and server.proc.poll() is None
        still_answers(before, old)
        before.close()
        assert grpc_health(server.grpc_target, credentials(pki, mutual=True)) == "SERVING"
        assert re.search(r"TLS: SIGHUP: certificate .*served to new connections", server.logs())


def test_a_change_of_the_files_rotates_and_a_bad_pair_keeps_the_old(rotating_pki: Pki, tmp_path: Path) -> None:
    pki = rotating_pki
    with start_server(env=pki.env(), verify=pki.ca_file) as server:
        new = pki.issue_server(name="watched")  # no signal: the files' change alone
        wait_for(lambda: peer_certificate(server.port, pki) == new, "the HTTP door shows the changed certificate")
        wait_for(lambda: peer_certificate(server.grpc_port or 0, pki, alpn="h2") == new, "the gRPC door shows it")
        # A key that is not the certificate's: refused with one line, the pair before kept on both doors.
        stranger = make_pki(tmp_path / "stranger")
        shutil.copy(stranger.key_file, str(pki.key_file) + ".new")
        os.replace(str(pki.key_file) + ".new", pki.key_file)
        server.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "new certificate not served" in server.logs(), "the refusal's log line")
        refusals = [line for line in server.logs().splitlines() if "new certificate not served" in line]
        assert "the key does not match the certificate" in refusals[0]
        assert peer_certificate(server.port, pki) == new
        assert peer_certificate(server.grpc_port or 0, pki, alpn="h2") == new
        with Client(server.url, verify=pki.ca_file) as client:
            assert client.ready()


def test_a_new_client_ca_replaces_the_old_one_on_both_doors(rotating_pki: Pki, tmp_path: Path) -> None:
    pki, other = rotating_pki, make_pki(tmp_path / "other")

    def served_over_https(client: Pki) -> bool:
        context = client_context(pki)
        context.load_cert_chain(str(client.client_file))
        try:
            return httpx.get(server.url + "/v2/health/ready", verify=context, timeout=WAIT_S).status_code == 200
        except httpx.TransportError:
            return False

    def served_over_grpc(client: Pki) -> bool:
        pem = client.client_file.read_bytes()
        tls = grpc.ssl_channel_credentials(pki.ca_file.read_bytes(), private_key=pem, certificate_chain=pem)
        try:
            return grpc_health(server.grpc_target, tls) == "SERVING"
        except grpc.RpcError:
            return False

    client_ca = pki.folder / "clients-ca.pem"
    shutil.copy(pki.ca_file, client_ca)
    env = pki.env() | {"FFN_TLS_CLIENT_CA_FILE": str(client_ca)}
    with start_server(env=env, verify=pki.ca_file, cert=pki.client_file) as server:
        assert served_over_https(pki) and served_over_grpc(pki)
        assert not served_over_https(other) and not served_over_grpc(other)
        shutil.copy(other.ca_file, str(client_ca) + ".new")
        os.replace(str(client_ca) + ".new", client_ca)
        server.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: served_over_https(other) and served_over_grpc(other), "the new CA's clients served")
        # The CA taken out of the file is trusted no more, on either door.
        assert not served_over_https(pki) and not served_over_grpc(pki)


@pytest.mark.parametrize("layout", ["workers", "shared-engine"])
def test_workers_serve_mutual_tls_and_every_one_rotates_on_sighup(rotating_pki: Pki, layout: str) -> None:
    pki = rotating_pki
    env = pki.env(mutual=True) | {"FFN_WORKERS": "2"}
    if layout == "shared-engine":  # two fronts (the doors) and one engine process
        env["FFN_SHARED_ENGINE"] = "true"
    with start_server(env=env, verify=pki.ca_file, cert=pki.client_file) as server:
        ready = "ready: 2 fronts" if layout == "shared-engine" else "ready: 2 workers"
        wait_for(lambda: ready in server.logs(), "both fronts ready")
        with pytest.raises(httpx.TransportError):
            httpx.get(server.url + "/v2/health/ready", verify=client_context(pki), timeout=WAIT_S)
        x = rows(2, seed=4)
        for _ in range(8):  # each a new connection: either worker may take it
            with Client(server.url, verify=pki.ca_file, cert=pki.client_file) as client:
                assert_close(client.transform("demo", x), demo_reference(x))
        before = keep_alive(server, pki)
        old = before.sock.getpeercert(binary_form=True) if isinstance(before.sock, ssl.SSLSocket) else b""
        new = pki.issue_server(name="rotated-workers")
        server.proc.send_signal(signal.SIGHUP)
        wait_for(
            lambda: len(re.findall(r"TLS: SIGHUP: certificate .*served to new connections", server.logs())) >= 2,
            "every worker's line that it serves the new certificate",
        )
        for _ in range(12):  # each a new connection, to whichever worker takes it: all show the new one
            assert peer_certificate(server.port, pki) == new
            assert peer_certificate(server.grpc_port or 0, pki, alpn="h2") == new
        still_answers(before, old)
        before.close()
        assert grpc_health(server.grpc_target, credentials(pki, mutual=True)) == "SERVING"


# ----- the container's health check ----------------------------------------------------------------


def run_healthcheck(server: ServerProcess, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    script = Path(__file__).resolve().parents[1] / "deploy" / "docker" / "healthcheck.py"
    child = {k: v for k, v in os.environ.items() if not k.startswith("FFN_")} | {"FFN_PORT": str(server.port)} | env
    return subprocess.run([sys.executable, str(script)], env=child, capture_output=True, text=True, timeout=WAIT_S)


def test_the_health_check_speaks_https_to_the_certificate_it_was_given(tls_server: ServerProcess, pki: Pki) -> None:
    assert run_healthcheck(tls_server, pki.env()).returncode == 0
    # A server that shows another certificate than the one configured is not this container's server.
    stranger = make_pki(pki.folder / "stranger")
    shown = run_healthcheck(tls_server, pki.env() | {"FFN_TLS_CERT_FILE": str(stranger.cert_file)})
    assert shown.returncode == 1 and "another certificate" in shown.stderr
    assert run_healthcheck(tls_server, {}).returncode == 1  # cleartext to an HTTPS port: not ready


def test_the_health_check_presents_a_client_certificate_under_mutual_tls(mtls_server: ServerProcess, pki: Pki) -> None:
    # By default the server's own pair, which the test CA signed for client use too.
    assert run_healthcheck(mtls_server, pki.env(mutual=True)).returncode == 0
    client = {
        "HEALTHCHECK_CERT_FILE": str(pki.folder / "client.crt"),
        "HEALTHCHECK_KEY_FILE": str(pki.folder / "client.key"),
    }
    assert run_healthcheck(mtls_server, pki.env(mutual=True) | client).returncode == 0
    stranger = make_pki(pki.folder / "stranger-client")
    other = {
        "HEALTHCHECK_CERT_FILE": str(stranger.folder / "client.crt"),
        "HEALTHCHECK_KEY_FILE": str(stranger.folder / "client.key"),
    }
    assert run_healthcheck(mtls_server, pki.env(mutual=True) | other).returncode == 1
