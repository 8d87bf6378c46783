"""Bucket arithmetic: sizes, the bucket of a batch, chunks, and the warm-up check's error measure."""

from __future__ import annotations

import math

import pytest
import torch

from app.engine.graphs import bucket_for, bucket_sizes, chunk_slices, fewest_rows, relative_error, tolerance


@pytest.mark.parametrize(
    ("max_rows", "sizes"),
    [
        (1, [1]),
        (2, [1, 2]),
        (64, [1, 2, 4, 8, 16, 32, 64]),
        (100, [1, 2, 4, 8, 16, 32, 64, 100]),
        (1024, [2**i for i in range(11)]),
    ],
)
def test_bucket_sizes(max_rows, sizes):
    assert bucket_sizes(max_rows) == sizes


def test_bucket_sizes_refuses_zero():
    with pytest.raises(ValueError):
        bucket_sizes(0)


def test_every_row_count_gets_the_smallest_bucket_that_holds_it():
    buckets = bucket_sizes(100)
    for rows in range(1, 101):
        bucket = bucket_for(rows, buckets)
        assert bucket is not None and bucket >= rows
        assert all(b < rows for b in buckets if b < bucket)  # no smaller bucket would hold it
    assert bucket_for(101, buckets) is None
    assert [bucket_for(r, buckets) for r in (1, 2, 3, 5, 33, 64, 65)] == [1, 2, 4, 8, 64, 64, 100]


def test_fewest_rows_is_one_past_the_bucket_below():
    buckets = bucket_sizes(100)
    assert [fewest_rows(b, buckets) for b in buckets] == [1, 2, 3, 5, 9, 17, 33, 65]
    assert fewest_rows(64, [64]) == 1


@pytest.mark.parametrize(
    ("rows", "chunk", "bounds"),
    [
        (1, 64, [(0, 1)]),
        (64, 64, [(0, 64)]),
        (65, 64, [(0, 64), (64, 65)]),
        (200, 64, [(0, 64), (64, 128), (128, 192), (192, 200)]),
    ],
)
def test_chunks_cover_the_rows_in_order(rows, chunk, bounds):
    assert [(s.start, s.stop) for s in chunk_slices(rows, chunk)] == bounds


def test_relative_error_is_the_norm_ratio_and_infinite_for_nan():
    expected = torch.tensor([3.0, 4.0])  # norm 5
    assert relative_error(torch.tensor([3.0, 4.5]), expected) == pytest.approx(0.1)
    assert relative_error(expected.clone(), expected) == 0.0
    assert math.isinf(relative_error(torch.tensor([float("nan"), 4.0]), expected))
    assert math.isinf(relative_error(torch.tensor([float("inf"), 4.0]), expected))


def test_tolerance_by_dtype_and_tf32():
    assert tolerance(torch.float32) < tolerance(torch.float32, tf32=True) <= tolerance(torch.bfloat16)
    assert tolerance(torch.float16, tf32=True) == tolerance(torch.float16)  # TF32 is about float32 only
