"""Reading Prometheus text exposition in tests."""

from __future__ import annotations

import re


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample in the text exposition format."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = "^" + re.escape(name) + (r"\{" + re.escape(want) + r"\}" if want else "") + r" (\S+)$"
    found = re.search(pattern, text, re.MULTILINE)
    assert found is not None, f"no sample {name}{{{want}}}"
    return float(found.group(1))
