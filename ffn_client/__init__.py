"""ffn_client: the client library and load tester of ffn-serve (httpx + numpy; no torch).

from ffn_client import Client
with Client("http://127.0.0.1:8000") as client:
    y = client.transform("demo", x)  # x: [rows, 512] or [batch, seq, 512]
"""

from importlib.metadata import PackageNotFoundError, version

from ffn_client.calls import (
    ModelConfig,
    ModelInfo,
    ModelMetadata,
    ModelStatistics,
    RepositoryModel,
    ServerMetadata,
)
from ffn_client.client import AsyncClient, Client
from ffn_client.encodings import DTYPES, ENCODINGS, EncodedRequest, decode_response, encode_request
from ffn_client.errors import (
    BadRequest,
    DeadlineExceeded,
    FFNError,
    ModelNotFound,
    NotAcceptable,
    OutOfMemory,
    Overloaded,
    PayloadTooLarge,
    ProtocolError,
    ServerError,
    Timeout,
    TransportError,
    Unauthorized,
    Unavailable,
    UnsupportedMediaType,
)
from ffn_client.montecarlo import MonteCarloResult


def _version() -> str:
    """The version of the distribution that installed ffn_client: ffn-client alone, or ffn-serve with the server."""
    for distribution in ("ffn-client", "ffn-serve"):
        try:
            return version(distribution)
        except PackageNotFoundError:
            continue
    return "0+unknown"  # run from a checkout that was never installed


__version__ = _version()

__all__ = [
    "DTYPES",
    "ENCODINGS",
    "AsyncClient",
    "BadRequest",
    "Client",
    "DeadlineExceeded",
    "EncodedRequest",
    "FFNError",
    "ModelConfig",
    "ModelInfo",
    "ModelMetadata",
    "ModelNotFound",
    "ModelStatistics",
    "MonteCarloResult",
    "NotAcceptable",
    "OutOfMemory",
    "Overloaded",
    "PayloadTooLarge",
    "ProtocolError",
    "RepositoryModel",
    "ServerError",
    "ServerMetadata",
    "Timeout",
    "TransportError",
    "Unauthorized",
    "Unavailable",
    "UnsupportedMediaType",
    "__version__",
    "decode_response",
    "encode_request",
]
