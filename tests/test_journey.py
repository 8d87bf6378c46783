"""The journey of one request per door through a real server: the project files it enters stay few.

bench/journey.py records, with a profiler hook in the served process, the project files entered
on the event loop's thread while one request is in flight (the least of three recordings, the
background timers left out). The bounds are the layers a request should cross: door, protocol
core, engine and back (issue 27).
"""

from __future__ import annotations

import pytest

from bench import journey

pytestmark = pytest.mark.server


async def test_each_journey_crosses_at_most_its_files() -> None:
    found = await journey.journeys()
    assert set(found) == set(journey.LIMITS)
    for name, files in found.items():
        assert len(files) <= journey.LIMITS[name], f"{name}: {len(files)} files: {files}"
        # Each journey is one door's: it never enters the other door's code.
        other = "app/grpc/" if name != "gRPC ModelInfer" else "app/http/"
        assert not [file for file in files if file.startswith(other)], (name, files)
    assert any(file.startswith("app/engine/batcher.py") for file in found["native binary"])  # it was recorded
