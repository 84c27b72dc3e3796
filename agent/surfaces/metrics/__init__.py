"""Prometheus metrics and the /healthz and /readyz probes."""
