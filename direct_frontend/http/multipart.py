"""A ``multipart/form-data`` body read as it arrives (sans-IO, over python-multipart).

``POST /v1/files`` sends the file and its ``purpose`` as a form. The body is
fed to :class:`FormReader` chunk by chunk as it is received, so a file is
held once (its bytes), not twice (the body, then the file). A file part
past ``max_file_bytes``, text fields past :data:`MAX_FIELD_BYTES`, or a body
that is not a form is the caller's 400 or 413.
"""

from __future__ import annotations

from typing import Final

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

from direct_frontend.openai.errors import OpenAIHTTPError, invalid_request

#: the text fields of a form, all together, at most
MAX_FIELD_BYTES: Final = 64 * 1024


class Form:
    """What a form held: its text fields, and its file part (name and bytes), if any."""

    def __init__(self) -> None:
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.file: bytearray | None = None


class FormReader:
    """Feed it a ``multipart/form-data`` body's chunks, then :meth:`close` for the form."""

    def __init__(self, content_type: bytes, max_file_bytes: int) -> None:
        kind, options = parse_options_header(content_type)
        boundary = options.get(b"boundary")
        if kind != b"multipart/form-data" or not boundary:
            raise invalid_request("Expected a multipart/form-data body (the file and its "
                                  "purpose).")
        self.max_file_bytes = max_file_bytes
        self.form = Form()
        self._field_bytes = 0
        self._header_name = bytearray()
        self._header_value = bytearray()
        self._name: str | None = None
        self._filename: str | None = None
        self._data = bytearray()
        self._error: OpenAIHTTPError | None = None
        self._ended = False
        try:
            self._parser = MultipartParser(boundary, {
                "on_part_begin": self._part_begin, "on_header_field": self._header_field,
                "on_header_value": self._header_value_of, "on_header_end": self._header_end,
                "on_part_data": self._part_data, "on_part_end": self._part_end,
                "on_end": self._end,
            })
        except ValueError as exc:  # FormParserError among them
            raise invalid_request(f"Malformed multipart/form-data body: {exc}.") from None

    def feed(self, chunk: bytes) -> None:
        try:
            self._parser.write(chunk)
        except FormParserError as exc:
            raise invalid_request(f"Malformed multipart/form-data body: {exc}.") from None
        if self._error is not None:
            raise self._error

    def close(self) -> Form:
        if not self._ended:
            raise invalid_request("Malformed multipart/form-data body: it ends before its "
                                  "closing boundary.")
        return self.form

    # -- the parser's callbacks -------------------------------------------------------------
    def _part_begin(self) -> None:
        self._name = self._filename = None
        self._data = bytearray()

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def _header_value_of(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _header_end(self) -> None:
        if bytes(self._header_name).lower() == b"content-disposition":
            _, options = parse_options_header(bytes(self._header_value))
            self._name = options.get(b"name", b"").decode("utf-8", "replace")
            filename = options.get(b"filename")
            self._filename = None if filename is None else filename.decode("utf-8", "replace")
        self._header_name = bytearray()
        self._header_value = bytearray()

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._error is not None:
            return
        size = end - start
        if self._filename is not None:
            if len(self._data) + size > self.max_file_bytes:
                self._error = OpenAIHTTPError(
                    413, f"The file is larger than this server takes ({self.max_file_bytes} "
                    "bytes, [frontend.batches] max_file_bytes).", "invalid_request_error",
                    "file")
                return
        else:
            self._field_bytes += size
            if self._field_bytes > MAX_FIELD_BYTES:
                self._error = invalid_request(f"The form's fields are longer than "
                                              f"{MAX_FIELD_BYTES} bytes.")
                return
        self._data += data[start:end]

    def _part_end(self) -> None:
        if self._name is None:
            return
        if self._filename is not None:
            if self.form.file is None:  # the first file part is the file
                self.form.filename, self.form.file = self._filename, self._data
        else:
            self.form.fields[self._name] = self._data.decode("utf-8", "replace")
        self._data = bytearray()

    def _end(self) -> None:
        self._ended = True
