"""A tiny, deterministic HF-layout model directory for tests and the demo fleet.

Real tokenizers are hundreds of megabytes away; this one is trained offline in
milliseconds on a built-in corpus, yet behaves like the real thing where it
matters to the frontend: byte-level BPE, ChatML special tokens, and rare
multi-byte characters (CJK, emoji) split over several tokens, so incremental
detokenization is exercised on every test run.

The built directory is committed inside the package (:data:`BUNDLED_DIR`,
written by ``scripts/make_demo_model.py``), so an installed frontend still has
it: the demo fleet's ``config/demo-model`` links to it and ``simulate-engine``
uses it when given no ``--model-dir``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
MAX_POSITION_EMBEDDINGS = 4096

BUNDLED_DIR = Path(__file__).resolve().with_name("demo-model")
"""The demo model as shipped (package data)."""

# ChatML, as Qwen-style models ship it: an optional tools block in the system
# turn, string or text-part content, and a raise_exception for unknown roles so
# template errors can be tested against a real template.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0].role == 'system' %}"
    "{{- messages[0].content + '\\n\\n' }}"
    "{%- endif %}"
    "{{- '# Tools\\n\\nYou may call these functions:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role not in ('system', 'user', 'assistant', 'tool') %}"
    "{{- raise_exception('Unknown message role: ' + message.role) }}"
    "{%- endif %}"
    "{%- if not (tools and loop.first and message.role == 'system') %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- elif message.content %}"
    "{%- for part in message.content %}"
    "{%- if part.type == 'text' %}{{- part.text }}{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{%- if message.tool_calls %}"
    "{%- for call in message.tool_calls %}"
    "{{- '\\n<tool_call>' + (call.function | tojson) + '</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# English carries the merges; it is repeated so that every English pair is
# frequent enough to merge. The multilingual part appears once, so its common
# characters merge while the rare ones stay split into byte tokens.
_ENGLISH = """\
The router reads a request, renders the chat template, and turns the prompt into token ids.
It then picks an engine that already holds the longest matching prefix in its cache, sends the
ids over gRPC, and streams the generated tokens back to the client as they arrive. When an
engine goes away in the middle of a stream, the router resumes the request on another engine
with the prompt and every token generated so far, so the client never notices the move.

Stop strings are checked by the frontend, not by the engine, so every engine stops at exactly
the same place. A stop string may arrive split over two chunks: the first chunk ends with the
letters EN and the next one starts with D. The matcher holds back the suffix that could still
become a stop string and releases it at the end of the stream when nothing matched.

Hello! How are you today? I am fine, thank you. What would you like to talk about? Let us talk
about the weather, the mountains, the rivers and the sea. The morning was cold and grey, but by
noon the sun came out and the children went down to the harbour to watch the fishing boats.
Their grandmother baked bread with honey, walnuts and a little salt, and everyone agreed it was
the best bread in the whole village. In the evening they played cards, told stories about old
sailors and listened to the rain on the roof until they fell asleep.

Numbers matter too: 0 1 2 3 4 5 6 7 8 9 10 11 12 16 20 32 42 64 100 128 256 512 1000 1024 2048
4096 8192 65536, prices such as $3.50 and 12.75 EUR, dates like 2024-05-17 and times like 09:30.
A quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs.

def fibonacci(n: int) -> list[int]:
    \"\"\"Return the first n Fibonacci numbers.\"\"\"
    values = [0, 1]
    while len(values) < n:
        values.append(values[-1] + values[-2])
    return values[:n]

for (int i = 0; i < count; ++i) { total += items[i].price * items[i].quantity; }
SELECT name, email FROM users WHERE active = 1 ORDER BY created_at DESC LIMIT 10;
{"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "stream": true}

Science explains the world with careful observation, measurement and experiment. Physicists
study energy, matter, light and gravity; chemists study molecules, reactions and elements;
biologists study cells, genes, plants, animals and the ecosystems they share. Astronomers point
telescopes at distant galaxies and measure how quickly they move away from us. Mathematicians
prove theorems about numbers, shapes, functions, probability and infinity.

The history of computing begins with mechanical calculators and continues through vacuum tubes,
transistors, integrated circuits and microprocessors. Operating systems schedule processes,
manage memory and files, and talk to devices through drivers. Networks carry packets between
machines; protocols such as TCP, HTTP and TLS define how the packets are ordered, requested and
protected. Databases store records in tables and answer queries using indexes and transactions.

Language models predict the next token from the previous ones. Training adjusts billions of
parameters with gradient descent on large collections of text; inference runs the model forward
one step at a time, sampling each new token with a temperature, a top p threshold or a top k
limit. Tokenizers split text into pieces that the model can read: common words become single
tokens, while rare words and unusual characters are broken into several smaller pieces.

Good software is simple, tested and documented. Write small functions with clear names, keep
the state in one place, handle errors where you can do something useful about them, and measure
before you optimise. Reviewers should read the tests first, then the code, and ask why rather
than how. Deployment should be boring: build once, verify, roll out gradually, watch the
metrics, and roll back quickly when something looks wrong.

Cooking is chemistry you can eat. Onions soften and sweeten in butter over a low heat; garlic
burns quickly, so add it later. Rice wants twice its volume of water, a lid and patience. Fresh
herbs go in at the end, dried herbs at the start. Taste as you go, season with salt and pepper,
and finish with a squeeze of lemon or a spoon of yoghurt.

Travel teaches geography better than any map. Trains cross the plains from east to west; ferries
link the islands in summer; buses climb the narrow mountain roads to villages where the market
opens at dawn every Saturday. Pack light, carry water, learn a few polite words in the local
language, and always keep a copy of your passport somewhere safe.

Gardening rewards patience. Tomatoes need sunshine, stakes and regular watering; potatoes grow
happily in heavy soil; strawberries spread runners across the beds unless you cut them back.
Compost turns kitchen scraps, leaves and grass clippings into dark, crumbly humus. Bees visit
lavender, rosemary, thyme and clover, while hedgehogs hunt slugs among the lettuces at night.
Autumn brings apples, pears, plums, pumpkins and the smell of smoke from distant bonfires.

Music combines rhythm, melody and harmony. An orchestra gathers violins, violas, cellos, double
basses, flutes, oboes, clarinets, bassoons, trumpets, horns, trombones, timpani and a conductor
who keeps everybody together. Jazz musicians improvise over chord progressions, choirs rehearse
carefully balanced voices, and a drummer in a garage band simply plays louder than everyone.

Economics describes how households, companies and governments choose between scarce resources.
Supply and demand set prices in competitive markets; central banks raise or lower interest rates
to steer inflation; taxes fund hospitals, schools, railways, libraries, courts and pensions.
Investors compare risk with expected return, diversify their portfolios, and worry about debt,
unemployment, productivity, exchange rates and quarterly earnings reports.

Medicine relies on evidence from clinical trials. Doctors diagnose symptoms, order blood tests
and scans, prescribe antibiotics for bacterial infections, and recommend vaccination, exercise,
sleep and a balanced diet. Nurses monitor temperature, pulse, breathing and blood pressure;
pharmacists check doses and interactions; surgeons operate under sterile conditions with
anaesthetists watching every vital sign throughout the procedure.

Sport gathers crowds in stadiums around the world. Football, basketball, tennis, cricket, rugby,
cycling, swimming, rowing, athletics and skiing each have their own rules, heroes and rivalries.
Athletes train for years, coaches plan tactics, referees enforce fairness, and supporters sing,
cheer, complain about decisions and celebrate victories long into the night.

Architecture shapes how we live and work. Engineers calculate loads on beams, columns, arches,
foundations and bridges; architects draw plans, sections and elevations; builders pour concrete,
lay bricks, fit windows and install plumbing, wiring, insulation and ventilation. Old cathedrals
took centuries to finish, whereas modern skyscrapers rise several floors every single week.

Please summarise the following document in three bullet points. Translate this paragraph into
French. Explain recursion to a beginner. Write a haiku about autumn leaves. Which is heavier, a
kilogram of feathers or a kilogram of steel? Generate a short story about a robot who learns to
paint, then suggest a title, a genre and an audience. Sure, here is an answer; certainly, I can
help with that; unfortunately, I do not know; however, here are some possible explanations.

Animals fill forests, deserts, oceans, jungles and cities. Elephants remember water holes across
huge distances, dolphins whistle to each other, owls hunt silently at twilight, penguins huddle
against freezing winds, squirrels bury acorns and forget half of them, and octopuses escape from
aquariums by squeezing through astonishingly small gaps between the glass and the lid.
"""

_MULTILINGUAL = """\
Café, naïve, résumé, façade, déjà vu, crème brûlée, über, Straße, Grüße, Ärger, Öl, señor,
mañana, jalapeño, São Paulo, coração, Dvořák, Łódź, Kraków, smörgåsbord, fjörður, Ελλάδα, Москва.
日本語の文章も少しだけ含めます。東京は大きな都市です。
中文也有一点。今天天气很好。我们去公园散步吧。
한국어 문장도 조금 있습니다.
Emoji appear in chat all the time 😀 👍 🎉 🚀 ❤️ 🤖 and some are rarer still 🦜 🧬 🪐.
Mathematical symbols: ∑ ∫ √ ∞ ≈ ≠ ≤ ≥ → ⇒ ∀ ∃, currency: € £ ¥ ₹ ₩.
"""


def corpus() -> list[str]:
    """The training corpus, one line per item, in a fixed order."""
    english = _ENGLISH.splitlines()
    return english * 3 + _MULTILINGUAL.splitlines()


def train_tokenizer(*, vocab_size: int = 2000) -> Tokenizer:
    """Train the byte-level BPE tokenizer; the same inputs give the same tokenizer."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    # Appended after training so they sit at the end of the vocabulary, as in
    # real ChatML models.
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def build_model_dir(path: Path, *, vocab_size: int = 2000) -> Path:
    """Write tokenizer and config files for the demo model into ``path``; returns ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(vocab_size=vocab_size)
    (path / "tokenizer.json").write_text(tokenizer.to_str(pretty=False) + "\n", encoding="utf-8")

    special_ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    eos_id = special_ids[EOS_TOKEN]
    tokenizer_config = demo_tokenizer_config(special_ids, CHAT_TEMPLATE, add_prefix_space=False)
    generation_config = {"eos_token_id": eos_id, "pad_token_id": special_ids[PAD_TOKEN]}
    config = {
        "architectures": ["DemoForCausalLM"],
        "model_type": "demo",
        "eos_token_id": eos_id,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
    }
    write_configs(path, (
        ("tokenizer_config.json", tokenizer_config),
        ("generation_config.json", generation_config),
        ("config.json", config),
    ))
    return path


def demo_tokenizer_config(ids: Mapping[str, int | None], chat_template: str,
                          **flags: bool) -> dict[str, Any]:
    """A demo model's ``tokenizer_config.json``: ``ids`` are its special tokens' (all of
    them special), ``flags`` more ``add_*`` settings, written after ``add_bos_token``."""
    return {
        "add_bos_token": False,
        **flags,
        "added_tokens_decoder": {
            str(token_id): {
                "content": token,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for token, token_id in ids.items()
        },
        "bos_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "pad_token": PAD_TOKEN,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def write_configs(path: Path, files: Iterable[tuple[str, object]]) -> None:
    """Write each (file name, JSON value) into ``path``, as the committed model dirs hold them."""
    for name, data in files:
        (path / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", "utf-8")
