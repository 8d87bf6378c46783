"""WeightsError, and the one-line form of a reason: no torch here, so that what reads a file's header or a
Hub cache before torch is imported (ffn_core/header.py, hub.py) reports as the loaders do."""

from __future__ import annotations


class WeightsError(ValueError):
    """A weight file that cannot be loaded as asked; the message names the file and the reason."""


def brief(exc: BaseException, limit: int = 300) -> str:
    """An exception in one line of at most `limit` characters, for a WeightsError's reason."""
    # torch's messages run to many lines of advice, and some quote a file's contents, which a
    # hostile file makes as long as it likes.
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"
