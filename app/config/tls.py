"""TLS for both doors: the files checked at start, the HTTP door's SSL context, and rotation.

`tls_cert_file` and `tls_key_file` turn the HTTP port (and the metrics port, which the same
uvicorn server serves) to HTTPS only and the gRPC port to TLS only; `tls_client_ca_file` makes
both require a client certificate signed by that CA, refused in the handshake without one.

- At start (`start_problems`, from app/cli.py before anything loads): each file readable, the
  certificate parsed and within its validity, the key unencrypted and the certificate's, the CA
  file holding at least one certificate; else one line naming the file, exit 2.
- Rotation (`Rotation`): SIGHUP, and a change of any of the files (their identities checked every
  WATCH_INTERVAL_S on the event loop, applied once a change has held for one check, so that a pair
  half written is not read), read the files again. A pair that passes the same checks replaces
  the old one for new handshakes on both doors; connections already open keep theirs. One that
  fails is refused with one log line, and the old pair stays.

The HTTP door: uvicorn is given one `ssl.SSLContext` and keeps it for the process's life. Each
pair served gets a context of its own, built whole from the files and checked, and the first
one's SNI callback, which OpenSSL calls early in every handshake (with or without a server name),
moves the new connection onto the latest (`SSLObject.context`): new handshakes take the new
certificate, key and client CA (one taken out of the file is no longer trusted), connections
already open keep the context they shook hands with, and a context is never changed in place.
The gRPC door asks `current` at each handshake (app/grpc/tls.py). No grpc, no uvicorn here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization

from app.config.settings import Settings

log = logging.getLogger("ffn_serve")

# A stat of three files a second is nothing next to a request; a rotation is seen within two seconds.
WATCH_INTERVAL_S = 1.0
# The control command that reads the files again in a serving process: the supervisor sends it to every
# front on SIGHUP (app/process/supervisor.py), a single process reloads on SIGHUP itself (app/process/server.py).
TLS_RELOAD = "tls.reload"
_SPKI = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


class TlsError(Exception):
    """A TLS file that cannot serve, as one line naming the file and what is wrong."""


@dataclass(frozen=True)
class TlsFiles:
    """Where the server's certificate, its key and (for mutual TLS) the clients' CA are."""

    cert: Path
    key: Path
    client_ca: Path | None = None

    def all(self) -> list[Path]:
        return [self.cert, self.key] + ([self.client_ca] if self.client_ca is not None else [])


@dataclass(frozen=True)
class KeyPair:
    """One checked reading of the files: PEM bytes, as grpc core takes them, and the certificate's facts."""

    cert_chain: bytes
    key: bytes
    client_ca: bytes | None
    subject: str
    not_after: datetime
    generation: int  # 1 at start, one more at each rotation: the gRPC door compares it with the pair it serves


def tls_files(settings: Settings) -> TlsFiles | None:
    """The TLS files the settings name, or None: both doors serve cleartext."""
    if settings.tls_cert_file is None or settings.tls_key_file is None:
        return None
    return TlsFiles(settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file)


def start_problems(settings: Settings) -> list[str]:
    """The TLS files' problems, one line each naming the file (app/cli.py: exit 2); none when TLS is off or all is well."""
    files = tls_files(settings)
    if files is None:
        return []
    try:
        read_pair(files, generation=1)
        server_context(files)
    except TlsError as exc:
        return [str(exc)]
    return []


def read_pair(files: TlsFiles, generation: int, now: datetime | None = None) -> KeyPair:
    """The files read and checked: the certificate valid now, the key its own, the CA file certificates; TlsError if not."""
    cert_bytes = _read(files.cert, "tls_cert_file")
    key_bytes = _read(files.key, "tls_key_file")
    ca_bytes = _read(files.client_ca, "tls_client_ca_file") if files.client_ca is not None else None
    try:
        chain = x509.load_pem_x509_certificates(cert_bytes)
    except ValueError:
        raise TlsError(f"tls_cert_file {files.cert}: not a PEM certificate") from None
    leaf = chain[0]
    moment = now or datetime.now(UTC)
    if moment > leaf.not_valid_after_utc:
        raise TlsError(f"tls_cert_file {files.cert}: the certificate expired on {_day(leaf.not_valid_after_utc)}")
    if moment < leaf.not_valid_before_utc:
        raise TlsError(
            f"tls_cert_file {files.cert}: the certificate is not valid before {_day(leaf.not_valid_before_utc)}"
        )
    try:
        key = serialization.load_pem_private_key(key_bytes, password=None)
    except TypeError:  # cryptography's way of saying a password is needed
        raise TlsError(f"tls_key_file {files.key}: the key is encrypted; give it unencrypted (mode 0600)") from None
    except (ValueError, UnsupportedAlgorithm):
        raise TlsError(f"tls_key_file {files.key}: not a PEM private key") from None
    if key.public_key().public_bytes(*_SPKI) != leaf.public_key().public_bytes(*_SPKI):
        raise TlsError(f"tls_key_file {files.key}: the key does not match the certificate in {files.cert}")
    if ca_bytes is not None:
        try:
            x509.load_pem_x509_certificates(ca_bytes)
        except ValueError:
            raise TlsError(f"tls_client_ca_file {files.client_ca}: not a PEM certificate") from None
    return KeyPair(cert_bytes, key_bytes, ca_bytes, leaf.subject.rfc4514_string(), leaf.not_valid_after_utc, generation)


def server_context(files: TlsFiles) -> ssl.SSLContext:
    """The HTTP door's context: TLS 1.2 at the least, the ssl module's cipher defaults, the client CA if any."""
    # PROTOCOL_TLS_SERVER: no client-side options, no SSLv2/3; the default ciphers are the ssl module's
    # (no RC4, no 3DES, forward secrecy first). Verification can only be on: there is no setting to turn it off.
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(context, files)
    if files.client_ca is not None:
        context.verify_mode = ssl.CERT_REQUIRED
        try:
            context.load_verify_locations(cafile=str(files.client_ca))
        except (ssl.SSLError, OSError) as exc:
            raise TlsError(f"tls_client_ca_file {files.client_ca}: OpenSSL refused it: {_ssl_reason(exc)}") from None
    return context


class Rotation:
    """The pair both doors serve, replaced on SIGHUP (`reload`) and when the files change (`watch`)."""

    def __init__(self, files: TlsFiles) -> None:
        """Read and check the files (TlsError, as at start) and build the HTTP door's context."""
        self.files = files
        self.context = server_context(files)  # uvicorn's, for the process's life
        self._served = self.context  # the latest pair's: where the SNI callback sends new handshakes
        self.context.sni_callback = self._to_the_latest
        self._lock = threading.Lock()  # `current` is read from grpc core's threads
        self._current = read_pair(files, generation=1)
        self._identity = _identities(files)
        self._task: asyncio.Task[None] | None = None

    @property
    def current(self) -> KeyPair:
        with self._lock:
            return self._current

    def reload(self, why: str) -> bool:
        """Read the files again and serve them to new handshakes; False, the old pair kept, with one log line if they fail."""
        self._identity = _identities(self.files)
        try:
            pair = read_pair(self.files, generation=self.current.generation + 1)
            served = server_context(self.files)
        except TlsError as exc:
            log.error("TLS: %s: new certificate not served, the old one kept: %s", why, exc)
            return False
        self._served = served
        with self._lock:
            self._current = pair
        log.info(
            "TLS: %s: certificate %s (%s, valid until %s) served to new connections",
            why,
            self.files.cert,
            pair.subject,
            _day(pair.not_after),
        )
        return True

    def _to_the_latest(
        self, connection: ssl.SSLObject | ssl.SSLSocket, server_name: str | None, context: ssl.SSLContext
    ) -> None:
        # OpenSSL's servername callback: a handshake begun on an older context continues on the latest.
        served = self._served
        if served is not context:
            connection.context = served

    def start_watching(self) -> None:
        """Check the files' identities every WATCH_INTERVAL_S on the running loop."""
        self._task = asyncio.get_running_loop().create_task(self._watch(), name="tls-watch")

    async def stop_watching(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _watch(self) -> None:
        previous = self._identity
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            seen = _identities(self.files)
            # Applied once a change has held for one check: a pair half written (the certificate
            # replaced, the key not yet) is not read. Kubernetes swaps a secret's files at once.
            if seen != self._identity and seen == previous:
                self.reload("the files changed")
            previous = seen


def _read(path: Path, setting: str) -> bytes:
    try:
        with path.open("rb") as file:
            return file.read()
    except OSError as exc:
        raise TlsError(f"{setting} {path}: cannot read it: {exc.strerror or exc}") from None


def _load_chain(context: ssl.SSLContext, files: TlsFiles) -> None:
    try:
        context.load_cert_chain(certfile=str(files.cert), keyfile=str(files.key))
    except (ssl.SSLError, OSError) as exc:
        raise TlsError(
            f"tls_cert_file {files.cert}, tls_key_file {files.key}: OpenSSL refused them: {_ssl_reason(exc)}"
        ) from None


def _identities(files: TlsFiles) -> tuple[tuple[int, int, int, int] | None, ...]:
    """Each file's device, inode, modification time and size (through symlinks: a secret's swapped folder)."""
    found: list[tuple[int, int, int, int] | None] = []
    for path in files.all():
        try:
            info = os.stat(path)
        except OSError:
            found.append(None)
            continue
        found.append((info.st_dev, info.st_ino, info.st_mtime_ns, info.st_size))
    return tuple(found)


def _day(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def _ssl_reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError):
        return exc.reason or str(exc)
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return str(exc)
