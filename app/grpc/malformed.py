"""Malformed: what a request that could not be parsed becomes, so that its method can refuse it through the table."""

from __future__ import annotations


class Malformed:
    """Stands for a request whose bytes did not parse (or were over the parse budget); `error` says why."""

    def __init__(self, error: Exception) -> None:
        self.error = error
