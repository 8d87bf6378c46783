"""ffn-serve: the HTTP and gRPC service around ffn_core.

Layers, one direction: `app.engine` (models, batchers, lifecycle; no web imports) under
`app.protocol` (what a request means, whichever door: admission, errors, tensors, V2 semantics),
under the two doors, `app.http` and `app.grpc`, which know nothing of each other. `app.main` wires
them into one service and `app.cli` runs it.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("ffn-serve")  # the one version string: pyproject.toml's
except PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "0+unknown"
