"""The HTTP door: the app's routes (native, V2), the guard, OpenAPI and docs pages, on the protocol core.

Its transport/ is our uvicorn protocol and connection budgets: the only code that touches uvicorn's internals.
"""
