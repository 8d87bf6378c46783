"""The engine: models on their devices, their batchers and their lifecycle. No HTTP here.

Errors are kinds (app.engine.errors) without statuses; the protocol core (app.protocol.errors) maps them.
"""
