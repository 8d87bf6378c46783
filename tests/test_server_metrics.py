"""The server breakdown ffn-loadtest reads from /metrics, against histograms worked out by hand."""

from __future__ import annotations

import math

import pytest

from ffn_client.server_metrics import MetricsUnavailable, breakdown, parse_snapshot


def page(
    counts: dict[str, tuple[list[float], float]], model: str = "demo", extra: str = "", header: bool = True
) -> str:
    """Prometheus text: for each metric, cumulative bucket counts at le 0.001, 0.01, 0.1, +Inf, and the sum."""
    bounds = ["0.001", "0.01", "0.1", "+Inf"]
    lines = []
    for name, (cumulative, total) in counts.items():
        lines += [f"# HELP {name} h", f"# TYPE {name} histogram"] if header else []
        lines += [
            f'{name}_bucket{{le="{le}",model="{model}"{extra}}} {c}' for le, c in zip(bounds, cumulative, strict=True)
        ]
        lines += [
            f'{name}_count{{model="{model}"{extra}}} {cumulative[-1]}',
            f'{name}_sum{{model="{model}"{extra}}} {total}',
        ]
    return "\n".join(lines) + "\n"


STAGE_NAMES = ("ffn_queue_seconds", "ffn_compute_seconds", "ffn_request_seconds")


def snapshot(queue, compute, total, rows=None, **kw):
    metrics = dict(zip(STAGE_NAMES, (queue, compute, total), strict=True))
    if rows is not None:
        metrics["ffn_batch_rows"] = rows
    return page(metrics, **kw)


def test_breakdown_is_the_difference_of_two_snapshots():
    before = parse_snapshot(
        snapshot(([1, 2, 2, 2], 0.005), ([0, 1, 1, 1], 0.004), ([0, 2, 2, 2], 0.01), rows=([0, 0, 1, 1], 0.05)), "demo"
    )
    # Since then: 10 requests queued 0.2 s in all (4 <= 1 ms, 6 in (1, 10] ms); 4 batches; 8 rows each.
    after = parse_snapshot(
        snapshot(
            ([5, 12, 12, 12], 0.205), ([0, 5, 5, 5], 0.024), ([0, 10, 12, 12], 0.31), rows=([0, 0, 5, 5], 0.05 + 32)
        ),
        "demo",
    )
    b = breakdown(before, after, "demo")
    assert (b.queue.count, b.compute.count, b.total.count) == (10, 4, 10)
    assert b.queue.mean_ms == pytest.approx(1000 * 0.2 / 10)
    assert b.compute.mean_ms == pytest.approx(1000 * 0.02 / 4)
    assert b.total.mean_ms == pytest.approx(1000 * 0.3 / 10)
    assert b.rows_per_batch == pytest.approx(8.0)
    # histogram_quantile: the 5th of 10 lies in (1, 10] ms, 1 of the 6 there: 1 + 9 * 1/6 ms.
    assert b.queue.p50_ms == pytest.approx(1 + 9 * (5 - 4) / 6)
    # p99: the 9.9th of 10, in the same bucket: 1 + 9 * 5.9/6 ms.
    assert b.queue.p99_ms == pytest.approx(1 + 9 * 5.9 / 6)


def test_quantile_in_the_inf_bucket_is_the_highest_finite_bound():
    empty = ([0, 0, 0, 0], 0.0)
    before = parse_snapshot(snapshot(empty, empty, empty), "demo")
    after = parse_snapshot(snapshot(empty, empty, ([0, 0, 1, 3], 2.05)), "demo")
    b = breakdown(before, after, "demo")
    assert b.total.p99_ms == pytest.approx(100.0)  # 2 of 3 above 0.1 s: PromQL answers the last finite bound
    assert b.total.mean_ms == pytest.approx(1000 * 2.05 / 3)
    assert math.isnan(b.queue.mean_ms) and math.isnan(b.queue.p50_ms) and b.queue.count == 0
    assert math.isnan(b.rows_per_batch)


def test_series_of_one_model_are_summed_over_other_labels_and_other_models_ignored():
    one = ([1, 1, 1, 1], 0.0005)
    other = ([9, 9, 9, 9], 1.0)
    # One family per metric, as one page of merged workers has it: the headers once, then every series.
    series = [dict(extra=',worker="1"'), dict(extra=',worker="2"', header=False), dict(model="other", header=False)]
    text = "".join(page({name: other if s.get("model") else one}, **s) for name in STAGE_NAMES for s in series)
    parsed = parse_snapshot(text, "demo")
    assert parsed["ffn_request_seconds"].count == 2 and parsed["ffn_queue_seconds"].cumulative == (2, 2, 2, 2)


def test_a_counter_that_went_back_is_reported_not_subtracted():
    five = ([5, 5, 5, 5], 1.0)
    before = parse_snapshot(snapshot(five, five, five), "demo")
    after = parse_snapshot(snapshot(([1, 1, 1, 1], 0.1), ([1, 1, 1, 1], 0.1), ([1, 1, 1, 1], 0.1)), "demo")
    with pytest.raises(MetricsUnavailable, match="restart"):
        breakdown(before, after, "demo")


def test_a_page_without_the_models_histograms_says_so():
    with pytest.raises(MetricsUnavailable, match=r"no ffn_queue_seconds.*'demo'"):
        breakdown({}, parse_snapshot("# TYPE up gauge\nup 1\n", "demo"), "demo")
    with pytest.raises(MetricsUnavailable, match="not Prometheus text"):
        parse_snapshot("ffn_request_seconds_bucket{le=oops} what\n", "demo")
