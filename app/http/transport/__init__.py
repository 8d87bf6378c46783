"""Our uvicorn HTTP/1.1 protocol and its connection budgets: the only code that touches uvicorn's internals.

One folder to port per uvicorn release (uvicorn_members.py lists what it relies on).
"""
