"""The comparison benchmarks' own arithmetic: bench/mosec_baseline.py's table (medians, multiples of each baseline) and
bench/codec.py's rounds."""

from __future__ import annotations

from bench.mosec_baseline import Cell, table


def cell(server: str, encoding: str, round_: int, rows_per_s: float) -> Cell:
    return Cell(server, encoding, 16, 16, round_, rows_per_s, 10.0 * round_, 20.0 * round_, 0)


def test_the_table_reports_medians_and_multiples_of_each_baseline() -> None:
    cells = [
        *(cell("ffn-serve", "json", n, rate) for n, rate in enumerate((6_000, 7_000, 9_000), 1)),
        *(cell("ffn-serve", "binary", n, rate) for n, rate in enumerate((14_000, 12_000, 13_000), 1)),
        *(cell("mosec (stdlib)", "json", n, rate) for n, rate in enumerate((1_000, 1_400, 1_200), 1)),
    ]
    text = table(cells)
    assert "| ffn-serve | json | 16 | 16 | 7,000 (6,000–9,000) | 20.00 | 40.00 | 0 |" in text
    assert "| mosec (stdlib) | json | 16 | 16 | 1,200 (1,000–1,400) |" in text
    # 7,000 / 1,200 and 13,000 / 1,200
    assert "| 16 | 16 | mosec (stdlib) | 5.8 | 10.8 |" in text


def test_bench_codec_times_each_cell_of_this_checkout() -> None:
    """bench/codec.py's round, in-process: a decode and an encode time for each encoding and row count."""
    from bench import codec

    cells = codec.one_round([1, 2], ["json", "raw"], seconds=0.01)
    assert set(cells) == {"json r=1", "raw r=1", "json r=2", "raw r=2"}
    assert all(cell["decode_us"] > 0 and cell["encode_us"] > 0 for cell in cells.values())
    text = codec.table({"this": [cells, cells]})
    assert text.splitlines()[2].startswith("| json r=1 | ")


def test_the_alternating_table_gives_each_sides_medians_and_their_ratio() -> None:
    from bench.alternating import Round
    from bench.alternating import table as alternating_table

    rounds = [
        *(Round("this", 1, 16, rate, cpu, 0) for rate, cpu in ((10_000, 100.0), (12_000, 90.0), (11_000, 95.0))),
        *(Round("other", 1, 16, rate, cpu, 0) for rate, cpu in ((9_000, 110.0), (10_000, 100.0), (11_000, 120.0))),
        Round("this", 256, 1, 200_000, 1_000.0, 1),
        Round("other", 256, 1, 250_000, 800.0, 0),
    ]
    lines = alternating_table(rounds).splitlines()
    # medians 11,000 and 10,000 rows/s (1.100), 95.0 and 110.0 µs (95 / 110 = 0.864)
    assert lines[2] == "| 1 | 16 | 11,000 | 10,000 | 1.100 | 95.0 | 110.0 | 0.864 | 0 |"
    assert lines[3] == "| 256 | 1 | 200,000 | 250,000 | 0.800 | 1000.0 | 800.0 | 1.250 | 1 |"


def test_bench_cold_times_each_call_warm_and_cold_and_restores_onednn() -> None:
    """bench/cold.py in miniature: every call timed both ways, and torch's oneDNN switch left as it was."""
    import torch

    from bench import cold

    before = torch.backends.mkldnn.enabled
    timings = cold.measure(repeat=3, sweep_mib=0.1)
    assert torch.backends.mkldnn.enabled == before
    assert len(timings) == 6 and all(t.warm_us > 0 and t.cold_us > 0 for t in timings)
    lines = cold.table(timings).splitlines()
    assert lines[2].startswith("| near-free model's pass, 16 rows | ") and len(lines) == 8
