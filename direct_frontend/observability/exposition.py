"""Several worker processes' Prometheus text as one scrape, per-worker labelled (sans-IO).

``run --workers N`` serves one port from N processes, and a scrape reaches
whichever one the kernel hands the connection to. So every worker answers
``/metrics`` with every worker's series: each sample gains a
``worker="<index>"`` label, and a family's samples from all workers follow
its one ``# HELP``/``# TYPE`` header, as the text format requires. Summing
over ``worker`` gives the service's totals; a restarted worker's counters
start again from zero under its label, which Prometheus reads as a reset.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

#: the label every sample of a merged scrape carries
WORKER_LABEL = "worker"
#: what a histogram or summary family's samples may add to its name
_SUFFIXES = ("_bucket", "_count", "_sum", "_created", "_total", "_info")


@dataclasses.dataclass(slots=True)
class _Family:
    header: list[str] = dataclasses.field(default_factory=list)
    samples: list[str] = dataclasses.field(default_factory=list)


def labelled(sample: str, label: str) -> str:
    """A sample line with ``label`` (``key="value"``) as its first label."""
    name_end = len(sample)
    for i, char in enumerate(sample):
        if char in "{ ":
            name_end = i
            break
    name, rest = sample[:name_end], sample[name_end:]
    if rest.startswith("{"):
        inner = rest[1:]
        return f"{name}{{{label}{'' if inner.startswith('}') else ','}{inner}"
    return f"{name}{{{label}}}{rest}"


def _family_of(sample_name: str, known: Mapping[str, _Family]) -> str:
    if sample_name in known:
        return sample_name
    for suffix in _SUFFIXES:
        if sample_name.endswith(suffix) and sample_name[: -len(suffix)] in known:
            return sample_name[: -len(suffix)]
    return sample_name


def _sample_name(sample: str) -> str:
    return sample.split("{", 1)[0].split(" ", 1)[0]


def merge(texts: Mapping[str, str]) -> str:
    """``{worker: its exposition text}`` as one text, every sample labelled with its worker."""
    families: dict[str, _Family] = {}
    for worker, text in sorted(texts.items()):
        label = f'{WORKER_LABEL}="{worker}"'
        current: str | None = None
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    current = parts[2]
                    family = families.setdefault(current, _Family())
                    if not any(h.split(None, 2)[1] == parts[1] for h in family.header):
                        family.header.append(line)
                continue
            name = _sample_name(line)
            key = current if current is not None and name.startswith(current) \
                else _family_of(name, families)
            families.setdefault(key, _Family()).samples.append(labelled(line, label))
    out: list[str] = []
    for family in families.values():
        out.extend(family.header)
        # one sample name at a time (``_bucket``s, then ``_count``...), workers in order
        out.extend(sorted(family.samples, key=_sample_name))
    return "\n".join(out) + "\n"
