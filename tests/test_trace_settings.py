"""Triton's trace settings as rules: which requests a Policy picks, how scopes fall back, what a POST may say."""

from __future__ import annotations

from typing import Any

import pytest

from app.protocol.errors import InvalidInput
from app.protocol.v2.trace_extension import parse_update
from app.tracing.trace_settings import TraceSettings


def picked(settings: TraceSettings, model: str | None, requests: int) -> list[int]:
    """Which of `requests` requests without a parent the settings trace (1-based), each one recorded."""
    chosen = []
    for n in range(1, requests + 1):
        policy = settings.policy(model)
        if policy.level and policy.take_turn():
            policy.traced_one()
            chosen.append(n)
    return chosen


def test_the_defaults_trace_every_request_when_spans_have_somewhere_to_go() -> None:
    assert picked(TraceSettings(tracing=True), None, 3) == [1, 2, 3]
    assert TraceSettings(tracing=True).describe(None) == {
        "trace_level": ["TIMESTAMPS"],
        "trace_rate": "1",
        "trace_count": "-1",
        "log_frequency": "0",
        "trace_mode": "opentelemetry",
    }
    assert TraceSettings(tracing=False).describe("m")["trace_level"] == ["OFF"]
    assert picked(TraceSettings(tracing=False), None, 3) == []


def test_trace_rate_picks_one_request_in_n() -> None:
    settings = TraceSettings(tracing=True)
    settings.apply(None, "trace_rate", 3)
    assert picked(settings, None, 10) == [3, 6, 9]
    settings.apply(None, "trace_rate", 2)  # a new rate counts afresh
    assert picked(settings, None, 4) == [2, 4]


def test_trace_count_stops_after_that_many_and_minus_one_is_no_limit() -> None:
    settings = TraceSettings(tracing=True)
    settings.apply(None, "trace_count", 2)
    assert picked(settings, None, 5) == [1, 2]
    assert settings.describe(None)["trace_count"] == "0"  # what is left, as Triton shows it
    settings.apply(None, "trace_count", -1)
    assert picked(settings, None, 2) == [1, 2]
    assert settings.describe(None)["trace_count"] == "-1"


def test_a_model_scope_overrides_only_what_it_sets_and_follows_the_server_for_the_rest() -> None:
    settings = TraceSettings(tracing=True)
    settings.apply("a", "trace_level", ["TIMESTAMPS", "TENSORS"])
    settings.apply(None, "trace_rate", 2)  # later, on the server: model a follows it
    assert settings.describe("a") == {**settings.describe(None), "trace_level": ["TIMESTAMPS", "TENSORS"]}
    assert settings.policy("a").tensors and not settings.policy(None).tensors
    assert picked(settings, "a", 4) == [2, 4]
    settings.apply("a", "trace_level", [])  # OFF for model a only
    assert picked(settings, "a", 4) == [] and settings.describe("b")["trace_level"] == ["TIMESTAMPS"]
    settings.apply("a", "trace_level", None)  # null: back to the server's
    assert settings.describe("a") == settings.describe(None)


def test_a_model_without_its_own_count_draws_on_the_servers() -> None:
    settings = TraceSettings(tracing=True)
    settings.apply(None, "trace_count", 3)
    settings.apply("a", "trace_rate", 1)
    assert picked(settings, "a", 2) == [1, 2]
    assert picked(settings, None, 5) == [1]
    settings.apply("a", "trace_count", 1)  # its own count now
    settings.apply(None, "trace_count", 0)
    assert picked(settings, "a", 3) == [1] and picked(settings, None, 3) == []


def test_null_puts_a_server_setting_back_to_its_start_up_value() -> None:
    settings = TraceSettings(tracing=True)
    settings.apply(None, "trace_level", [])
    settings.apply(None, "log_frequency", 7)
    settings.apply(None, "trace_level", None)
    settings.apply(None, "log_frequency", None)
    assert settings.describe(None) == TraceSettings(tracing=True).describe(None)


def test_log_frequency_says_when_the_collected_traces_are_sent() -> None:
    settings = TraceSettings(tracing=True)
    assert [settings.policy(None).collected_one() for _ in range(3)] == [False] * 3  # 0: the processor's schedule
    settings.apply(None, "log_frequency", 2)
    assert [settings.policy(None).collected_one() for _ in range(4)] == [False, True, False, True]


def test_a_request_naming_any_model_costs_no_memory() -> None:
    settings = TraceSettings(tracing=True)
    for n in range(100):
        assert settings.policy(f"no-such-model-{n}") is settings.policy(None)


def test_a_rate_of_zero_is_refused_while_tracing_is_on() -> None:
    settings = TraceSettings(tracing=True)
    message = "Attempting to set invalid trace setting: sample rate must be non-zero"
    assert settings.problem(None, {"trace_rate": 0}) == message
    assert settings.problem("a", {"trace_rate": 0}) == message
    assert settings.problem(None, {"trace_rate": 0, "trace_level": []}) is None  # OFF: nothing to sample
    settings.apply("a", "trace_level", [])
    assert settings.problem("a", {"trace_rate": 0}) is None
    assert settings.problem("a", {"trace_rate": 0, "trace_level": None}) == message  # back to the server's level


# ----- what a POST body may say ----------------------------------------------------------------


def test_a_post_names_only_what_it_changes_in_triton_json() -> None:
    assert parse_update({}) == {}
    assert parse_update(
        {"trace_level": ["TENSORS", "TIMESTAMPS"], "trace_rate": "100", "trace_count": "-1", "log_frequency": "0"}
    ) == {"trace_level": ["TIMESTAMPS", "TENSORS"], "trace_rate": 100, "trace_count": -1, "log_frequency": 0}
    assert parse_update({"trace_level": ["OFF"]}) == {"trace_level": []}
    nulls = dict.fromkeys(["trace_level", "trace_rate", "trace_count", "log_frequency"])
    assert parse_update(nulls) == nulls
    assert parse_update({"trace_mode": "opentelemetry", "trace_rate": "4294967295"}) == {"trace_rate": 2**32 - 1}


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ([], "must be a JSON object"),
        ({"trace_file": "/tmp/t.json"}, "trace_file cannot be set"),
        ({"trace_file": None}, "trace_file cannot be set"),
        ({"trace_rat": "1"}, "unknown trace setting 'trace_rat'"),
        ({"trace_mode": "triton"}, "trace_mode must be 'opentelemetry'"),
        ({"trace_level": "TIMESTAMPS"}, "'trace_level' must be an array"),
        ({"trace_level": []}, "trace_level must be a list of strings"),
        ({"trace_level": [1]}, "trace_level must be a list of strings"),
        ({"trace_level": ["OFF", "TIMESTAMPS"]}, "'OFF' must be the only level"),
        ({"trace_level": ["TIMESTAMP"]}, "unknown trace level 'TIMESTAMP'"),
        ({"trace_rate": 10}, "'trace_rate' must be a string"),
        ({"trace_rate": "ten"}, "trace_rate must be a string holding an integer in [0, 4294967295]"),
        ({"trace_rate": "4294967296"}, "trace_rate must be a string holding an integer"),
        ({"trace_rate": "-1"}, "trace_rate must be a string holding an integer"),
        ({"trace_rate": " 1"}, "trace_rate must be a string holding an integer"),
        ({"trace_rate": "١٢"}, "trace_rate must be a string holding an integer"),
        ({"trace_rate": "9" * 5000}, "trace_rate must be a string holding an integer"),
        ({"trace_count": "-2"}, "trace_count must be a string holding an integer in [-1, 2147483647]"),
        ({"trace_count": "2147483648"}, "trace_count must be a string holding an integer"),
        ({"log_frequency": True}, "'log_frequency' must be a string"),
    ],
)
def test_a_post_that_says_anything_else_is_refused_naming_it(body: Any, says: str) -> None:
    with pytest.raises(InvalidInput) as info:
        parse_update(body)
    assert says in info.value.message
    assert len(info.value.message) < 300  # whatever was sent, the message stays short
