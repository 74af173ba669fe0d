"""A chat template split around its loop over the messages, where each message's piece of
the prompt provably depends on that message, its position, and the messages it reads.

A chat template's render is the output of its top-level statements, one after
the other. When none of them leaves state for a later one (no ``set``, macro,
block, import or ``do`` outside the message loop, but a name set to the
messages themselves, as Llama 3's ``loop_messages``), each one's output depends
on the template's variables only, and the render is the concatenation of each
statement rendered on its own. :func:`split_template` finds templates whose
messages are read by one top-level ``{% for message in messages %}`` (no
filter, no ``else``, no ``break``) whose body reads, besides template
variables and the messages, only its message and ``loop.first``,
``loop.last``, ``loop.index`` and ``loop.index0``, and sets names only, not a
namespace's attribute: Jinja starts each iteration from the template's
variables, so what one sets the next does not see. Then an iteration's output
is a function of its message, its position, whether it is first or last, and
what it reads of the messages, and the loop's output over ``messages[a:b]``
can be rendered alone: :class:`SplitTemplate` renders the loop over a slice
with its positions shifted (``loop.index0`` reads ``a +`` the slice's),
``loop.first`` true only at 0 and ``loop.last`` only at the conversation's
end, and its reads of the messages noted (:class:`Reads`: the furthest one it
indexed, or that it read them otherwise). A conversation's next turn then
renders its new messages only, and takes the earlier ones' pieces from the
last turn's where the messages they read are the same
(pipeline/render_cache.py). Any other template has no split (None) and is
rendered whole.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final

import jinja2
from jinja2 import nodes

__all__ = ["SplitTemplate", "split_template"]

#: the loop attributes an iteration may read, and how the slice's become the whole's
_LOOP_ATTRIBUTES: Final = frozenset({"first", "last", "index", "index0"})
#: statements that leave state for later ones, or reach other templates
_STATEFUL: Final = (nodes.Assign, nodes.AssignBlock, nodes.Macro, nodes.CallBlock,
                    nodes.Block, nodes.Extends, nodes.Include, nodes.Import, nodes.FromImport,
                    nodes.ExprStmt, nodes.Scope, nodes.OverlayScope, nodes.EvalContextModifier,
                    nodes.ScopedEvalContextModifier, nodes.With)
#: what an iteration may not hold: a ``set`` of a name is the iteration's own (each starts
#: from the template's variables), a ``set`` of a namespace's attribute outlives it
_STATEFUL_IN_LOOP: Final = (*(kind for kind in _STATEFUL
                              if kind not in (nodes.Assign, nodes.AssignBlock)), nodes.NSRef)
#: the variables the slice's loop reads: where it starts, whether it holds the first and the
#: last message of the conversation (a template that reads these names has no split)
OFFSET, HEAD, TAIL = "__df_offset", "__df_head", "__df_tail"
#: the conversation's messages as an iteration reads them (:class:`Reads`)
ALL = "__df_all"


class _NotSplittable(Exception):
    """The template does not have the shape :func:`split_template` proves."""


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class SplitTemplate:
    """A chat template as what precedes its message loop, the loop, and what follows.

    ``render_chat``'s output equals ``head + loop(0, n) + tail``, with each
    rendered on the same variables, ``loop(a, b)`` on ``messages[a:b]``.
    """

    head: jinja2.Template
    loop: jinja2.Template
    tail: jinja2.Template
    #: whether ``head`` and ``tail`` read the messages only as ``messages[0]``, or whether
    #: there are any: then two conversations with the same first message (and variables)
    #: have the same ``head`` and ``tail``
    edges_by_first: bool
    #: whether an iteration reads ``messages`` (its neighbours, as Qwen2.5's tool results)
    reads_messages: bool

    def render_loop(self, variables: Mapping[str, object], messages: list[dict[str, object]],
                    start: int, stop: int, last: bool) -> tuple[str, int | None]:
        """The loop's output over ``messages[start:stop]`` (the conversation's ``messages``),
        and the furthest message an iteration read besides its own (-1: none; None: it
        read something else of them, their number say, or from their end); ``last``:
        whether ``messages[stop - 1]`` is the conversation's last."""
        reads = Reads(messages) if self.reads_messages else None
        text = self.loop.render({**variables, "messages": messages[start:stop], OFFSET: start,
                                 HEAD: start == 0, TAIL: last, ALL: reads})
        return text, (-1 if reads is None else reads.furthest())


class Reads(Sequence[dict[str, object]]):
    """A conversation's messages as an iteration reads them: ``messages[i]`` notes the
    furthest ``i``; anything else (their number, a slice, a negative or missing index,
    iterating, printing them) notes that the output depends on them all."""

    __slots__ = ("_furthest", "_items", "_whole")  # (a template reads no ``_`` attribute)

    def __init__(self, items: list[dict[str, object]]) -> None:
        self._items = items
        self._furthest = -1
        self._whole = False

    def furthest(self) -> int | None:
        return None if self._whole else self._furthest

    def __getitem__(self, i: Any) -> Any:
        if type(i) is int and 0 <= i < len(self._items):
            self._furthest = max(self._furthest, i)
        else:
            self._whole = True
        return self._items[i]

    def __len__(self) -> int:
        self._whole = True
        return len(self._items)

    def __iter__(self) -> Iterator[dict[str, object]]:
        self._whole = True
        return iter(self._items)

    def __contains__(self, item: object) -> bool:
        self._whole = True
        return item in self._items

    def __reversed__(self) -> Iterator[dict[str, object]]:
        self._whole = True
        return reversed(self._items)

    def __bool__(self) -> bool:
        self._whole = True
        return bool(self._items)

    def __eq__(self, other: object) -> bool:
        self._whole = True
        return self._items == other

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        self._whole = True
        return repr(self._items)


def split_template(env: jinja2.Environment, source: str) -> SplitTemplate | None:
    """``source`` split (see the module's docstring), or None where that is not proven."""
    try:
        return _split(env, source)
    except Exception:  # (a shape the proof cannot read, or Jinja compiles otherwise: whole)
        return None


def _split(env: jinja2.Environment, source: str) -> SplitTemplate | None:
    try:
        parsed = env.parse(source).body
        aliases = _aliases(parsed)
        at = _the_message_loop(parsed, aliases)
        if any(_is_alias(node) for node in parsed[at + 1:]):  # (the loop sees it undefined)
            raise _NotSplittable
        loop = parsed[at]
        assert isinstance(loop, nodes.For)
        names = frozenset({"messages", *aliases})
        _check_outside([n for n in parsed[:at] + parsed[at + 1:] if not _is_alias(n)],
                       names | _OURS)
        loop.iter = nodes.Name("messages", "load", lineno=loop.iter.lineno)
        loop.body = [_shifted(node, names) for node in loop.body]
    except _NotSplittable:
        return None
    reads = _renamed(loop.body, names)  # (what surrounds the loop is as parsed)
    head = [node for node in parsed[:at] if not _is_alias(node)]
    tail = parsed[at + 1:]
    return SplitTemplate(_compiled(env, head), _compiled(env, [loop]), _compiled(env, tail),
                         _first_message_only([*head, *tail]), reads)


def _renamed(body: list[nodes.Node], names: frozenset[str]) -> bool:
    """The iteration's reads of the messages (``names``) made reads of :data:`ALL`; whether
    there are any."""
    found = False
    for node in body:
        for inner in _walk(node):
            if isinstance(inner, nodes.Name) and inner.name in names:
                inner.name, found = ALL, True
    return found


def _compiled(env: jinja2.Environment, body: list[nodes.Node]) -> jinja2.Template:
    tree = nodes.Template(body, lineno=1)
    tree.set_environment(env)
    return env.from_string(tree)  # (jinja compiles a tree too)


def _is_alias(node: nodes.Node) -> bool:
    """Whether ``node`` is ``{% set <name> = messages %}`` (Llama 3's ``loop_messages``)."""
    return (isinstance(node, nodes.Assign) and isinstance(node.target, nodes.Name)
            and isinstance(node.node, nodes.Name) and node.node.name == "messages")


def _aliases(body: list[nodes.Node]) -> set[str]:
    """The names top-level statements set to the messages, each once, before anything else
    sets them (nothing else may: :func:`_check_outside`, :func:`_shifted`)."""
    names = [node.target.name for node in body if _is_alias(node)]  # type: ignore[attr-defined]
    if len(names) != len(set(names)):
        raise _NotSplittable
    return set(names)


def _the_message_loop(body: list[nodes.Node], aliases: set[str]) -> int:
    """Where the one top-level ``for <name> in messages`` (or in an alias of them, set
    before it) of the template is."""
    found = [i for i, node in enumerate(body) if isinstance(node, nodes.For)
             and isinstance(node.iter, nodes.Name) and node.iter.name in {"messages", *aliases}]
    if len(found) != 1:
        raise _NotSplittable
    loop = body[found[0]]
    assert isinstance(loop, nodes.For) and isinstance(loop.iter, nodes.Name)
    set_before = {node.target.name for node in body[:found[0]]  # type: ignore[attr-defined]
                  if _is_alias(node)}
    if (not isinstance(loop.target, nodes.Name) or loop.else_ or loop.test is not None
            or loop.recursive or loop.target.name in ("messages", "loop", *aliases)
            or loop.iter.name not in {"messages", *set_before}):
        raise _NotSplittable
    return found[0]


def _check_outside(body: list[nodes.Node], closed: frozenset[str]) -> None:
    """What surrounds the loop may read anything but the messages' aliases, set nothing."""
    for node in body:
        for inner in _walk(node):
            if isinstance(inner, _STATEFUL) or (
                    isinstance(inner, nodes.Name) and inner.name in closed - {"messages"}):
                raise _NotSplittable


def _first_message_only(body: list[nodes.Node]) -> bool:
    """Whether ``body`` reads ``messages`` only as ``messages[0]`` or as a truth value (in a
    test, under ``not``, or left of ``and``, whose value is then its right side's)."""
    for parent in body:
        for node in _walk(parent):
            for child in node.iter_child_nodes():
                if (isinstance(child, nodes.Name) and child.name == "messages"
                        and not _first_or_truth(child, node)):
                    return False
    return True


def _first_or_truth(name: nodes.Name, parent: nodes.Node) -> bool:
    if isinstance(parent, nodes.Getitem):
        arg = parent.arg
        return (parent.node is name and isinstance(arg, nodes.Const) and type(arg.value) is int
                and arg.value == 0)
    if isinstance(parent, nodes.If | nodes.CondExpr):
        return parent.test is name
    if isinstance(parent, nodes.And):
        return parent.left is name
    return isinstance(parent, nodes.Not)


def _walk(node: nodes.Node) -> Iterator[nodes.Node]:
    yield node
    for child in node.iter_child_nodes():
        yield from _walk(child)


#: the names the split's templates read that no template may
_OURS: Final = frozenset({OFFSET, HEAD, TAIL, ALL})


def _refused(node: nodes.Node, names: frozenset[str]) -> bool:
    """Whether an iteration may not hold ``node``: a statement that outlives it, a name of
    ours, a ``set`` of the messages (``names``)."""
    if isinstance(node, _STATEFUL_IN_LOOP):
        return True
    return isinstance(node, nodes.Name) and (
        node.name in _OURS or (node.name in names and node.ctx != "load"))


def _shifted(node: nodes.Node, names: frozenset[str]) -> nodes.Node:
    """An iteration's statement with the loop's position read as the conversation's; a
    :class:`_NotSplittable` if it sets a namespace's attribute, ``loop`` or the messages
    (``names``), reads a loop attribute but those shifted, or breaks out of the loop."""
    if _refused(node, names) or isinstance(node, nodes.Break):
        raise _NotSplittable
    if isinstance(node, nodes.Name) and node.name == "loop":
        raise _NotSplittable  # (the loop whole, not one of its attributes)
    if isinstance(node, nodes.Getattr) and _is_loop(node.node):
        return _loop_attribute(node)
    if isinstance(node, nodes.For):  # its body's ``loop`` is its own; not its filter's
        node.iter = _shifted(node.iter, names)  # nor its ``else``'s: those are the message loop's
        node.test = None if node.test is None else _shifted(node.test, names)
        node.else_ = [_shifted(inner, names) for inner in node.else_]
        _check_inner(node, names)
        return node
    for field, value in node.iter_fields():
        if isinstance(value, nodes.Node):
            setattr(node, field, _shifted(value, names))
        elif isinstance(value, list):
            setattr(node, field, [_shifted(v, names) if isinstance(v, nodes.Node) else v
                                  for v in value])
    return node


def _check_inner(loop: nodes.For, names: frozenset[str]) -> None:
    """An inner loop's body may break out of it, and read its own ``loop`` freely: neither
    reaches the message loop (its filter and ``else`` do: :func:`_shifted`); it may set
    names (its iteration's own) but not a namespace's attribute nor the messages
    (``names``)."""
    if isinstance(loop.target, nodes.Name) and loop.target.name == "loop":
        raise _NotSplittable
    for part in loop.body:
        if any(_refused(inner, names) for inner in _walk(part)):
            raise _NotSplittable
    if loop.recursive:
        raise _NotSplittable


def _is_loop(node: Any) -> bool:
    return isinstance(node, nodes.Name) and node.name == "loop"


def _loop_attribute(node: nodes.Getattr) -> nodes.Expr:
    """``loop.<attribute>`` as the whole conversation's loop reads it."""
    if node.attr not in _LOOP_ATTRIBUTES:
        raise _NotSplittable
    lineno = node.lineno
    own = nodes.Getattr(nodes.Name("loop", "load", lineno=lineno), node.attr, "load",
                        lineno=lineno)
    if node.attr == "first":
        return nodes.And(own, nodes.Name(HEAD, "load", lineno=lineno), lineno=lineno)
    if node.attr == "last":
        return nodes.And(own, nodes.Name(TAIL, "load", lineno=lineno), lineno=lineno)
    return nodes.Add(own, nodes.Name(OFFSET, "load", lineno=lineno), lineno=lineno)
