"""How the suite waits for a start (ffn_testing.StartPatience): by the CPU time it uses, not the clock.

A machine loaded ten times over starts a server ten times slower by the clock, at the same CPU
cost: the wait must outlast that, and still give up on a start that spins or is stuck.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from ffn_testing import CLOCK_FACTOR, HOST, StartPatience, free_ports, tree_cpu_seconds


class Readings:
    """A clock and a CPU meter that the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.cpu: float | None = 0.0

    def patience(self, budget: float, stall_s: float = 60.0) -> StartPatience:
        return StartPatience(lambda: self.cpu, budget, stall_s=stall_s, clock=lambda: self.now)


def test_a_slow_start_that_uses_cpu_is_waited_for_long_past_its_budget_by_the_clock() -> None:
    meter = Readings()
    patience = meter.patience(budget=90)
    for _ in range(80):  # 800 s by the clock, 0.05 s of CPU each 10 s: a tenth of a core would give 1 s
        meter.now += 10
        meter.cpu += 0.05  # type: ignore[operator]
        assert patience.exhausted() is None
    assert meter.now - 1000.0 == 800 > 90


def test_a_start_past_its_cpu_budget_is_given_up() -> None:
    meter = Readings()
    patience = meter.patience(budget=90)
    meter.now, meter.cpu = 1100.0, 89.0
    assert patience.exhausted() is None
    meter.now, meter.cpu = 1101.0, 90.5
    reason = patience.exhausted()
    assert reason is not None and "90.5 s of CPU time (its budget: 90 s)" in reason and "101 s by the clock" in reason


def test_a_start_that_uses_no_cpu_is_stuck_after_the_stall_time() -> None:
    meter = Readings()
    patience = meter.patience(budget=90, stall_s=60)
    meter.cpu = 2.0
    assert patience.exhausted() is None  # progress at 1000 s
    meter.now = 1059.0
    assert patience.exhausted() is None
    meter.now = 1061.0
    reason = patience.exhausted()
    assert reason is not None and reason.startswith("stuck: no CPU time used in 60 s (2.0 s in all, 61 s by the clock)")


def test_the_clock_bounds_a_start_that_creeps() -> None:
    meter = Readings()
    patience = meter.patience(budget=10, stall_s=60)
    for step in range(1, CLOCK_FACTOR * 10 // 5 + 1):  # 5 s at a time, a little CPU each time
        meter.now, meter.cpu = 1000.0 + 5 * step, 0.01 * step
        assert patience.exhausted() is None
    meter.now, meter.cpu = 1000.0 + CLOCK_FACTOR * 10 + 1, 1.0
    reason = patience.exhausted()
    assert reason is not None and reason.startswith(f"not ready within {CLOCK_FACTOR * 10 + 1} s by the clock")


def test_only_the_cpu_time_spent_while_waiting_counts() -> None:
    meter = Readings()
    meter.cpu = 500.0  # an in-process app: the test process had run for minutes before this start
    patience = meter.patience(budget=60)
    meter.now, meter.cpu = 1010.0, 559.0
    assert patience.exhausted() is None
    meter.now, meter.cpu = 1011.0, 561.0
    reason = patience.exhausted()
    assert reason is not None and "61.0 s of CPU time (its budget: 60 s)" in reason


def test_without_a_cpu_meter_the_clock_counts() -> None:
    meter = Readings()
    meter.cpu = None
    patience = meter.patience(budget=90)
    meter.now = 1090.0
    assert patience.exhausted() is None
    meter.now = 1090.5
    assert patience.exhausted() == "not ready within 90 s"


# /proc counts CPU in clock ticks (10 ms), user and system time each truncated: a child that spent
# 0.4 s by its own clock can read as 0.39 and some (a CI run saw 35.29 - 34.89).
TICKS = 0.02


def test_a_process_trees_cpu_time_counts_its_children_running_and_waited_for() -> None:
    spin = "import time\nend = time.process_time() + 0.4\nwhile time.process_time() < end: pass\nprint(flush=True)\n"
    before = tree_cpu_seconds(os.getpid())
    assert before is not None
    child = subprocess.Popen([sys.executable, "-c", spin + "time.sleep(60)"], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"\n"  # its 0.4 s of CPU are spent
        running = tree_cpu_seconds(os.getpid())
        assert running is not None and running - before >= 0.4 - TICKS
    finally:
        child.kill()
        child.wait()
    waited = subprocess.run([sys.executable, "-c", spin], check=True, capture_output=True)
    assert waited.returncode == 0
    after = tree_cpu_seconds(os.getpid())
    assert after is not None and after - running >= 0.4 - TICKS  # the second child, exited and waited for
    assert tree_cpu_seconds(2**22 + 12345) is None  # no such process


def test_ports_drawn_together_all_differ_and_are_free() -> None:
    # Drawn one at a time, a port closed may be handed out again at once: a server once got the
    # same HTTP and gRPC port and refused to start.
    ports = free_ports(64)
    assert len(set(ports)) == 64
    for port in ports:
        with socket.socket() as s:
            s.bind((HOST, port))  # nobody holds it any more
