"""`Client` and `AsyncClient`: numpy in, numpy out, over one pooled httpx connection set.

    with Client("http://127.0.0.1:8000") as client:
        y = client.transform("demo", x)                       # binary float32 by default
        y = client.transform("demo", x, encoding="v2-json", dtype="bfloat16")
        r = client.monte_carlo("demo", x, passes=32, seed=7, dropout=0.1)  # r.mean, r.std

    with Client("https://host:8000", verify="ca.pem", cert=("client.pem", "client.key")) as client: ...

Every route of the HTTP API has a method (docs/client.md lists them); the two clients build the
same requests (`ffn_client.encodings`, `ffn_client.montecarlo`, `ffn_client.calls`) and differ
only in how they send them. Server errors raise the typed exceptions of `ffn_client.errors`; a
429 is retried up to `max_retries` times, each after the server's Retry-After (capped at
`max_retry_wait` seconds).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import numpy as np

from ffn_client import calls
from ffn_client.calls import (
    Call,
    ModelConfig,
    ModelInfo,
    ModelMetadata,
    ModelStatistics,
    RepositoryModel,
    ServerMetadata,
)
from ffn_client.encodings import EncodedRequest, decode_response, encode_request
from ffn_client.errors import FFNError, Overloaded, Timeout, TransportError, error_from_response
from ffn_client.montecarlo import MonteCarloResult, decode_mc_response, encode_mc_request
from ffn_client.tls import CertFiles, client_context

DEFAULT_URL = "http://127.0.0.1:8000"

T = TypeVar("T")
# How a 200 answer to an encoded request is read: decode_response, decode_mc_response.
Decoder = Callable[[EncodedRequest, Mapping[str, str], bytes], T]


@dataclass(frozen=True)
class _Retry:
    """Wait this long, then send the request again."""

    seconds: float


class _Base:
    """What both clients share: settings, error mapping, retry policy."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        api_key: str | None = None,
        timeout: float | None = 60.0,
        max_retries: int = 3,
        max_retry_wait: float = 10.0,
        retry_backoff: float = 0.1,
        max_connections: int = 16,
        verify: str | Path | ssl.SSLContext | bool = True,
        cert: CertFiles | None = None,
    ) -> None:
        """`verify`, `cert`: for an https URL, the CA to trust and the client certificate (mutual TLS), as httpx's
        (`ffn_client.tls`)."""
        if max_retries < 0 or max_retry_wait < 0 or retry_backoff < 0:
            raise ValueError("max_retries, max_retry_wait and retry_backoff must be >= 0")
        self.url = url.rstrip("/")
        self.max_retries = max_retries
        self.max_retry_wait = max_retry_wait
        self.retry_backoff = retry_backoff
        self._http_options: dict[str, Any] = {
            "base_url": self.url,
            "timeout": timeout,
            "limits": httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            # Identity, not httpx's default gzip and deflate: float tensors barely compress (raw float32
            # about 8 %), and compressing costs the server several times the answer's encoding.
            "verify": client_context(verify, cert),
            "headers": {**({"Authorization": f"Bearer {api_key}"} if api_key else {}), "Accept-Encoding": "identity"},
        }

    def _answer_or_retry(
        self, request: EncodedRequest, decode: Decoder[T], response: httpx.Response, attempt: int
    ) -> T | _Retry:
        """A 200's decoded answer, or how long to wait before retrying; the error when there is no retry."""
        if response.status_code == 200:
            return decode(request, response.headers, response.content)
        error = error_from_response(response.status_code, response.headers, response.content)
        delay = self._retry_delay(error, attempt)
        if delay is None:
            raise error
        return _Retry(delay)

    def _retry_delay(self, error: FFNError, attempt: int) -> float | None:
        """Seconds to wait before retrying after `error` on attempt `attempt` (0-based); None = raise."""
        if not isinstance(error, Overloaded) or attempt >= self.max_retries:
            return None
        wait = error.retry_after if error.retry_after is not None else self.retry_backoff * 2**attempt
        return min(wait, self.max_retry_wait)

    @staticmethod
    def _transport_error(exc: httpx.TransportError) -> TransportError:
        cls = Timeout if isinstance(exc, httpx.TimeoutException) else TransportError
        return cls(str(exc) or type(exc).__name__, error_type=type(exc).__name__)


class Client(_Base):
    """Synchronous client. Reuse one instance (it pools connections); close it or use `with`."""

    _sleep = staticmethod(time.sleep)

    def __init__(self, url: str = DEFAULT_URL, *, transport: httpx.BaseTransport | None = None, **options: Any) -> None:
        super().__init__(url, **options)
        self._http = httpx.Client(transport=transport, **self._http_options)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the pooled connections."""
        self._http.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise self._transport_error(exc) from exc

    def _call(self, call: Call[T]) -> T:
        return call.read(self._request(call.method, call.path, content=call.body, headers=call.headers))

    def _send(self, request: EncodedRequest, decode: Decoder[T]) -> T:
        """POST `request`, retrying after 429s as configured, and decode the answer."""
        for attempt in range(self.max_retries + 1):
            response = self._request("POST", request.path, content=request.body, headers=request.headers)
            outcome = self._answer_or_retry(request, decode, response, attempt)
            if not isinstance(outcome, _Retry):
                return outcome
            self._sleep(outcome.seconds)
        raise AssertionError("unreachable: the last attempt raises or returns. This is a bug.")

    def transform(
        self,
        model: str,
        array: np.ndarray,
        *,
        encoding: str = "binary",
        dtype: str | None = None,
        timeout_ms: float | None = None,
    ) -> np.ndarray:
        """`model`'s FFN applied to `array` ([rows, d_model] or [batch, seq, d_model]), same shape.

        dtype: the wire dtype (float32, float16, bfloat16); default float16 for float16 arrays,
        float32 otherwise. bfloat16 answers come back as float32 arrays.
        timeout_ms: the server-side deadline for this request (X-Timeout-Ms, or V2's `timeout`).
        """
        return self._send(encode_request(model, array, encoding, dtype, timeout_ms), decode_response)

    def monte_carlo(
        self,
        model: str,
        array: np.ndarray,
        passes: int,
        *,
        seed: int | None = None,
        dropout: float | None = None,
        encoding: str = "binary",
        dtype: str | None = None,
        timeout_ms: float | None = None,
    ) -> MonteCarloResult:
        """Monte Carlo dropout: the mean and standard deviation of `passes` dropout passes over `array`.

        seed: the masks' seed (the server draws one when None, and answers it in `.seed`);
        dropout: the rate, instead of the model's. The other arguments are transform's; every
        encoding works (native: query parameters; V2: request parameters).
        """
        request = encode_mc_request(
            model, array, passes, seed=seed, dropout=dropout, encoding=encoding, dtype=dtype, timeout_ms=timeout_ms
        )
        return self._send(request, decode_mc_response)

    def models(self) -> list[ModelInfo]:
        """The served models (GET /v1/models): name, d_model, d_ff, activation, gated, dtype, device, ..."""
        return self._call(calls.models())

    def server_metadata(self) -> ServerMetadata:
        """The server's name, version and V2 extensions (GET /v2)."""
        return self._call(calls.server_metadata())

    def metadata(self, model: str) -> ModelMetadata:
        """The model's Open Inference Protocol metadata (name, platform, inputs, outputs)."""
        return self._call(calls.model_metadata(model))

    def model_config(self, model: str) -> ModelConfig:
        """The model's configuration in Triton's ModelConfig shape (GET /v2/models/{model}/config)."""
        return self._call(calls.model_config(model))

    def statistics(self, model: str | None = None) -> list[ModelStatistics]:
        """Triton's statistics of `model`, or of every model when None (GET /v2/models[/{model}]/stats)."""
        return self._call(calls.statistics(model))

    def repository_index(self, ready_only: bool = False) -> list[RepositoryModel]:
        """The V2 repository index: every model (or only the ready ones) with its state."""
        return self._call(calls.repository_index(ready_only))

    def model_ready(self, model: str) -> bool:
        """True when `model` is ready (200), False when not (503); an unknown model raises ModelNotFound."""
        return self._call(calls.model_ready(model))

    def live(self) -> bool:
        """True when the server process answers GET /v2/health/live with 200."""
        return self._probe("/v2/health/live")

    def ready(self) -> bool:
        """True when the server is ready to serve (GET /v2/health/ready is 200); False otherwise."""
        return self._probe("/v2/health/ready")

    def wait_ready(self, timeout: float = 60.0, interval: float = 0.1) -> None:
        """Block until `ready()`; raise TransportError if it is not after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not self.ready():
            if time.monotonic() > deadline:
                raise TransportError(f"{self.url} not ready after {timeout:g} s", error_type="NotReady")
            self._sleep(interval)

    def _probe(self, path: str) -> bool:
        try:
            return self._http.get(path).status_code == 200
        except httpx.TransportError:
            return False


class AsyncClient(_Base):
    """asyncio client with the same methods as `Client`, each a coroutine."""

    _sleep = staticmethod(asyncio.sleep)

    def __init__(
        self, url: str = DEFAULT_URL, *, transport: httpx.AsyncBaseTransport | None = None, **options: Any
    ) -> None:
        super().__init__(url, **options)
        self._http = httpx.AsyncClient(transport=transport, **self._http_options)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the pooled connections."""
        await self._http.aclose()

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return await self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise self._transport_error(exc) from exc

    async def _call(self, call: Call[T]) -> T:
        return call.read(await self._request(call.method, call.path, content=call.body, headers=call.headers))

    async def _send(self, request: EncodedRequest, decode: Decoder[T]) -> T:
        """See `Client._send`."""
        for attempt in range(self.max_retries + 1):
            response = await self._request("POST", request.path, content=request.body, headers=request.headers)
            outcome = self._answer_or_retry(request, decode, response, attempt)
            if not isinstance(outcome, _Retry):
                return outcome
            await self._sleep(outcome.seconds)
        raise AssertionError("unreachable: the last attempt raises or returns. This is a bug.")

    async def transform(
        self,
        model: str,
        array: np.ndarray,
        *,
        encoding: str = "binary",
        dtype: str | None = None,
        timeout_ms: float | None = None,
    ) -> np.ndarray:
        """See `Client.transform`."""
        return await self._send(encode_request(model, array, encoding, dtype, timeout_ms), decode_response)

    async def monte_carlo(
        self,
        model: str,
        array: np.ndarray,
        passes: int,
        *,
        seed: int | None = None,
        dropout: float | None = None,
        encoding: str = "binary",
        dtype: str | None = None,
        timeout_ms: float | None = None,
    ) -> MonteCarloResult:
        """See `Client.monte_carlo`."""
        request = encode_mc_request(
            model, array, passes, seed=seed, dropout=dropout, encoding=encoding, dtype=dtype, timeout_ms=timeout_ms
        )
        return await self._send(request, decode_mc_response)

    async def models(self) -> list[ModelInfo]:
        """See `Client.models`."""
        return await self._call(calls.models())

    async def server_metadata(self) -> ServerMetadata:
        """See `Client.server_metadata`."""
        return await self._call(calls.server_metadata())

    async def metadata(self, model: str) -> ModelMetadata:
        """See `Client.metadata`."""
        return await self._call(calls.model_metadata(model))

    async def model_config(self, model: str) -> ModelConfig:
        """See `Client.model_config`."""
        return await self._call(calls.model_config(model))

    async def statistics(self, model: str | None = None) -> list[ModelStatistics]:
        """See `Client.statistics`."""
        return await self._call(calls.statistics(model))

    async def repository_index(self, ready_only: bool = False) -> list[RepositoryModel]:
        """See `Client.repository_index`."""
        return await self._call(calls.repository_index(ready_only))

    async def model_ready(self, model: str) -> bool:
        """See `Client.model_ready`."""
        return await self._call(calls.model_ready(model))

    async def live(self) -> bool:
        """See `Client.live`."""
        return await self._probe("/v2/health/live")

    async def ready(self) -> bool:
        """See `Client.ready`."""
        return await self._probe("/v2/health/ready")

    async def wait_ready(self, timeout: float = 60.0, interval: float = 0.1) -> None:
        """See `Client.wait_ready`."""
        deadline = time.monotonic() + timeout
        while not await self.ready():
            if time.monotonic() > deadline:
                raise TransportError(f"{self.url} not ready after {timeout:g} s", error_type="NotReady")
            await self._sleep(interval)

    async def _probe(self, path: str) -> bool:
        try:
            return (await self._http.get(path)).status_code == 200
        except httpx.TransportError:
            return False
