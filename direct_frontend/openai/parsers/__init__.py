"""Tool-call and reasoning parsers: model text in, ``tool_calls`` and ``reasoning_content`` out.

Sans-IO, one module per model family, picked by name from :mod:`.registry`
or by :func:`.detect.detect` from the chat template. The pipeline feeds each
choice's detokenized text (after stop strings) through one parser object, so a
migrated stream keeps the parser and its state.
"""
