"""app/process/starting.py: a SIGTERM or SIGINT while starting stops the start, even where the code it
interrupted turned the stop into an error of its own."""

from __future__ import annotations

import os
import signal
import time

import pytest

from app.process.exits import EXIT_START_FAILED
from app.process.starting import Starting, StartStopped


def read_as_a_library_might() -> None:
    """A read whose library catches every exception and raises its own, as safetensors' tensor read
    did with the StartStopped raised inside it (ValueError: could not determine the shape ...)."""
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)  # the handler raises here, at once
    except BaseException as exc:
        raise ValueError("could not determine the shape of object type 'torch.storage.UntypedStorage'") from exc


def test_a_start_that_fails_as_the_signal_comes_was_stopped_by_it() -> None:
    with Starting() as starting:
        with pytest.raises(ValueError):
            read_as_a_library_might()
    assert isinstance(starting.stopped, StartStopped)
    assert starting.stopped.name == "SIGTERM"
    assert starting.stopped_the(EXIT_START_FAILED)
    assert not starting.stopped_the(0)


def test_a_start_that_fails_with_no_signal_failed() -> None:
    with Starting() as starting:
        code = EXIT_START_FAILED
    assert starting.stopped is None
    assert not starting.stopped_the(code)


def test_the_signal_raises_where_the_main_thread_is() -> None:
    with Starting() as starting, pytest.raises(StartStopped, match="received SIGINT while starting"):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(10)
    assert starting.stopped is not None and starting.stopped.name == "SIGINT"
