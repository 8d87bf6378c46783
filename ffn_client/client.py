"""`Client` and `AsyncClient`: numpy in, numpy out, over one pooled httpx connection set.

    with Client("http://127.0.0.1:8000") as client:
        y = client.transform("demo", x)                       # binary float32 by default
        y = client.transform("demo", x, encoding="v2-json", dtype="bfloat16")

Server errors raise the typed exceptions of `ffn_client.errors`; a 429 is retried up to
`max_retries` times, each after the server's Retry-After (capped at `max_retry_wait` seconds).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any
from urllib.parse import quote

import httpx
import numpy as np

from ffn_client.encodings import EncodedRequest, decode_response, encode_request, loads
from ffn_client.errors import FFNError, Overloaded, ProtocolError, Timeout, TransportError, error_from_response

DEFAULT_URL = "http://127.0.0.1:8000"


class _Base:
    """What both clients share: settings, request building, error mapping, retry policy."""

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
    ) -> None:
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
            "headers": {"Authorization": f"Bearer {api_key}"} if api_key else {},
        }

    def _answer_or_delay(self, request: EncodedRequest, response: httpx.Response, attempt: int) -> np.ndarray | float:
        """A 200's decoded array, or the seconds to wait before retrying; the error when there is no retry."""
        if response.status_code == 200:
            return decode_response(request, response.headers, response.content)
        error = error_from_response(response.status_code, response.headers, response.content)
        delay = self._retry_delay(error, attempt)
        if delay is None:
            raise error
        return delay

    def _retry_delay(self, error: FFNError, attempt: int) -> float | None:
        """Seconds to wait before retrying after `error` on attempt `attempt` (0-based); None = raise."""
        if not isinstance(error, Overloaded) or attempt >= self.max_retries:
            return None
        wait = error.retry_after if error.retry_after is not None else self.retry_backoff * 2**attempt
        return min(wait, self.max_retry_wait)

    @staticmethod
    def _check(response: httpx.Response) -> httpx.Response:
        if response.status_code != 200:
            raise error_from_response(response.status_code, response.headers, response.content)
        return response

    @classmethod
    def _json(cls, response: httpx.Response) -> Any:
        return loads(cls._check(response).content)

    @classmethod
    def _model_list(cls, response: httpx.Response) -> list[dict[str, Any]]:
        answer = cls._json(response)
        if not isinstance(answer, dict) or not isinstance(answer.get("models"), list):
            raise ProtocolError(f"GET /v1/models: expected {{'models': [...]}}, got {answer!r:.200}")
        return answer["models"]

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
        request = encode_request(model, array, encoding, dtype, timeout_ms)
        for attempt in range(self.max_retries + 1):
            response = self._request("POST", request.path, content=request.body, headers=request.headers)
            answer = self._answer_or_delay(request, response, attempt)
            if isinstance(answer, np.ndarray):
                return answer
            self._sleep(answer)
        raise AssertionError("unreachable: the last attempt raises or returns. This is a bug.")

    def models(self) -> list[dict[str, Any]]:
        """The served models: name, d_model, d_ff, activation, gated, dtype, device, ..."""
        return self._model_list(self._request("GET", "/v1/models"))

    def metadata(self, model: str) -> dict[str, Any]:
        """The model's Open Inference Protocol metadata (name, platform, inputs, outputs)."""
        return self._json(self._request("GET", f"/v2/models/{quote(model, safe='')}"))

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
        request = encode_request(model, array, encoding, dtype, timeout_ms)
        for attempt in range(self.max_retries + 1):
            response = await self._request("POST", request.path, content=request.body, headers=request.headers)
            answer = self._answer_or_delay(request, response, attempt)
            if isinstance(answer, np.ndarray):
                return answer
            await self._sleep(answer)
        raise AssertionError("unreachable: the last attempt raises or returns. This is a bug.")

    async def models(self) -> list[dict[str, Any]]:
        """See `Client.models`."""
        return self._model_list(await self._request("GET", "/v1/models"))

    async def metadata(self, model: str) -> dict[str, Any]:
        """See `Client.metadata`."""
        return self._json(await self._request("GET", f"/v2/models/{quote(model, safe='')}"))

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
