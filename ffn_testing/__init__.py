"""Tools for the tests and benchmarks that run a real ffn-serve: its launcher, free ports, raw requests, /metrics.

Not part of any distribution: neither the ffn-serve wheel nor the client-only ffn-client carries it
(a client install has no server to launch). The tests and bench/ import it from the repository root.
"""

from ffn_testing.launcher import (
    CLOCK_FACTOR,
    PROBE_TIMEOUT_S,
    REFUSE_STARTS,
    SERVE_COMMAND,
    STALL_S,
    Launcher,
    Process,
    ServerFailed,
    ServerProcess,
    StartPatience,
    StartRefused,
    exec_server,
    start_server,
    use_launcher,
)
from ffn_testing.metrics import metric_value, wait_for_metrics
from ffn_testing.ports import HOST, free_port, free_ports
from ffn_testing.procfs import process_tree, read_rss, tree_cpu_seconds
from ffn_testing.wire import http_request, raw_request

__all__ = [
    "CLOCK_FACTOR",
    "HOST",
    "PROBE_TIMEOUT_S",
    "REFUSE_STARTS",
    "SERVE_COMMAND",
    "STALL_S",
    "Launcher",
    "Process",
    "ServerFailed",
    "ServerProcess",
    "StartPatience",
    "StartRefused",
    "exec_server",
    "free_port",
    "free_ports",
    "http_request",
    "metric_value",
    "process_tree",
    "raw_request",
    "read_rss",
    "start_server",
    "tree_cpu_seconds",
    "use_launcher",
    "wait_for_metrics",
]
