"""Observability: metrics and their collectors, logs, request identity."""
