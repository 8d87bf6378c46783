"""Triton's trace settings (its trace extension), as they decide which requests are traced here.

Triton defines four settings per scope, the server's and optionally one model's:

- `trace_level`: OFF traces nothing; TIMESTAMPS traces each request's stages as spans; TENSORS
  adds what the tensors are (shape, dtype, bytes) to the decode and encode spans, never their
  values (users' embeddings stay out of trace stores).
- `trace_rate`: one request in N is traced: the N-th, 2N-th, ... request to arrive.
- `trace_count`: how many more requests to trace; -1 is no limit, 0 stops tracing.
- `log_frequency`: Triton writes its trace file every N traces (0: at shutdown only). Here traces
  leave over OTLP instead: N sends the collected spans at once after every N-th trace, 0 leaves
  them to the batch processor's schedule (OTEL_BSP_SCHEDULE_DELAY) and to shutdown.

As in Triton's OpenTelemetry mode, a request whose `traceparent` names a valid parent is traced
whatever the rate and count (unless the level is OFF), and trace_rate 0 is refused while tracing
is on. The OpenTelemetry sampler (OTEL_TRACES_SAMPLER) then decides on every request offered:
with its default, parentbased_always_on, every offered request is recorded unless its parent says
it is not sampled. A model's scope holds the settings set for it; the others follow the server's,
live, and so do their counters (a model without its own trace_count draws on the server's).

Counters are per serving process: with several workers, trace_count=10 traces up to 10 requests in
each. Updates reach every worker as control commands (app/protocol/v2/trace_extension.py).
"""

from __future__ import annotations

from typing import Any

OFF = "OFF"
LEVELS = ("TIMESTAMPS", "TENSORS")
FIELDS = ("trace_level", "trace_rate", "trace_count", "log_frequency")
MODE = "opentelemetry"


class Scope:
    """The settings one scope specifies, and the counters of those it specifies."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values: dict[str, Any] = {}
        self.turns = 0  # requests counted against this scope's trace_rate since it was set
        self.remaining = -1  # traces left under this scope's trace_count
        self.collected = 0  # traces ended since this scope's log_frequency was set
        for field, value in values.items():
            self.set(field, value)

    def set(self, field: str, value: Any) -> None:
        """Specify `field` (a new value restarts its counter), or stop specifying it with None."""
        if value is None:
            self.values.pop(field, None)
            return
        self.values[field] = tuple(value) if field == "trace_level" else int(value)
        if field == "trace_rate":
            self.turns = 0
        elif field == "trace_count":
            self.remaining = int(value)
        elif field == "log_frequency":
            self.collected = 0


class Policy:
    """How the requests of one model are traced now: its level, and the scopes whose counters it draws on."""

    __slots__ = ("_count", "_frequency", "_rate", "level", "tensors")

    def __init__(self, level: tuple[str, ...], rate: Scope, count: Scope, frequency: Scope) -> None:
        self.level = level  # () is OFF
        self.tensors = "TENSORS" in level
        self._rate, self._count, self._frequency = rate, count, frequency

    @property
    def remaining(self) -> int:
        """Traces left under this policy's trace_count (-1: no limit)."""
        return self._count.remaining

    def take_turn(self) -> bool:
        """Count a request without a traced parent; True if it is the one in trace_rate to trace."""
        rate = self._rate.values["trace_rate"]
        if self._count.remaining == 0 or rate == 0:
            return False
        self._rate.turns += 1
        return self._rate.turns % rate == 0

    def traced_one(self) -> None:
        """A request taken by its turn was recorded: one fewer left of trace_count."""
        if self._count.remaining > 0:
            self._count.remaining -= 1

    def collected_one(self) -> bool:
        """A trace ended; True if it is the log_frequency-th since the last send."""
        frequency = self._frequency.values["log_frequency"]
        if not frequency:
            return False
        self._frequency.collected += 1
        return self._frequency.collected % frequency == 0


class TraceSettings:
    """The server's scope and the models' scopes, and the Policy each request is traced by."""

    def __init__(self, tracing: bool) -> None:
        """`tracing`: whether spans have somewhere to go; without, the level is OFF and stays so."""
        self.tracing = tracing
        self.defaults: dict[str, Any] = {
            "trace_level": LEVELS[:1] if tracing else (),
            "trace_rate": 1,
            "trace_count": -1,
            "log_frequency": 0,
        }
        self._server = Scope(self.defaults)
        self._models: dict[str, Scope] = {}
        self._server_policy = self._policy(None)
        self._model_policies: dict[str, Policy] = {}

    def policy(self, model: str | None) -> Policy:
        """The policy of a request for `model`: its own if it has a scope, else the server's.

        Only models with a scope have an entry, so a request naming any model costs no memory.
        """
        return self._model_policies.get(model, self._server_policy) if model is not None else self._server_policy

    def apply(self, model: str | None, field: str, value: Any) -> None:
        """Set one field of the server's scope (None: back to its start-up value) or of a model's (None: follow the server's)."""
        assert field in FIELDS, f"unknown trace setting {field!r}; this is a bug."
        if model is None:
            self._server.set(field, self.defaults[field] if value is None else value)
        else:
            scope = self._models.setdefault(model, Scope({}))
            scope.set(field, value)
            if not scope.values:
                del self._models[model]
        self._server_policy = self._policy(None)
        self._model_policies = {name: self._policy(name) for name in self._models}

    def problem(self, model: str | None, updates: dict[str, Any]) -> str | None:
        """Why `updates` to a scope cannot be applied; None if they can (Triton's one rule: a rate of 0 traces nothing)."""
        if model is None:
            values = {**self._server.values, **{f: self.defaults[f] if v is None else v for f, v in updates.items()}}
        else:
            own = dict(self._models[model].values) if model in self._models else {}
            for field, value in updates.items():
                if value is None:
                    own.pop(field, None)
                else:
                    own[field] = value
            values = {**self._server.values, **own}
        if tuple(values["trace_level"]) and values["trace_rate"] == 0:
            return "Attempting to set invalid trace setting: sample rate must be non-zero"
        return None

    def describe(self, model: str | None) -> dict[str, Any]:
        """The settings in Triton's JSON: every value a string, the level a list of them."""
        policy = self.policy(model)
        values = self._effective(model)
        return {
            "trace_level": list(policy.level) or [OFF],
            "trace_rate": str(values["trace_rate"]),
            "trace_count": str(policy.remaining),
            "log_frequency": str(values["log_frequency"]),
            "trace_mode": MODE,
        }

    def _effective(self, model: str | None) -> dict[str, Any]:
        own = self._models[model].values if model is not None and model in self._models else {}
        return {**self._server.values, **own}

    def _owner(self, model: str | None, field: str) -> Scope:
        scope = self._models.get(model) if model is not None else None
        return scope if scope is not None and field in scope.values else self._server

    def _policy(self, model: str | None) -> Policy:
        return Policy(
            self._effective(model)["trace_level"],
            self._owner(model, "trace_rate"),
            self._owner(model, "trace_count"),
            self._owner(model, "log_frequency"),
        )
