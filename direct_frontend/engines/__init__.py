"""Engines: the neutral request/event types, per-kind dialects and the I/O that drives them."""
