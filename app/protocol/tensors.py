"""Tensor checks and conversions that both protocols share: shapes, JSON numbers, raw bytes.

Everything a client can get wrong is refused here with InvalidInput, before the batcher.
Raw tensors are little-endian and C order; they are viewed in the request's own buffer,
never copied. JSON bodies are counted before they are parsed, so that a body cannot ask for
more Python objects than the largest tensor the model would accept, and read in two parts
(read_json_body): the tensor's array, which alone has the allowance of rows × d_model values,
and the envelope around it (names, shape, parameters, outputs, id), which may hold at most
MAX_OTHER_BYTES, as a gRPC request's fields besides its tensor data may (app/grpc/wire.py).

Tensors are numpy arrays, as the engine's facade takes and answers them (app/engine/facade.py):
float32 and float16 in their own dtype, bfloat16 as uint16 arrays of its bit patterns
(ffn_core/dtypes.py). No torch here: the doors run in processes that never import it.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from app.protocol.errors import InvalidInput, NonFiniteOutput, PayloadTooLarge
from app.protocol.fields import json_type, loads_json
from app.protocol.limits import (
    JSON_SLACK,
    MAX_JSON_OBJECTS,
    MAX_JSON_STRINGS,
    MAX_LONG_INTEGERS,
    MAX_OTHER_BYTES,
    MAX_RANK,
)
from ffn_core.dtypes import DType

# bfloat16's bit patterns: sign, 8 exponent bits, 7 mantissa bits. Infinity and NaN are the
# patterns whose exponent is all ones: their magnitude (the sign cleared) is at least 0x7F80.
_BF16_MAGNITUDE = np.uint16(0x7FFF)
_BF16_NOT_FINITE = 0x7F80

# Integer literals beyond 64 bits, which orjson turns into floats: the characters of numbers mapped
# to three classes (digits to '9'; '.', 'e', 'E', '+' to '.'; '-' kept), everything else to ' ', so
# that a run of 19 or more digits standing alone is found at C speed.
_NUMBER_CLASSES = bytes(
    ord("9") if chr(i).isdigit() and i < 128 else ord(".") if chr(i) in ".eE+" else i if i == ord("-") else ord(" ")
    for i in range(256)
)
_LONG_RUN = b"9" * 19
_DIGITS = re.compile(rb"9*")
INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1


def check_shape(shape: Sequence[int], d_model: int) -> int:
    """Rows in a [rows, d_model] or [batch, seq, d_model] tensor; anything else is InvalidInput."""
    if not 2 <= len(shape) <= MAX_RANK:
        # A shape can hold millions of dimensions: the message shows a few.
        shown = list(shape) if len(shape) <= 8 else f"[{', '.join(map(str, shape[:8]))}, ...]"
        raise InvalidInput(
            f"expected a tensor of shape [rows, {d_model}] or [batch, seq, {d_model}], got rank {len(shape)} {shown}"
        )
    if shape[-1] != d_model:
        raise InvalidInput(f"last dimension must be d_model={d_model}, got {shape[-1]} (shape {list(shape)})")
    if any(dim < 1 for dim in shape):
        raise InvalidInput(f"every dimension must be at least 1, got shape {list(shape)}")
    return math.prod(shape[:-1])


def all_finite(array: np.ndarray) -> bool:
    """Whether an array of a tensor (bfloat16 as uint16 patterns) holds no NaN or infinity."""
    if array.dtype == np.uint16:  # bfloat16's patterns: the largest magnitude tells
        return not array.size or int(np.bitwise_and(array, _BF16_MAGNITUDE).max()) < _BF16_NOT_FINITE
    # The ufunc's reduce skips ndarray.all's Python wrapper.
    return bool(np.logical_and.reduce(np.isfinite(array), axis=None))


def check_finite(rows: np.ndarray) -> None:
    if not all_finite(rows):
        raise InvalidInput("inputs must be finite numbers: found NaN or Infinity")


class _FiniteBatch:
    """The last batch output found finite whole, so that its other requests' answers skip the check.

    A batch's answers are slices of one array (the batcher's output, app/engine/batcher.py), and a
    slice's `base` is that array: the first answer checked checks the whole batch in one pass, and
    the others find their base already checked, one identity test each. The array is held (not
    its id), so no later array can be mistaken for it; answers are never written after their batch.
    """

    checked: np.ndarray | None = None

    @classmethod
    def covers(cls, output: np.ndarray) -> bool:
        base = output.base
        if base is None or not isinstance(base, np.ndarray):
            return False
        if base is cls.checked:
            return True
        if base.dtype == output.dtype and all_finite(base):
            cls.checked = base
            return True
        return False  # some row of the batch is not finite: this answer is checked on its own


def check_finite_output(output: np.ndarray) -> None:
    """An answer holding inf or NaN (a finite input that overflowed) is refused, never sent as null or inf.

    Once per batch, not per request, where the answer is a slice of its batch's output."""
    if not _FiniteBatch.covers(output) and not all_finite(output):
        raise NonFiniteOutput(
            "the output overflowed its dtype (inf or NaN) for these finite inputs; "
            "scale the inputs down or ask for a wider dtype"
        )


def view_rows(
    buffer: bytes | bytearray | memoryview, dtype: DType, rows: int, d_model: int, offset: int = 0
) -> np.ndarray:
    """(rows, d_model) carrying `dtype` viewed in `buffer` at `offset`, without a copy; checked finite.

    The caller has checked that the buffer holds exactly rows * d_model elements from `offset`.
    A `bytes` buffer gives a read-only array; nothing on the way to the model writes into its
    input (the runner reads it, or copies it into a staging slot).
    """
    array = np.frombuffer(buffer, dtype=dtype.array, count=rows * d_model, offset=offset).reshape(rows, d_model)
    check_finite(array)
    return array


# What follows a member's name when its value is an array: the colon and the bracket, blanks between.
_ARRAY_VALUE = re.compile(rb"[ \t\r\n]*:[ \t\r\n]*\[")
BLANKS = b" \t\r\n"  # JSON's whitespace
_LEADING_BLANKS = re.compile(rb"[ \t\r\n]*")
# A member's name is looked for at most this often: a request names its tensor once (the body
# could name it in millions of places, each a step of Python).
MAX_NAME_SIGHTINGS = 64
COUNT_CHUNK = 1 << 20  # bytes of a tensor's text counted at once (_count_brackets_and_commas)
_OPEN_BRACKET, _COMMA = ord("["), ord(",")


@dataclass(frozen=True)
class JsonBody:
    """A JSON body parsed in two parts: the envelope, and the tensor's array apart.

    `envelope` is the document with the array's place holding an empty list; the array is
    parsed only when the protocol asks for it at that place (`tensor`), once everything else in
    the envelope has been checked.
    """

    envelope: object
    array: memoryview | None  # the tensor's array as sent; None: no member of the tensor's name holds an array
    sightings: int  # how often the body names the tensor's member ('"key"'): more than once is a duplicate key
    text: bytes | bytearray  # the whole body

    def tensor(self, value: object) -> object:
        """The tensor member's value, read from the envelope: its array parsed when it is that array's place."""
        if self.array is not None and value == []:
            return loads_json(self.array)
        return value

    @property
    def tensor_text(self) -> bytes | bytearray | memoryview:
        """The text a list `tensor` returned was parsed from: the array's own (a list in the envelope is that array's place)."""
        return self.array if self.array is not None else self.text


def read_json_body(body: bytes | bytearray | memoryview, key: str, max_rows: int, d_model: int) -> JsonBody:
    """Parse a JSON body whose tensor is the array member named `key`, each part bounded before it is parsed (413).

    Parsing makes a Python object of every value, array, object and string (a 3-byte `[],`
    becomes a 56-byte list, a 6-byte `"k":1,` a key and an int), so an unchecked body could
    cost 20x its size and seconds of the event loop. So the tensor's array is found first, at C
    speed: the value of the one member named `key` that holds an array (two such members are
    refused: a key is given once, and a parameter is a scalar); a valid tensor holds numbers,
    brackets and commas only, so it ends at the last ']' before the next quote or brace.
    - The array alone has the tensor's allowance: at most as many arrays and values (its '[' and
      ',' counted) as `max_rows` rows of `d_model` hold.
    - Everything else, the envelope (names, shape, parameters, outputs, id, any other member),
      may hold at most MAX_OTHER_BYTES, as a gRPC request's fields besides its tensor data may
      (app/grpc/wire.py), and at most MAX_JSON_OBJECTS objects and MAX_JSON_STRINGS strings.
    A parameter, shape or id holding millions of values is refused without a byte of it parsed,
    however large the tensor's allowance. Characters inside strings count too, which only makes
    the bounds stricter; nesting is checked on what was parsed (orjson stops at 1024 levels).
    """
    data = bytes(body) if isinstance(body, memoryview) else body
    start, sightings = _array_start(data, key)
    if start is None:  # all of it is envelope
        _check_envelope(data, len(data), len(data), key)
        return JsonBody(loads_json(data), None, sightings, data)
    end = _array_end(data, start, key)
    _check_envelope(data, start, end, key)  # before anything is copied
    _check_tensor_counts(data, start, end, max_rows, d_model)
    envelope = bytes(data[:start]) + b"[]" + bytes(data[end:])
    return JsonBody(loads_json(envelope), memoryview(data)[start:end], sightings, data)


def _array_start(data: bytes | bytearray, key: str) -> tuple[int | None, int]:
    """Where the one member named `key` holding an array has its '[' (None if none does), and how often `key` is named.

    A quoted name followed by a colon is a member's name wherever it is in a valid body (inside
    a string a quote is escaped, so the name cannot appear there whole). An array that may be the
    tensor's is not searched for the name: up to its first quote it holds none (a tensor of
    numbers has no quote at all), which spares a second pass over the tensor's text.
    """
    name = b'"' + key.encode() + b'"'
    starts = []
    sightings = 0
    at = data.find(name)
    for _ in range(MAX_NAME_SIGHTINGS):
        if at == -1:
            break
        sightings += 1
        after = at + len(name)
        value = _ARRAY_VALUE.match(data, after)
        if value is not None:
            starts.append(value.end() - 1)
            after = data.find(b'"', value.end())
            if after == -1:  # no quote after the array: no name either
                at = -1
                break
        at = data.find(name, after)
    else:
        if at != -1:
            raise InvalidInput(
                f"the JSON body names {key!r} more than {MAX_NAME_SIGHTINGS} times; a request names it once"
            )
    if len(starts) > 1:
        raise InvalidInput(
            f"the JSON body holds {len(starts)} arrays named {key!r} (a duplicate key, or an array in a "
            f"parameter): the tensor is the one array of that name, and parameters are scalars"
        )
    return (starts[0] if starts else None), sightings


def _array_end(data: bytes | bytearray, start: int, key: str) -> int:
    """Just past the ']' that closes the tensor's array at `start`: the last one before the next quote or brace."""
    stop = data.find(b'"', start)
    stop = len(data) if stop == -1 else stop
    for brace in (b"{", b"}"):
        at = data.find(brace, start, stop)
        if at != -1:
            stop = at
    end = data.rfind(b"]", start, stop) + 1
    between = bytes(data[end:stop]).strip(b" \t\r\n") if end else b"x"
    if between not in (b"", b","):
        if stop == len(data):
            raise InvalidInput(f"malformed JSON: the body ends inside the {key!r} array")
        found = {ord('"'): "a string", ord("{"): "an object"}.get(data[stop], "a value out of place")
        raise InvalidInput(f"{key!r} must contain only numbers in nested lists (found {found})")
    return end


def _check_envelope(data: bytes | bytearray, start: int, end: int, key: str) -> None:
    """Refuse (413) the envelope, `data` but data[start:end], past MAX_OTHER_BYTES or with too many objects or strings.

    Blanks around the document are not counted: they make no object, and the parser skips them
    at memory speed, so a padded body is bounded by the body limit alone.
    """
    size = len(data) - (end - start)
    if size > MAX_OTHER_BYTES:
        size -= _LEADING_BLANKS.match(data).end() + len(data) - len(data.rstrip(BLANKS))  # type: ignore[union-attr]
        if size > MAX_OTHER_BYTES:
            raise PayloadTooLarge(
                f"the request holds more than {MAX_OTHER_BYTES} bytes besides its tensor data (the {key!r} array): "
                "names, shape, parameters and outputs need far less, and each parameter is one scalar"
            )
    objects = data.count(b"{", 0, start) + data.count(b"{", end)
    quotes = data.count(b'"', 0, start) + data.count(b'"', end)
    if objects > MAX_JSON_OBJECTS or quotes > 2 * MAX_JSON_STRINGS:
        raise PayloadTooLarge(
            f"JSON body holds more than {MAX_JSON_OBJECTS} objects or {MAX_JSON_STRINGS} strings "
            "(its '{' and '\"' characters, counted before parsing); a request needs a few dozen"
        )


def _check_tensor_counts(data: bytes | bytearray, start: int, end: int, max_rows: int, d_model: int) -> None:
    """Refuse (413) a tensor's array with more arrays or values than `max_rows` rows of `d_model` hold."""
    max_arrays = 2 * max_rows + JSON_SLACK  # [batch, seq, d]: 1 + batch + rows arrays
    max_values = max_rows * d_model + max_arrays + JSON_SLACK
    arrays, commas = _count_brackets_and_commas(data, start, end)
    if arrays > max_arrays or commas > max_values:
        raise PayloadTooLarge(
            f"JSON body holds more arrays or values than {max_rows} rows of {d_model}; "
            f"send fewer rows per request, or a binary body"
        )


def _count_brackets_and_commas(data: bytes | bytearray, start: int, end: int) -> tuple[int, int]:
    """How many '[' and ',' data[start:end] holds, counted by numpy a COUNT_CHUNK at a time.

    bytes.count steps from one match to the next: a tensor's text is a third commas, which made
    it 7x slower than numpy's compare (140 against 14 µs for 16 rows of 768); chunks keep numpy's
    temporary masks small, whatever the body's size.
    """
    arrays = commas = 0
    for at in range(start, end, COUNT_CHUNK):
        codes = np.frombuffer(data, np.uint8, min(COUNT_CHUNK, end - at), at)
        arrays += int(np.count_nonzero(codes == _OPEN_BRACKET))
        commas += int(np.count_nonzero(codes == _COMMA))
    return arrays, commas


def json_numbers_to_array(
    value: object, field: str, source: bytes | bytearray | memoryview, dtype: DType
) -> np.ndarray:
    """Nested lists of JSON numbers -> a C-contiguous float32 array.

    Ragged lists, booleans, strings, null, integers beyond 64 bits and values that do not fit
    `dtype` are refused. `source` is the JSON text `value` was parsed from: it lets the common
    case skip the per-value type walk (no `true`/`false` anywhere means no booleans).
    """
    if not isinstance(value, list):
        raise InvalidInput(f"{field!r} must be a nested list of numbers, got {json_type(value)}")
    text = bytes(source) if isinstance(source, memoryview) else source
    # In a tensor's text (read_json_body: no strings or objects in it) these letters can only be
    # true, false or null; one memchr each, where a search for "true" was 10x slower.
    booleans = text.find(b"t") != -1 or text.find(b"f") != -1
    if booleans:
        _check_numbers_only(value, field)
    try:
        # With a literal the dtype is inferred (null makes an object array, refused below); with
        # numbers only they are read as float64 at once, the values orjson made.
        literal = booleans or text.find(b"n") != -1
        array = np.array(value) if literal else np.array(value, dtype=np.float64)
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        raise InvalidInput(f"{field!r} must be a rectangular nested list of numbers: {str(exc)[:200]}") from None
    if array.dtype.kind not in "fiu":
        raise InvalidInput(f"{field!r} must contain only numbers (found {_kind_name(array.dtype)})")
    if array.size:
        peak = max(float(array.max()), -float(array.min()))
        if peak >= 2.0**63 and array.dtype.kind == "f":  # only then can a float have been an integer literal
            wide = _integers_beyond_64_bits(text)
            if wide and np.isin(array, list(wide)).any():
                raise InvalidInput(f"{field!r} holds an integer beyond 64 bits; write large values as floats (1e20)")
        largest = dtype.largest
        if peak > largest:
            raise InvalidInput(
                f"{field!r} must be finite {dtype.name} numbers: {peak:g} is out of {dtype.name} range "
                f"(largest {largest:g})"
            )
    return np.ascontiguousarray(array, dtype=np.float32)


def _integers_beyond_64_bits(text: bytes | bytearray) -> set[float]:
    """The values (as orjson made them, floats) of the integer literals in `text` beyond 64 bits.

    A candidate is a run of 19 or more digits with nothing of a number around it but a leading
    '-'; one inside a string may look the same, so the caller counts only the values that are in
    the parsed tensor. Past MAX_LONG_INTEGERS candidates the rest go unexamined: this is a check
    of the client's own precision, never worth more than a bounded pass of the event loop.
    """
    classes = text.translate(_NUMBER_CLASSES)
    found: set[float] = set()
    start = classes.find(_LONG_RUN)
    for _ in range(MAX_LONG_INTEGERS):
        if start == -1:
            break
        run = _DIGITS.match(classes, start)
        assert run is not None, "'9*' matches anywhere; this is a bug."
        end = run.end()
        if start >= 1 and classes[start - 1] == ord("-"):
            start -= 1
        alone = (start == 0 or classes[start - 1] == ord(" ")) and (end == len(classes) or classes[end] == ord(" "))
        if alone:
            literal = bytes(text[start:end])
            try:
                in_range = INT64_MIN <= int(literal) <= UINT64_MAX
            except ValueError:  # past Python's 4,300 digits: far beyond 64 bits
                in_range = False
            if not in_range:
                found.add(float(literal))
        start = classes.find(_LONG_RUN, end)
    return found


def _check_numbers_only(value: list[object], field: str) -> None:
    """Walk the nested lists level by level (C-speed `map(type, ...)`): lists down to numbers only."""
    level: list[object] = value
    for _ in range(MAX_RANK + 1):
        kinds = set(map(type, level))
        if not level or kinds <= {int, float}:
            return  # numpy refuses what is left: empty or ragged
        if kinds <= {list}:
            level = list(itertools.chain.from_iterable(level))  # type: ignore[arg-type]
            continue
        odd = next((item for item in level if type(item) not in (int, float, list)), None)
        if odd is None:
            raise InvalidInput(f"{field!r} must be a rectangular nested list: arrays and numbers at one level")
        raise InvalidInput(f"{field!r} must contain only numbers, found {json_type(odd)}")
    raise InvalidInput(f"{field!r} is nested deeper than a rank-{MAX_RANK} tensor")


def _kind_name(dtype: np.dtype) -> str:
    return {"U": "strings", "S": "strings", "O": "mixed or non-numeric values", "b": "booleans"}.get(
        dtype.kind, str(dtype)
    )


def raw_bytes(array: np.ndarray) -> memoryview:
    """A C-contiguous array's bytes, little-endian, without a copy (bfloat16 its 16-bit patterns)."""
    return memoryview(array.data).cast("B")


def as_float32(array: np.ndarray) -> np.ndarray:
    """An answer's values as float32, exactly (JSON numbers): bfloat16's patterns are float32's upper halves."""
    if array.dtype == np.uint16:
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float32, copy=False)
