"""Every fixed limit on what a client may make the server do, named once, with why it is that size.

The limits an operator tunes are settings (app/config/settings.py: max_body_bytes, max_held_bytes,
max_header_bytes, the timeouts, max_connections, ...). These are the ones no deployment needs to
change: far above what any request of the protocol needs, far below what makes parsing or
holding it costly. Both doors read them from here, so that a budget is the same whichever door
a request came through.
"""

from __future__ import annotations

# ----- tensors and JSON (app/protocol/tensors.py) -----------------------------------------------

MAX_RANK = 3  # [rows, d_model] or [batch, seq, d_model]
# Room in a JSON body's counts for what surrounds the tensor: V2's inputs, shape, outputs, parameters.
JSON_SLACK = 1024
# The envelope around the tensor: a V2 request needs a few dozen objects and strings (keys included).
# Counted as '{' and '"' characters before parsing, those inside strings too: far above any request's
# needs, far below what makes parsing costly (the review's 4.6 M keys cost 12x the body and 3 s).
MAX_JSON_OBJECTS = 4096
MAX_JSON_STRINGS = 16384
MAX_LONG_INTEGERS = 4096  # long integer literals examined at most for 64-bit range, one Python step each
NPY_MAX_HEADER = 65536  # an .npy header's length: numpy's own default limit
MAX_INT_DIGITS = 19  # a text integer never becomes a big Python int: at most 2**63 - 1 is asked for
MAX_TEXT_INT = 10**18 - 1  # lengths and counts written as text

# ----- request identity (app/observe/identity.py) ----------------------------------------------

# MAX_REQUEST_ID_LENGTH lives with the ids it bounds, in app/observe/identity.py.

# ----- bodies of the control requests: the HTTP routes' body limit, the gRPC methods' message limit --

LOG_SETTINGS_BYTES = 4096  # six small settings
SHARED_MEMORY_BYTES = 4096  # a register request: a key and two numbers
TRACE_SETTINGS_BYTES = 64 * 1024  # a few settings
MODEL_CONTROL_BYTES = 64 * 1024  # a load's config parameter is at most 16 KiB (app/engine/repository.py)
# Any other gRPC method that carries no tensor: names, a version, a flag.
OTHER_MESSAGE_BYTES = 4096

# ----- gRPC infer messages (app/grpc/wire.py) ---------------------------------------------------

# An infer request's bytes besides its tensor data (names, shape, parameters, outputs), and its
# fields in all: what a request needs many times over, a bound on the parser's memory and time.
MAX_OTHER_BYTES = 64 * 1024
MAX_FIELDS = 1024

# ----- gRPC connections (app/grpc/server.py) --------------------------------------------------

# Streams one connection may have open at once (SETTINGS_MAX_CONCURRENT_STREAMS; HTTP/2 asks for at
# least 100): a client's calls beyond it wait in the client. With max_connections connections, the
# most streams a process holds.
GRPC_STREAMS_PER_CONNECTION = 100

# ----- system shared memory (app/protocol/shared_memory.py) -------------------------------------

MAX_REGIONS = 256  # registered regions per process: each holds a descriptor

# The control messages' limits by gRPC method of inference.GRPCInferenceService: its HTTP twin's body limit.
_CONTROL_MESSAGE_BYTES = {
    "LogSettings": LOG_SETTINGS_BYTES,
    "SystemSharedMemoryRegister": SHARED_MEMORY_BYTES,
    "TraceSetting": TRACE_SETTINGS_BYTES,
    "RepositoryModelLoad": MODEL_CONTROL_BYTES,
    "RepositoryModelUnload": MODEL_CONTROL_BYTES,
}


def control_message_bytes(method: str) -> int:
    """The largest message a gRPC method that carries no tensor takes (its HTTP twin's body limit)."""
    return _CONTROL_MESSAGE_BYTES.get(method, OTHER_MESSAGE_BYTES)
