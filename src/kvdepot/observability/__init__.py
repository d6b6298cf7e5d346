"""Metrics (and later events, logs and traces) in one place."""
