"""A model's text side, loaded from a Hugging Face style model directory.

The frontend tokenizes and templates itself (engines only see token ids), so
this must match what ``transformers`` does with the same files: the same
chat template environment, the same special tokens, and the rendered chat
encoded *without* adding special tokens (the template already wrote them).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from direct_frontend.json_files import read_object
from direct_frontend.text.detokenize import IncrementalDetokenizer
from direct_frontend.text.encoder import Encoder
from direct_frontend.text.template_env import TemplateEnvironment
from direct_frontend.text.template_split import SplitTemplate, split_template
from direct_frontend.text.token_bound import ByteLevelBound
from direct_frontend.text.token_bytes import TokenBytes, byte_level_bytes

# The special-token names transformers passes to chat templates as variables.
_TEMPLATE_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_RESERVED_TEMPLATE_VARS = frozenset({"messages", "tools", "add_generation_prompt"})
#: a chat rendered at load: the fast encoder must agree on the template's own text too
_PROBE_CHAT: list[dict[str, object]] = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello! What's 2 + 2? 👋"},
    {"role": "assistant", "content": "4, of course."},
    {"role": "user", "content": "Thanks.\n\nNow in French?"},
]


class ModelDirError(Exception):
    """A model directory is missing a file or holds one that cannot be used."""


class ChatTemplateError(Exception):
    """The chat template refused or failed on the request's messages: a 400 for the client."""


def _raise_exception(message: str) -> None:
    """The ``raise_exception`` templates call to reject a conversation."""
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    """Templates put today's date in system prompts (Llama 3)."""
    return datetime.datetime.now().strftime(fmt)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """Plain ``json.dumps``, as transformers uses: jinja's own tojson HTML-escapes ``<>&'``.

    The same text as ``json.dumps`` with these arguments, from an encoder made once per
    set of arguments (``json.dumps`` makes one per call unless every argument is its
    default, and templates call this for every tool call of every message).
    """
    try:
        encoder = _json_encoder(ensure_ascii, indent, separators, sort_keys)
    except TypeError:  # an unhashable argument (separators as a list)
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)
    return encoder.encode(value)


@functools.lru_cache(maxsize=16)
def _json_encoder(ensure_ascii: bool, indent: int | str | None,
                  separators: tuple[str, str] | None, sort_keys: bool) -> json.JSONEncoder:
    """The encoder ``json.dumps`` makes for these arguments (it keeps no state between
    calls: one serves every thread)."""
    return json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                            sort_keys=sort_keys)


class _GenerationTag(jinja2.ext.Extension):
    """Accept ``{% generation %}...{% endgeneration %}`` and render its body as is.

    transformers uses the tag to mark assistant tokens for training masks; some
    shipped templates contain it and would not even parse without it.
    """

    tags = {"generation"}  # noqa: RUF012 - the attribute jinja2 reads

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _new_environment() -> ImmutableSandboxedEnvironment:
    env = TemplateEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationTag],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _read_optional_json(path: Path) -> dict[str, Any] | None:
    return _read_json(path) if path.is_file() else None


def _read_json(path: Path) -> dict[str, Any]:
    return read_object(path, ModelDirError)


def _token_content(value: object) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _int_ids(value: object) -> list[int]:
    """``eos_token_id`` as configs spell it: an int, a list of ints, or null."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


# Steps that never make the text shorter in UTF-8 bytes nor drop any of it.
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation"})


def _keeps_length(step: object, keeping: frozenset[str]) -> bool:
    """Whether a normalizer or pre-tokenizer (as tokenizer.json spells it) keeps every byte."""
    if step is None:
        return True
    if not isinstance(step, dict):
        return False
    kind = step.get("type")
    if kind == "Sequence":
        parts = step.get("normalizers", step.get("pretokenizers"))
        return isinstance(parts, list) and all(_keeps_length(p, keeping) for p in parts)
    if kind == "Replace":  # a literal replaced by something at least as long
        pattern, content = step.get("pattern"), step.get("content")
        return (
            isinstance(pattern, dict) and isinstance(pattern.get("String"), str)
            and isinstance(content, str)
            and len(content.encode()) >= len(pattern["String"].encode())
        )
    if kind in ("Split", "Punctuation") and step.get("behavior") == "Removed":
        return False
    return kind in keeping


def _max_bytes_per_token(spec: Mapping[str, Any], tokenizer: Tokenizer) -> int | None:
    """The most input bytes one token can stand for, when the tokenizer's shape bounds it.

    Then a text of ``n`` UTF-8 bytes has at least ``n / max`` tokens, which lets
    a prompt that cannot fit be refused without tokenizing it. Bounded only for
    BPE (each token spells its own bytes) behind steps that drop nothing and
    shrink nothing; an unknown token fused over a run, or an added token that
    strips the whitespace around it, can stand for any length: no bound.
    """
    model = spec.get("model")
    if not isinstance(model, dict) or model.get("type") != "BPE":
        return None
    if model.get("unk_token") is not None and model.get("fuse_unk") and not model.get(
        "byte_fallback"
    ):
        return None
    if not _keeps_length(spec.get("normalizer"), frozenset({"Prepend"})):
        return None
    if not _keeps_length(spec.get("pre_tokenizer"), _KEEPING_PRE_TOKENIZERS):
        return None
    added = tokenizer.get_added_tokens_decoder().values()
    if any(token.lstrip or token.rstrip for token in added):
        return None
    # A ByteLevel vocabulary spells each byte as one character, others spell the
    # text itself; an unknown character (if not fused) is one token of at most 4 bytes.
    byte_level = "ByteLevel" in json.dumps(spec.get("pre_tokenizer"))
    vocab = tokenizer.get_vocab(with_added_tokens=False)
    longest = max((len(t) if byte_level else len(t.encode()) for t in vocab), default=0)
    longest_added = max((len(t.content.encode()) for t in added), default=0)
    return max(longest, longest_added, 4)


def _byte_level_bound(spec: Mapping[str, Any], tokenizer: Tokenizer) -> ByteLevelBound | None:
    """The byte-level refinement of the bound (text/token_bound.py), where it is sound.

    Only for a byte-level BPE whose tokens spell the text's own bytes: no
    normalizer, a ByteLevel pre-tokenizer, and no added token that strips the
    whitespace around it (stripped bytes belong to no token).
    """
    model = spec.get("model")
    if not isinstance(model, dict) or model.get("type") != "BPE" or spec.get("normalizer"):
        return None
    if '"ByteLevel"' not in json.dumps(spec.get("pre_tokenizer")):
        return None
    added = tokenizer.get_added_tokens_decoder().values()
    if any(token.lstrip or token.rstrip for token in added):
        return None
    entries = [byte_level_bytes(piece) for piece in tokenizer.get_vocab(with_added_tokens=False)]
    if any(entry is None for entry in entries):
        return None
    return ByteLevelBound.of([*(e for e in entries if e is not None),
                              *(token.content.encode() for token in added)])


def _load_templates(
    path: Path, tokenizer_config: Mapping[str, Any]
) -> tuple[dict[str, str], Path | None]:
    """Find the chat templates, by name, with the precedence transformers uses."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return _read_template(jinja_file), jinja_file
    config_file = path / "tokenizer_config.json"
    raw = tokenizer_config.get("chat_template")
    if raw is None:
        # Processor-style models keep it next to the tokenizer files.
        config_file = path / "chat_template.json"
        processor_config = _read_optional_json(config_file)
        raw = processor_config.get("chat_template") if processor_config else None
    if raw is None:
        return {}, None
    if isinstance(raw, str):
        return {"default": raw}, config_file
    if isinstance(raw, list):
        templates: dict[str, str] = {}
        for entry in raw:
            if not (
                isinstance(entry, dict)
                and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)
            ):
                raise ModelDirError(
                    f"{config_file}: chat_template entries need a name and template"
                )
            templates[entry["name"]] = entry["template"]
        return templates, config_file
    raise ModelDirError(f"{config_file}: chat_template must be a string or a list")


def _load_tokenizer(tokenizer_file: Path) -> tuple[Tokenizer, dict[str, Any], str]:
    """The tokenizer, its ``tokenizer.json`` as JSON and as text."""
    if not tokenizer_file.is_file():
        raise ModelDirError(f"{tokenizer_file}: file missing")
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        spec_text = tokenizer_file.read_text(encoding="utf-8")
        spec = json.loads(spec_text)
    except Exception as exc:  # the Rust side raises plain Exception
        raise ModelDirError(f"{tokenizer_file}: cannot load tokenizer: {exc}") from exc
    # Some tokenizer.json files carry training-time truncation or padding;
    # transformers overrides both per call, so prompts must not be cut here.
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer, spec, spec_text


def _model_config(config_file: Path) -> dict[str, Any]:
    """``config.json`` (empty if there is none), a multimodal one's language model's fields
    over its own."""
    config = _read_optional_json(config_file) or {}
    text_config = config.get("text_config")
    if isinstance(text_config, dict):  # multimodal configs nest the language model
        config = {**config, **text_config}
    return config


def _read_template(template_file: Path) -> dict[str, str]:
    """A Jinja file as the only chat template."""
    try:
        return {"default": template_file.read_text(encoding="utf-8")}
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelDirError(f"{template_file}: cannot read: {exc}") from exc


def _compile_templates(sources: Mapping[str, str],
                       template_file: Path | None) -> dict[str, jinja2.Template]:
    """The chat templates compiled, by name; one that does not compile fails the load."""
    env = _new_environment()
    templates: dict[str, jinja2.Template] = {}
    for name, source in sources.items():
        try:
            templates[name] = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ModelDirError(
                f"{template_file}: chat template {name!r} does not compile: "
                f"{exc.message} (template line {exc.lineno})"
            ) from exc
    return templates


def _template_error(exc: Exception) -> ChatTemplateError:
    """A chat template's failure as :class:`ChatTemplateError` (the client's 400)."""
    if isinstance(exc, jinja2.TemplateError):
        # raise_exception() lands here with the template's own wording.
        return ChatTemplateError(exc.message or type(exc).__name__)
    # Templates index and concatenate client data freely; a TypeError
    # on e.g. null content is the request's fault, not the server's.
    return ChatTemplateError(f"chat template failed on these messages: {exc}")


class TextModel:
    """Tokenizer, chat templates and special tokens of one model; immutable once loaded.

    Safe to share between threads: ``encode`` runs in worker threads for long
    prompts, and nothing here mutates the tokenizer after :meth:`load`.
    """

    def __init__(
        self,
        *,
        path: Path,
        tokenizer: Tokenizer,
        tokenizer_config: Mapping[str, Any],
        templates: Mapping[str, jinja2.Template],
        eos_token_ids: Sequence[int],
        max_position_embeddings: int | None,
        max_bytes_per_token: int | None = None,
        decoder_spec: Mapping[str, Any] | None = None,
        template_sources: Mapping[str, str] | None = None,
        model_type: str | None = None,
        templates_read_clock: bool = False,
        byte_bound: ByteLevelBound | None = None,
        encoder: Encoder | None = None,
    ) -> None:
        self.path = path
        #: the chat templates' Jinja text, for reading which output parsers fit the model
        self.template_text: str = "\n".join((template_sources or {}).values())
        self.model_type = model_type  # config.json's, the fallback for that reading
        #: whether a chat template may read the clock (``strftime_now``): its render of the
        #: same messages then changes over time, so it must not be cached
        self.templates_read_clock = templates_read_clock
        #: each token's bytes and logprob strings (tokenizer.json's "decoder" says how)
        self.token_bytes = TokenBytes(tokenizer, decoder_spec)
        #: see :func:`_max_bytes_per_token`; None when the tokenizer does not bound it
        self.max_bytes_per_token = max_bytes_per_token
        #: the tighter bound of a byte-level BPE (text/token_bound.py), or None
        self.byte_bound = byte_bound
        #: encodes (text/encoder.py): fastokens where it agrees with ``tokenizer``
        self.encoder = encoder or Encoder(tokenizer, {}, "")
        self._tokenizer = tokenizer
        self._templates = dict(templates)
        #: the templates split around their message loop, where that is proven
        self._splits: dict[jinja2.Template, SplitTemplate | None]
        self._splits = {} if templates_read_clock else {
            template: split_template(template.environment, (template_sources or {})[name])
            for name, template in self._templates.items() if name in (template_sources or {})
        }
        self.max_position_embeddings = max_position_embeddings

        self._template_tokens: dict[str, str] = {}
        for name in _TEMPLATE_TOKEN_NAMES:
            content = _token_content(tokenizer_config.get(name))
            if content is not None:
                self._template_tokens[name] = content
        self.bos_token: str | None = self._template_tokens.get("bos_token")
        self.eos_token: str | None = self._template_tokens.get("eos_token")

        added = tokenizer.get_added_tokens_decoder()
        self.special_token_ids: frozenset[int] = frozenset(
            token_id for token_id, token in added.items() if token.special
        )
        # Model ids are dense from 0; added tokens may sit past the end or reuse ids.
        self.vocab_size: int = (
            max([tokenizer.get_vocab_size(with_added_tokens=False) - 1, *added]) + 1
        )

        ids = list(eos_token_ids)
        if self.eos_token is not None:
            eos_id = tokenizer.token_to_id(self.eos_token)
            if eos_id is not None:
                ids.append(eos_id)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))

    @classmethod
    def load(cls, path: str | Path, chat_template: Path | None = None) -> TextModel:
        """Load ``tokenizer.json`` and ``tokenizer_config.json`` (plus optional configs).

        ``chat_template``: a Jinja file used instead of the directory's own templates.

        A chat template that does not compile fails the load: a broken file is
        the operator's to fix, better found at startup than on the first chat.
        """
        path = Path(path)
        if not path.is_dir():
            raise ModelDirError(f"{path}: not a model directory")
        tokenizer, spec, spec_text = _load_tokenizer(path / "tokenizer.json")
        tokenizer_config = _read_json(path / "tokenizer_config.json")
        generation_config = _read_optional_json(path / "generation_config.json") or {}
        config = _model_config(path / "config.json")
        eos_ids = _int_ids(generation_config.get("eos_token_id")) or _int_ids(
            config.get("eos_token_id")
        )
        max_positions = config.get("max_position_embeddings")
        if not isinstance(max_positions, int) or isinstance(max_positions, bool):
            max_positions = None
        if chat_template is None:
            sources, template_file = _load_templates(path, tokenizer_config)
        else:
            sources, template_file = _read_template(chat_template), chat_template
        templates = _compile_templates(sources, template_file)

        model = cls(
            path=path,
            tokenizer=tokenizer,
            tokenizer_config=tokenizer_config,
            templates=templates,
            eos_token_ids=eos_ids,
            max_position_embeddings=max_positions,
            max_bytes_per_token=_max_bytes_per_token(spec, tokenizer),
            decoder_spec=spec.get("decoder"),
            template_sources=sources,
            model_type=config.get("model_type") if isinstance(config.get("model_type"), str)
            else None,
            templates_read_clock=any("strftime_now" in source for source in sources.values()),
            byte_bound=_byte_level_bound(spec, tokenizer),
            encoder=Encoder(tokenizer, spec, spec_text),
        )
        if model.encoder.fast and model.has_chat_template:
            with contextlib.suppress(ChatTemplateError):  # a template that needs more: no probe
                model.encoder.agrees([model.render_chat(_PROBE_CHAT)])
        return model

    @property
    def has_chat_template(self) -> bool:
        """Whether chat requests can be served (completions work regardless)."""
        return bool(self._templates)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids for ``text``; pass a rendered chat as is, its special tokens are in it.

        Holds the GIL throughout: for short texts (:meth:`Encoder.encode_batch` is the
        worker thread's call)."""
        return self.encoder.encode(text, add_special_tokens=add_special_tokens)

    def fewest_tokens(self, text: str, enough: int | None = None) -> int:
        """A lower bound on ``len(self.encode(text))`` without tokenizing (0 if unbounded).

        Costs a few C passes over the text's UTF-8 bytes (≈ 5 ms per MB), fewer when
        counting may stop at ``enough`` (the bound is then at least that).
        """
        if self.max_bytes_per_token is None:
            return 0
        data = text.encode()
        fewest = -(-len(data) // self.max_bytes_per_token)
        if self.byte_bound is not None and (enough is None or fewest < enough):
            fewest = max(fewest, self.byte_bound.fewest(data, enough))
        return fewest

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids`` in one go (streams use :meth:`new_detokenizer`)."""
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """A token's string in the vocabulary (``Ġhello``, ``<s>``), or None if out of it."""
        return self._tokenizer.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """The id of a token string (e.g. a special token), or None if not in the vocabulary."""
        return self._tokenizer.token_to_id(token)

    def new_detokenizer(self, *, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """A fresh per-request incremental detokenizer."""
        return IncrementalDetokenizer(self._tokenizer, skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: list[dict[str, object]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, object]] | None = None,
        extra: dict[str, object] | None = None,
    ) -> str:
        """Render ``messages`` with the model's chat template, as transformers would.

        ``extra`` carries request-specific template variables (e.g.
        ``enable_thinking``); it may override special-token variables but not
        the messages, tools or generation-prompt flag.
        """
        template = self._pick_template(tools)
        variables = self.template_variables(messages, add_generation_prompt, tools, extra)
        try:
            return template.render(variables)
        except Exception as exc:
            raise _template_error(exc) from exc

    def template_variables(self, messages: list[dict[str, object]], add_generation_prompt: bool,
                           tools: list[dict[str, object]] | None,
                           extra: dict[str, object] | None) -> dict[str, object]:
        """What a chat template renders on (:meth:`render_chat`'s arguments)."""
        variables: dict[str, object] = {**self._template_tokens}
        if extra:
            variables.update((k, v) for k, v in extra.items() if k not in _RESERVED_TEMPLATE_VARS)
        variables["messages"] = messages
        variables["tools"] = tools
        variables["add_generation_prompt"] = add_generation_prompt
        return variables

    def split_template(self, tools: object) -> SplitTemplate | None:
        """The template :meth:`render_chat` renders with ``tools``, split around its message
        loop (text/template_split.py); None where it has no split, or reads the clock."""
        return self._splits.get(self._pick_template(tools))

    def _pick_template(self, tools: object) -> jinja2.Template:
        if not self._templates:
            raise ChatTemplateError(
                "this model has no chat template; use the completions endpoint instead"
            )
        if tools and "tool_use" in self._templates:
            return self._templates["tool_use"]
        template = self._templates.get("default")
        if template is None:
            names = ", ".join(sorted(self._templates))
            raise ChatTemplateError(f"this model has no default chat template (it has: {names})")
        return template
