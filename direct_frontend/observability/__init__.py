"""Metrics and logging: Prometheus metrics in an owned registry, and structured logs.

Both are sans-IO: metrics render to bytes for the ``/metrics`` route, logging
configures the stdlib root logger and never opens anything but a stream.
"""
