"""KV-cache awareness: engine KV events over ZeroMQ, sequence fencing and the block index.

``events``, ``sequence``, ``filters``, ``prefix``, ``table`` and ``index`` are sans-IO;
``subscriber`` is the thin Trio shell that connects them to an engine's PUB and
replay sockets. Import from the modules themselves: this package re-exports nothing.
"""
