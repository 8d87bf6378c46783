"""Prometheus text read as written: each sample line's name, labels and value.

prometheus_client's parser renames a counter's samples to `<name>_total` (OpenMetrics' rule), so
it reads Triton's `nv_inference_request_success` as `nv_inference_request_success_total`, a name
no scrape holds. Prometheus itself keeps the names as written; so does this reader.
"""

from __future__ import annotations

import re

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\d+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def samples_as_written(page: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample line of `page`, in order."""
    found = []
    for line in page.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        assert match is not None, f"not a sample line: {line!r}"
        name, inside, value = match.groups()
        labels = {
            key: re.sub(r"\\[\\\"n]", lambda m: _UNESCAPE[m.group(0)], v) for key, v in _LABEL.findall(inside or "")
        }
        found.append((name, labels, float(value)))
    return found


def value_as_written(page: str, name: str, **labels: str) -> float:
    """The sum of the samples named `name` whose labels include `labels` (0.0: none), as metric_value sums."""
    return sum(
        value
        for sample, have, value in samples_as_written(page)
        if sample == name and all(have.get(k) == v for k, v in labels.items())
    )
