"""ModelStatus: the one state of a served model, which every surface reports.

Health, model readiness, the model list, the V2 repository index, statistics and the metrics all
read it from here, so they cannot disagree. The names are Triton's repository states:

- LOADING: loaded or loading, not yet warm; no work is taken.
- READY: takes work.
- UNAVAILABLE: takes no work, with the reason: draining before shutdown, its batcher died, or
  unloaded (explicit model control; Triton's index lists an unloaded model so too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class ModelState(StrEnum):
    LOADING = "LOADING"
    READY = "READY"
    UNAVAILABLE = "UNAVAILABLE"


@dataclass(frozen=True)
class ModelStatus:
    """A state and, unless READY, why."""

    state: ModelState
    reason: str = ""
    # Read by every request (check_serving): a value set once, not a property computed each time.
    ready: bool = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ready", self.state is ModelState.READY)


READY = ModelStatus(ModelState.READY)
WARMING = ModelStatus(ModelState.LOADING, "warming up")  # a copy whose weights are loaded
DRAINING = ModelStatus(ModelState.UNAVAILABLE, "draining before shutdown")
UNLOADED = ModelStatus(ModelState.UNAVAILABLE, "unloaded")
