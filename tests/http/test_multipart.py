"""The upload form, read as it arrives (sans-IO): fields and the file from any chunking, and
what is not a form, or too large, refused with the caller's 4xx."""

from __future__ import annotations

import pytest

from direct_frontend.http.multipart import MAX_FIELD_BYTES, FormReader
from direct_frontend.openai.errors import OpenAIHTTPError

BOUNDARY = b"b0undary"
TYPE = b"multipart/form-data; boundary=" + BOUNDARY


def form(purpose: bytes, data: bytes, filename: bytes = b"in.jsonl") -> bytes:
    return (b"--%b\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n%b\r\n"
            b"--%b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"%b\"\r\n"
            b"Content-Type: application/jsonl\r\n\r\n%b\r\n--%b--\r\n") % (
        BOUNDARY, purpose, BOUNDARY, filename, data, BOUNDARY)


@pytest.mark.parametrize("size", [1, 7, 64, 10_000])
def test_a_form_is_read_from_chunks_of_any_size(size: int) -> None:
    data = b'{"custom_id": "a"}\r\n' * 300 + b"\xc3\xa9\n"
    body = form(b"batch", data, "é.jsonl".encode())
    reader = FormReader(TYPE, 1 << 20)
    for i in range(0, len(body), size):
        reader.feed(body[i:i + size])
    read = reader.close()
    assert read.fields == {"purpose": "batch"}
    assert read.filename == "é.jsonl" and read.file == data


def test_what_is_not_a_whole_form_is_a_400() -> None:
    for content_type in (b"application/json", b"multipart/form-data"):
        with pytest.raises(OpenAIHTTPError) as refused:
            FormReader(content_type, 100)
        assert refused.value.status == 400
    reader = FormReader(TYPE, 100)
    reader.feed(form(b"batch", b"{}")[:-10])
    with pytest.raises(OpenAIHTTPError, match="ends before"):
        reader.close()
    with pytest.raises(OpenAIHTTPError) as refused:
        FormReader(TYPE, 100).feed(b"--other\r\n\r\n")
    assert refused.value.status == 400


def test_a_file_or_fields_past_their_size_are_refused() -> None:
    with pytest.raises(OpenAIHTTPError) as refused:
        FormReader(TYPE, 10).feed(form(b"batch", b"x" * 11))
    assert refused.value.status == 413 and refused.value.param == "file"
    reader = FormReader(TYPE, 10)
    reader.feed(form(b"batch", b"x" * 10))
    assert reader.close().file == b"x" * 10
    with pytest.raises(OpenAIHTTPError) as refused:
        FormReader(TYPE, 10).feed(form(b"p" * (MAX_FIELD_BYTES + 1), b""))
    assert refused.value.status == 400
