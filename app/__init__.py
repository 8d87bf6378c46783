"""ffn-serve: the HTTP service around ffn_core.

Layers, one direction: `app.engine` (batcher, runner, registry; no web imports) and
`app.web` (the edge: HTTP, protocols, the error table) both build on `app.settings` and
`app.metrics`; `app.main` wires them into one FastAPI app and `app.cli` runs it.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("ffn-serve")  # the one version string: pyproject.toml's
except PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "0+unknown"
