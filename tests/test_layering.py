"""The package's floors: every import between rooms points down, and no module cycle exists.

The floor order is written down once, here. A room may import rooms on lower
floors only; rooms on one floor are siblings and never import each other.
Lazy imports inside functions count (they are still a dependency), and so do
``TYPE_CHECKING`` imports, for the floors and for cycles alike. What the HTTP
shell may take from the pipeline is allow-listed by name, here too.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "direct_frontend"

#: top to ground; a room is a subpackage or a top-level module of direct_frontend
FLOORS: tuple[frozenset[str], ...] = tuple(frozenset(f.split()) for f in (
    "cli",                   # the commands
    "daemon top",            # the composition root; the fleet viewer (a client)
    "http control",          # the ASGI shell; the long-lived tasks (siblings)
    "pipeline state",        # one request's walk, sans HTTP; the durable store
    "routing",               # policies over the catalog
    "fleet openai",          # the fleet file's model; the OpenAI API model
    "kv engines",            # the KV index and events; engine dialects and transport
    "simulator observability text multimodal",
    # protos: the engines' contract, generated (scripts/gen_protos.py); json_files: a model
    # directory's JSON files, for text and multimodal alike
    "errors __init__ protos json_files",
))

#: allowed upward arrows (room, room): none; an entry here needs a reason beside it
KNOWN: frozenset[tuple[str, str]] = frozenset()
#: allowed module cycles: none
KNOWN_CYCLES: frozenset[frozenset[str]] = frozenset()

#: all that http/ may import from pipeline/: the stair (its entry, what it is asked, the rest
#: of a background request's walk), the events it writes, and the values they carry. A
#: request crosses the two rooms through ``Stair`` in and its writer out
#: (tests/support/crossings.py counts it); everything else stays on its own side.
HTTP_FROM_PIPELINE: dict[str, frozenset[str]] = {
    "direct_frontend.pipeline.serve": frozenset({"Ask", "EmbedAsk", "Later", "Stair"}),
    "direct_frontend.pipeline.serve_events": frozenset({
        "Admitted", "Charged", "Embedded", "Placed", "Prepared", "Resolved", "StairEvent"}),
    "direct_frontend.pipeline.relay_events": frozenset({
        "Batch", "Echo", "Failed", "Finished", "Opened", "Usage"}),
    # a refusal over a rate limit, the values a 429 and the headers are written from, and
    # the limiter itself (the daemon hands it to the app; ``/fleet`` shows it)
    "direct_frontend.pipeline.ratelimit": frozenset({
        "RateLimited", "RateLimiter", "Refusal", "Standing", "Window"}),
    # the snapshot a request keeps to its end, the model table it is served from, and the
    # model list's entries
    "direct_frontend.pipeline.settings": frozenset({"Settings"}),
    "direct_frontend.pipeline.models": frozenset({"ModelCard", "ModelTable"}),
    # how large a body is parsed off the loop, and the one-at-a-time limiter it waits on
    "direct_frontend.pipeline.tokenizing": frozenset({
        "PARSE_INLINE_BYTES", "new_holding_limiter"}),
}


def floor_of(room: str) -> int:
    for level, rooms in enumerate(FLOORS):
        if room in rooms:
            return level
    raise AssertionError(f"room {room!r} is on no floor: add it to FLOORS")


@dataclasses.dataclass(frozen=True)
class Import:
    source: str  # dotted module name
    target: str
    line: int
    type_only: bool
    names: tuple[str, ...] = ()  # what ``from target import ...`` takes


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(path: Path) -> Iterator[Import]:
    source = module_name(path)
    package = source if path.name == "__init__.py" else source.rpartition(".")[0]

    def walk(node: ast.AST, type_only: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for stmt in child.body:
                    yield from walk_one(stmt, True)
                for stmt in child.orelse:
                    yield from walk_one(stmt, type_only)
            else:
                yield from walk_one(child, type_only)

    def walk_one(node: ast.AST, type_only: bool) -> Iterator[Import]:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("direct_frontend"):
                    yield Import(source, alias.name, node.lineno, type_only)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            if target.startswith("direct_frontend"):
                names = tuple(alias.name for alias in node.names)
                yield Import(source, target, node.lineno, type_only, names)
        else:
            yield from walk(node, type_only)

    yield from walk(ast.parse(path.read_text(encoding="utf-8")), False)


def all_imports() -> list[Import]:
    return [imp for path in sorted(PACKAGE.rglob("*.py")) for imp in imports_of(path)]


def test_every_import_between_rooms_points_down() -> None:
    upward = []
    for imp in all_imports():
        src, dst = room_of(imp.source), room_of(imp.target)
        if src == dst or (src, dst) in KNOWN:
            continue
        if floor_of(dst) <= floor_of(src):
            upward.append(f"{imp.source}:{imp.line} imports {imp.target} ({src} -> {dst})")
    assert not upward, "imports that do not point down:\n" + "\n".join(upward)


def test_known_exceptions_are_still_real() -> None:
    """An allowed upward arrow that no longer exists must leave ``KNOWN``."""
    seen = {(room_of(i.source), room_of(i.target)) for i in all_imports()}
    assert not KNOWN - seen


def http_imports_from_pipeline() -> list[Import]:
    return [imp for imp in all_imports()
            if room_of(imp.source) == "http" and room_of(imp.target) == "pipeline"]


def test_http_imports_from_pipeline_only_what_the_list_allows() -> None:
    outside = [
        f"{imp.source}:{imp.line} imports {', '.join(imp.names) or imp.target} from "
        f"{imp.target}"
        for imp in http_imports_from_pipeline()
        if not imp.names or not set(imp.names) <= HTTP_FROM_PIPELINE.get(imp.target, set())
    ]
    assert not outside, "http/ imports from pipeline/ what is not allowed:\n" + "\n".join(
        outside)


def test_the_http_allow_list_is_exactly_what_http_imports() -> None:
    """A name no longer imported leaves the list, so the list says what crosses."""
    used: dict[str, set[str]] = {}
    for imp in http_imports_from_pipeline():
        used.setdefault(imp.target, set()).update(imp.names)
    assert used == {module: set(names) for module, names in HTTP_FROM_PIPELINE.items()}


def import_graph(*, type_only: bool) -> dict[str, set[str]]:
    """Each module's imports of the package's modules (``type_only``: those too)."""
    graph: dict[str, set[str]] = {}
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    for imp in all_imports():
        if imp.type_only and not type_only:
            continue
        target = imp.target
        while target not in modules and "." in target:
            target = target.rpartition(".")[0]  # ``from pkg.mod import name``
        # ``from pkg import submodule`` depends on the submodule, not on the package
        targets = {f"{target}.{n}" for n in imp.names if f"{target}.{n}" in modules}
        if len(targets) < len(imp.names):
            targets.add(target)
        graph.setdefault(imp.source, set()).update(targets - {imp.source})
    return graph


def cycles_in(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycle = [*stack[stack.index(nxt):], nxt]
                if frozenset(cycle) not in KNOWN_CYCLES:
                    cycles.append(cycle)
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return cycles


def test_no_module_imports_itself_round_about() -> None:
    cycles = cycles_in(import_graph(type_only=False))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_cycle_through_type_only_imports_either() -> None:
    """A ``TYPE_CHECKING`` import never runs, but a cycle through one is still two modules
    that each need the other to be understood."""
    cycles = cycles_in(import_graph(type_only=True))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_every_room_has_a_floor() -> None:
    rooms = {room_of(module_name(p)) for p in PACKAGE.rglob("*.py")}
    for room in rooms:
        floor_of(room)
    placed = set().union(*FLOORS)
    assert not placed - rooms, f"floors name rooms that do not exist: {placed - rooms}"
