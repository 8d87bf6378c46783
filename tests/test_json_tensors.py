"""A JSON tensor's decoding (app/protocol/tensors.py): values as the standard library reads them, and every refusal.

The common case (numbers only) is read by a shorter way than a body with a literal in it; both are
checked here against json.loads and numpy written in the test.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from app.protocol import kserve_v1, native
from app.protocol.errors import InvalidInput, PayloadTooLarge
from app.protocol.tensors import COUNT_CHUNK

D = 8


def reference(text: bytes) -> np.ndarray:
    """What the body's "inputs" hold, read by the standard library, as float32 rows."""
    return np.asarray(json.loads(text)["inputs"], dtype=np.float64).astype(np.float32).reshape(-1, D)


@pytest.mark.parametrize(
    "row",
    [
        "[1, 2, 3, 4, 5, 6, 7, 8]",  # integers
        "[-1.5e3, 2E-2, 0.1, -0, 1e+2, 3.25, -7, 1234567.875]",  # exponents, signs, a negative zero
        "[ 1 ,\t2 ,\r\n3,4,5,6,7,8 ]",  # JSON's blanks between values
        "[9007199254740993, 1, 2, 3, 4, 5, 6, 7]",  # an integer past float64's exact range
    ],
)
def test_numbers_decode_as_the_standard_library_reads_them(row: str) -> None:
    body = f'{{"inputs": [{row}, {row}]}}'.encode()
    decoded = native.decode_json(body, D, 64)
    assert decoded.rows.dtype == np.float32 and decoded.shape == (2, D)
    np.testing.assert_array_equal(decoded.rows, reference(body))


def test_a_batch_seq_tensor_keeps_its_shape() -> None:
    values = np.arange(2 * 3 * D, dtype=np.float32).reshape(2, 3, D) / 7
    body = json.dumps({"inputs": values.tolist()}).encode()
    decoded = native.decode_json(body, D, 64)
    assert decoded.shape == (2, 3, D)
    np.testing.assert_array_equal(decoded.rows, values.reshape(6, D))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("[[1, 2, 3, 4, 5, 6, 7, true]]", "must contain only numbers, found the boolean"),
        ("[[false, 2, 3, 4, 5, 6, 7, 8]]", "must contain only numbers, found the boolean"),
        ("[[1, 2, 3, 4, 5, 6, 7, null]]", "must contain only numbers"),
        ("[[1, 2, 3, 4], [5, 6, 7]]", "rectangular nested list"),
        ("[[1, 2, 3, 4, 5, 6, 7, [8]]]", "rectangular nested list"),
        ('[[1, 2, 3, 4, 5, 6, 7, "8"]]', "must contain only numbers"),
        ("[[1, 2, 3, 4, 5, 6, 7, 123456789012345678901234567890]]", "integer beyond 64 bits"),
        ("[[1, 2, 3, 4, 5, 6, 7, 1e39]]", "out of float32 range"),
    ],
)
def test_what_is_not_a_tensor_of_numbers_is_refused(data: str, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        native.decode_json(f'{{"inputs": {data}}}'.encode(), D, 64)


def test_a_member_named_again_after_the_tensor_is_a_duplicate_key() -> None:
    row = ", ".join(["1"] * D)
    with pytest.raises(InvalidInput, match='duplicate key "inputs"'):
        native.decode_json(f'{{"inputs": [[{row}]], "inputs": 1}}'.encode(), D, 64)
    with pytest.raises(InvalidInput, match='duplicate key "instances"'):
        kserve_v1.decode(f'{{"instances": [[{row}]], "instances": 1}}'.encode(), D, 64)


def test_the_tensor_counts_hold_across_count_chunks() -> None:
    """A tensor's text of three COUNT_CHUNKs: its values counted whole, refused past the allowance."""
    rows = 3 * COUNT_CHUNK // (D * 2) + 8  # "0," per value: more than three chunks of text
    body = json.dumps({"inputs": [[0] * D] * rows}, separators=(",", ":")).encode()
    assert len(body) > 3 * COUNT_CHUNK
    decoded = native.decode_json(body, D, rows)
    assert decoded.shape == (rows, D) and not decoded.rows.any()
    # An allowance of 80 % of the values the body holds (max_values: rows x (D + 2) + 2 x JSON_SLACK)
    # is passed only when every chunk is counted: a chunk alone holds a third of them.
    allowed = rows * D * 8 // 10 // (D + 2)
    with pytest.raises(PayloadTooLarge, match=f"more arrays or values than {allowed} rows"):
        native.decode_json(body, D, allowed)
