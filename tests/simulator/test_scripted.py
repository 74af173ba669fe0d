"""Scripted completions: a marker in the prompt makes the engine say given text, then EOS."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from direct_frontend.simulator import SimEngine
from direct_frontend.simulator.model import StopCriteria
from direct_frontend.simulator.scripted import ScriptBook

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture
def engine(model_dir: Path, tokenizer: Tokenizer) -> SimEngine:
    engine = SimEngine.from_model_dir("vllm", model_dir)
    engine.core.scripts = ScriptBook(tokenizer, {"[weather]": CALL, "[think]": "<think>a</think>b"})
    return engine


def generate(engine: SimEngine, prompt: list[int], max_tokens: int = 500) -> tuple[list[int], str]:
    job = engine.core.new_job("r", prompt, StopCriteria(max_tokens=max_tokens))
    ids = job.generation.run()
    assert job.generation.finish is not None
    return ids, job.generation.finish.reason


def test_a_marked_prompt_gets_the_script_then_eos(engine: SimEngine, tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("What is the weather? [weather]").ids
    ids, reason = generate(engine, prompt)
    assert reason == "stop" and ids[-1] == engine.model.eos_token_id
    assert tokenizer.decode(ids[:-1], skip_special_tokens=False) == CALL


def test_an_unmarked_prompt_samples_as_before(engine: SimEngine, tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("What is the weather?").ids
    plain = SimEngine.from_model_dir("vllm", engine.config.tokenizer_path)
    assert generate(engine, prompt, 20) == generate(plain, prompt, 20)


def test_max_tokens_cuts_the_script(engine: SimEngine, tokenizer: Tokenizer) -> None:
    ids, reason = generate(engine, tokenizer.encode("[weather]").ids, max_tokens=5)
    assert reason == "length" and len(ids) == 5


def test_a_resumed_request_continues_the_script(engine: SimEngine, tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("Hi [weather]").ids
    whole, _ = generate(engine, prompt)
    first, _ = generate(engine, prompt, max_tokens=7)
    rest, _ = generate(engine, prompt + first)
    assert first + rest == whole


def test_markers_must_not_be_empty(tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match="empty"):
        ScriptBook(tokenizer, {"": "x"})
