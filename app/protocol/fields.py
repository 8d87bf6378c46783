"""Strict readers for the scalar fields a client sends: JSON members, numeric headers and query values, media types.

Every protocol reads every parameter through these (one vocabulary), so each field has one documented type and
anything else is InvalidInput (400) naming the field and what was sent: a boolean is not a
number, "false" is not a boolean, a string is not a timeout, and '²' or '١٢' are not digits.

    binary = bool_field(parameters, "binary_data_output", "request parameter")
    samples = int_field(parameters, "mc_samples", "request parameter", minimum=1, maximum=1000)
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, Literal

import orjson

from app.protocol.errors import InvalidInput, UnsupportedMediaType
from app.protocol.limits import MAX_INT_DIGITS, MAX_TEXT_INT

# A plain decimal number as a header carries it: ASCII digits, an optional sign, fraction and exponent.
_DECIMAL = re.compile(r"[+-]?[0-9]+(\.[0-9]*)?([eE][+-]?[0-9]+)?", re.ASCII)


def json_type(value: object) -> str:
    """The JSON name of a parsed value, for messages: 'a string', 'a boolean', 'null', ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return f"the string {value[:32]!r}"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _refuse(where: str, key: str, expected: str, value: object) -> InvalidInput:
    return InvalidInput(f"{where} {key!r} must be {expected}, got {json_type(value)}")


def str_field(container: Mapping[str, Any], key: str, where: str) -> str | None:
    """The string member `key`, None when absent or null."""
    value = container.get(key)
    if value is not None and not isinstance(value, str):
        raise _refuse(where, key, "a string", value)
    return value


def bool_field(container: Mapping[str, Any], key: str, where: str) -> bool | None:
    """The boolean member `key` (true or false, never "false" or 0), None when absent or null."""
    value = container.get(key)
    if value is not None and not isinstance(value, bool):
        raise _refuse(where, key, "a boolean (true or false)", value)
    return value


def int_field(
    container: Mapping[str, Any], key: str, where: str, *, minimum: int | None = None, maximum: int | None = None
) -> int | None:
    """The integer member `key` within [minimum, maximum], None when absent or null."""
    value = _numeric(container, key, where, integral=True, minimum=minimum, maximum=maximum)
    return None if value is None else int(value)


def number_field(
    container: Mapping[str, Any], key: str, where: str, *, minimum: float | None = None, maximum: float | None = None
) -> float | None:
    """The finite number member `key` within [minimum, maximum], None when absent or null."""
    value = _numeric(container, key, where, integral=False, minimum=minimum, maximum=maximum)
    return None if value is None else float(value)


def _numeric(
    container: Mapping[str, Any], key: str, where: str, *, integral: bool, minimum: float | None, maximum: float | None
) -> int | float | None:
    value = container.get(key)
    if value is None:
        return None
    expected = "an integer" if integral else "a finite number"
    # bool is an int to Python, never a number to JSON.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _refuse(where, key, expected, value)
    if isinstance(value, float) and (integral or not math.isfinite(value)):
        raise _refuse(where, key, expected, value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bounds = f"in [{minimum if minimum is not None else '-inf'}, {maximum if maximum is not None else 'inf'}]"
        raise InvalidInput(f"{where} {key!r} must be {expected} {bounds}, got {value}")
    return value


def object_field(container: Mapping[str, Any], key: str, where: str) -> dict[str, Any]:
    """The object member `key`; an absent or null one is empty."""
    value = container.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _refuse(where, key, "an object", value)
    return value


def parameters_field(container: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A V2 `parameters` object (of the request, an input or an output): each parameter a scalar.

    A parameter is a boolean, a number or a string (null: absent), as the protocol defines it and
    as gRPC's InferParameter can only be; an array or an object is refused, never carried along.
    """
    parameters = object_field(container, "parameters", where)
    for name, value in parameters.items():
        if isinstance(value, (list, dict)):
            raise InvalidInput(
                f"{where} parameter {name[:64]!r} must be a boolean, a number or a string (parameters are "
                f"scalars), got {json_type(value)}"
            )
    return parameters


def list_field(container: Mapping[str, Any], key: str, where: str) -> list[Any] | None:
    """The array member `key`, None when absent or null."""
    value = container.get(key)
    if value is not None and not isinstance(value, list):
        raise _refuse(where, key, "an array", value)
    return value


def text_int(value: str | None, name: str, *, minimum: int = 0, maximum: int = MAX_TEXT_INT) -> int | None:
    """Text that is exactly a decimal integer of ASCII digits in [minimum, maximum]; None when absent."""
    if value is None:
        return None
    number = int(value) if value.isascii() and value.isdigit() and len(value) <= MAX_INT_DIGITS else None
    if number is None or not minimum <= number <= maximum:
        raise InvalidInput(f"{name} must be an integer in [{minimum}, {maximum}] in ASCII digits, got {value[:32]!r}")
    return number


def text_number(value: str | None, name: str) -> float | None:
    """Text that is exactly a finite decimal number in ASCII (250, 2.5, 1e3, -5); None when absent."""
    if value is None:
        return None
    number = float(value) if _DECIMAL.fullmatch(value) else math.nan
    if not math.isfinite(number):
        raise InvalidInput(f"{name} must be a finite decimal number in ASCII digits, got {value[:32]!r}")
    return number


def header_int(value: str | None, name: str) -> int | None:
    """A header holding a non-negative decimal integer (a length, a count), around optional whitespace."""
    return text_int(None if value is None else value.strip(" \t"), name)


def header_number(value: str | None, name: str) -> float | None:
    """A header holding a finite decimal number, around optional whitespace; None when absent."""
    return text_number(None if value is None else value.strip(" \t"), name)


def media_type(content_type: str | None) -> str | None:
    """The media type of a Content-Type header, lower-case and without parameters; None if absent."""
    if not content_type:
        return None
    return content_type.split(";", 1)[0].strip().lower()


def loads_json(body: bytes | bytearray | memoryview) -> object:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        # orjson refuses NaN/Infinity literals and nesting deeper than 1024.
        raise InvalidInput(f"malformed JSON: {exc}") from None


# ----- content codings, as Content-Encoding and Accept-Encoding name them (app/protocol/content_coding.py) -----

Coding = Literal["gzip", "deflate"]
CODINGS: dict[str, Coding] = {"gzip": "gzip", "x-gzip": "gzip", "deflate": "deflate"}
ANSWER_CODINGS: tuple[Coding, ...] = ("gzip", "deflate")  # preferred first at equal q


def request_coding(content_encoding: str | None) -> Coding | None:
    """The body's coding from Content-Encoding: None when absent or identity; any coding but gzip or deflate is 415."""
    if not content_encoding:
        return None
    value = content_encoding.strip().lower()
    if value in ("", "identity"):
        return None
    coding = CODINGS.get(value)
    if coding is None:
        raise UnsupportedMediaType(
            f"Content-Encoding {content_encoding[:64]!r} is not supported; send the body as gzip, deflate or uncompressed"
        )
    return coding


def quality_rated(header: str) -> list[tuple[str, float]]:
    """An Accept-style header's items, each lowercased with its q-value (1 when none; 0 when not a number, or NaN)."""
    items = []
    for item in header.split(","):
        name, *params = (part.strip().lower() for part in item.split(";"))
        q = 1.0
        for param in params:
            if param.startswith("q="):
                try:
                    q = float(param[2:])
                except ValueError:
                    q = 0.0
        items.append((name, q if q == q else 0.0))  # NaN: not acceptable
    return items


def answer_coding(accept_encoding: str | None) -> Coding | None:
    """The coding to answer in: gzip or deflate, whichever Accept-Encoding rates higher (gzip at equal q), else None.

    A coding named with q=0 is refused even where `*` would allow it; identity is always acceptable here.
    """
    if not accept_encoding:
        return None
    rated = {CODINGS.get(name, name): q for name, q in quality_rated(accept_encoding)}
    best: Coding | None = None
    for coding in ANSWER_CODINGS:
        q = rated.get(coding, rated.get("*", 0.0))
        if q > 0 and (best is None or q > rated.get(best, rated.get("*", 0.0))):
            best = coding
    return best
