"""ffn_client: the client library and load tester of ffn-serve (httpx + numpy; no torch).

from ffn_client import Client
with Client("http://127.0.0.1:8000") as client:
    y = client.transform("demo", x)  # x: [rows, 512] or [batch, seq, 512]
"""

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

__all__ = [
    "DTYPES",
    "ENCODINGS",
    "AsyncClient",
    "BadRequest",
    "Client",
    "DeadlineExceeded",
    "EncodedRequest",
    "FFNError",
    "ModelNotFound",
    "NotAcceptable",
    "OutOfMemory",
    "Overloaded",
    "PayloadTooLarge",
    "ProtocolError",
    "ServerError",
    "Timeout",
    "TransportError",
    "Unauthorized",
    "Unavailable",
    "UnsupportedMediaType",
    "decode_response",
    "encode_request",
]
