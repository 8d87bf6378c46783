"""Media types as the protocols read them: the value of a header, not the header itself (content codings: content_coding.py)."""

from __future__ import annotations


def media_type(content_type: str | None) -> str | None:
    """The media type of a Content-Type header, lower-case and without parameters; None if absent."""
    if not content_type:
        return None
    return content_type.split(";", 1)[0].strip().lower()
