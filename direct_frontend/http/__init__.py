"""The OpenAI-compatible HTTP surface: request validation and response rendering.

Both modules are sans-IO (bytes in, typed objects or bytes out) so the ASGI app
stays thin and every wire shape is tested without a server.
"""
