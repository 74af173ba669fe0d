"""The OpenAI API model: request types, the wire parser and OpenAI-shaped errors.

Below both the HTTP shell and the request pipeline, so neither reaches up into
the other for them. Sans-IO: bytes in, typed objects or bytes out.
"""
