"""DeepSeek-V3.2 and V4 calls in DSML: ``<｜DSML｜invoke name="F"><｜DSML｜parameter …>``.

Each parameter says whether its value is text (``string="true"``) or JSON
(``string="false"``, or no attribute: JSON where it reads as JSON), so the
model, not the schema, types it. V3.2 wraps its calls in
``<｜DSML｜function_calls>``, V4 in ``<｜DSML｜tool_calls>``; the calls inside
are the same. (DeepSeek-V3.1 and V3.2-Exp wrote the older markers: ``deepseek_v31``.)
"""

from __future__ import annotations

import dataclasses
import re
from typing import ClassVar

from direct_frontend.openai.parsers.calls import SectionCallParser, SectionFormat
from direct_frontend.openai.parsers.xml_params import TaggedParamsBody

_DSML = "｜DSML｜"
_HEADER = re.compile(r'\s*"(?P<name>[^"]+)"\s*>')
_PAIR = re.compile(rf'\s*<{_DSML}parameter\s+name="(?P<key>[^"]+)"'
                   r'(?:\s+string="(?P<string>[^"]*)")?\s*>')


class DeepSeekV32Parser(SectionCallParser):
    name: ClassVar[str] = "deepseek_v32"
    FORMAT = SectionFormat(
        section=(f"<{_DSML}function_calls>", f"</{_DSML}function_calls>"),
        call=(f'<{_DSML}invoke name=', f"</{_DSML}invoke>"),
        body=lambda tools: TaggedParamsBody(tools, header=_HEADER, pair_open=_PAIR,
                                            value_end=f"</{_DSML}parameter>",
                                            openers=(f"<{_DSML}parameter",)))


class DeepSeekV4Parser(DeepSeekV32Parser):
    name: ClassVar[str] = "deepseek_v4"
    FORMAT = dataclasses.replace(DeepSeekV32Parser.FORMAT,
                                 section=(f"<{_DSML}tool_calls>", f"</{_DSML}tool_calls>"))
