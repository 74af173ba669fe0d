"""An image content part as every API's translation hands it on, and data URLs.

OpenAI's ``image_url`` parts, Anthropic's image blocks and the Responses
API's ``input_image`` all become one :class:`ImagePart`: a URL (``data:`` or
``http(s):``), the ``detail`` the client asked for, and ``param``, the path of
the part in the client's own body, so every refusal names what the client
sent whichever API it spoke.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
from typing import Final, Literal

import msgspec

from direct_frontend.multimodal.errors import MediaError

Detail = Literal["auto", "low", "high"]
DETAILS: Final = ("auto", "low", "high")


class ImagePart(msgspec.Struct, frozen=True, kw_only=True):
    """One image of a message, where its content part was (``param``)."""

    url: str
    detail: Detail = "auto"
    param: str = ""

    @property
    def is_data(self) -> bool:
        return self.url[:5].lower() == "data:"


@dataclasses.dataclass(frozen=True, slots=True)
class DataUrl:
    """A decoded ``data:`` URL: its media type (lower case, ``""`` if none) and bytes."""

    media_type: str
    data: bytes


def parse_data_url(url: str, param: str, max_bytes: int) -> DataUrl:
    """``data:[<media type>][;base64],<data>`` decoded; a 400 naming ``param`` if it is not one.

    Only base64 payloads are taken (an image in percent-encoding is not a thing
    clients send). The encoded length is checked before decoding, so an
    oversized payload costs no decode.
    """
    head, sep, payload = url[5:].partition(",")
    if not sep:
        raise MediaError("The image data URL has no ',' before its data.", param)
    fields = head.split(";")
    if fields[-1].strip().lower() != "base64":
        raise MediaError("The image data URL must be base64-encoded "
                         "('data:image/png;base64,...').", param)
    media_type = fields[0].strip().lower() if len(fields) > 1 else ""
    if len(payload) > (max_bytes + 2) // 3 * 4 + 4:
        raise MediaError(f"The image is larger than the {max_bytes} bytes this model accepts.",
                         param)
    try:
        data = base64.b64decode(payload.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("The image data URL's data is not valid base64.", param) from None
    if len(data) > max_bytes:
        raise MediaError(f"The image is larger than the {max_bytes} bytes this model accepts.",
                         param)
    if not data:
        raise MediaError("The image data URL holds no data.", param)
    return DataUrl(media_type, data)
