"""Media types and content encodings as the protocols read them: the value of a header, not the header itself."""

from __future__ import annotations

from app.protocol.errors import UnsupportedMediaType


def media_type(content_type: str | None) -> str | None:
    """The media type of a Content-Type header, lower-case and without parameters; None if absent."""
    if not content_type:
        return None
    return content_type.split(";", 1)[0].strip().lower()


def refuse_content_encoding(content_encoding: str | None) -> None:
    """Bodies are read uncompressed: any Content-Encoding but identity is 415."""
    if content_encoding and content_encoding.strip().lower() not in ("", "identity"):
        raise UnsupportedMediaType(
            f"Content-Encoding {content_encoding[:64]!r} is not supported; send the body uncompressed"
        )
