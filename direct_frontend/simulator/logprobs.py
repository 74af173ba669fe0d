"""The simulated model's logprobs: deterministic, ranked, and the same on every kind.

Each position's row is a pure function of the prefix hash before it, so a
test (or a migrated stream's second engine) gets exactly the values the
first run would have. The model is greedy, so a generated token is always
the most likely of its row; a prompt token is given a value below every
listed alternative, as a prompt rarely follows the model's top choice. All
values are multiples of 1/1024 above -64, so float32 wires carry them exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

from direct_frontend.simulator.model import SimModel, mix64

#: how many ranked alternatives a row has (vLLM's default cap of 20, plus the token)
RANKS = 21
_SALT_LOGPROB = 0x6A09E667F3BCC908

Row = tuple[float, tuple[tuple[int, float], ...]]
"""A position's chosen token's logprob and its ranked alternatives (highest first)."""


def row(state: int, chosen: int, vocab_size: int, *, sampled: bool) -> Row:
    """The row after the prefix with hash ``state``, where ``chosen`` came next."""
    h = mix64(state ^ _SALT_LOGPROB)
    value = -(1 + h % 512) / 1024
    stride = 1 + (h >> 16) % 7
    ranked: list[tuple[int, float]] = [(chosen, value)] if sampled else []
    k = 0
    while len(ranked) < RANKS:
        k += 1
        token = (chosen + k * stride) % vocab_size
        if token == chosen or any(token == t for t, _ in ranked):
            continue
        value -= (1 + (h >> (k % 40)) % 64) / 64
        ranked.append((token, value))
    chosen_value = ranked[0][1] if sampled else value - 1.0
    return chosen_value, tuple(ranked)


def output_rows(
    states: Sequence[int], tokens: Sequence[int], vocab_size: int
) -> list[Row]:
    """The rows of generated ``tokens``, each after the prefix state recorded before it."""
    return [row(s, t, vocab_size, sampled=True) for s, t in zip(states, tokens, strict=True)]


def prompt_rows(model: SimModel, prompt: Sequence[int], vocab_size: int) -> list[Row | None]:
    """The rows of a prompt: none for its first token, which has no prefix."""
    rows: list[Row | None] = [None] if prompt else []
    state = model.state_of(prompt[:1])
    for token in prompt[1:]:
        rows.append(row(state, token, vocab_size, sampled=False))
        state = SimModel.advance(state, token)
    return rows


def vllm_listing(chosen: int, value: float, ranked: Sequence[tuple[int, float]], n: int) -> list[
    tuple[int, float]
]:
    """vLLM's first ``n`` entries of a position: the chosen token, then the ranked others."""
    return [(chosen, value), *((t, v) for t, v in ranked if t != chosen)][:n]


class RequestLogprobs:
    """The logprobs one request asked for, read off its generation as it runs."""

    def __init__(
        self, model: SimModel, vocab_size: int, prompt: Sequence[int], states: Sequence[int],
        output: Sequence[int], top: int | None, prompt_top: int | None,
    ) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.prompt = prompt
        self._states = states  # the generation's, growing as it runs
        self._output = output
        self.top = top  # None: no output logprobs asked for
        self.prompt_top = prompt_top  # None: no prompt logprobs asked for

    def output(self, start: int, end: int | None = None) -> list[tuple[int, Row]]:
        """The generated tokens ``[start:end]`` with their rows."""
        tokens = self._output[start:end]
        states = self._states[start:start + len(tokens)]
        return list(zip(tokens, output_rows(states, tokens, self.vocab_size), strict=True))

    def prompt_rows(self) -> list[Row | None]:
        return prompt_rows(self.model, self.prompt, self.vocab_size)


def smg_output(rows: Sequence[tuple[int, Row]], n: int, vllm: bool) -> dict[str, Any]:
    """``OutputLogProbs`` (SGLang's and vLLM's) as a dict; vLLM lists the token first."""
    tops = [
        vllm_listing(token, value, ranked, n) if vllm else list(ranked[:n])
        for token, (value, ranked) in rows
    ]
    return {
        "token_logprobs": [value for _, (value, _) in rows],
        "token_ids": [token for token, _ in rows],
        "top_logprobs": [
            {"values": [v for _, v in top], "token_ids": [t for t, _ in top]} for top in tops
        ] if n else [],
    }


def smg_prompt(
    prompt: Sequence[int], rows: Sequence[Row | None], n: int, vllm: bool
) -> dict[str, Any]:
    """``InputLogProbs`` as a dict: the first token's value is unset."""
    values: list[dict[str, float]] = []
    tops: list[dict[str, list[float] | list[int]]] = []
    for token, row_ in zip(prompt, rows, strict=True):
        if row_ is None:
            values.append({})
            tops.append({"values": [], "token_ids": []})
            continue
        value, ranked = row_
        values.append({"value": value})
        top = vllm_listing(token, value, ranked, n) if vllm else list(ranked[:n])
        tops.append({"values": [v for _, v in top], "token_ids": [t for t, _ in top]})
    return {"token_logprobs": values, "token_ids": list(prompt), "top_logprobs": tops if n else []}


def trtllm_output(rows: Sequence[tuple[int, Row]], n: int) -> list[dict[str, Any]]:
    """TensorRT-LLM's ``TokenLogprob`` list as dicts."""
    return [
        {
            "token_id": token, "logprob": value,
            "top_logprobs": [{"token_id": t, "logprob": v} for t, v in ranked[:n]],
        }
        for token, (value, ranked) in rows
    ]


def fill_smg(
    message: Any, pb: ModuleType, logprobs: RequestLogprobs, start: int, end: int, *,
    prompt: bool, vllm: bool,
) -> None:
    """Fill an SGLang or vLLM chunk or complete (``pb``: its contract's messages):
    output tokens ``[start:end]``, and with ``prompt`` the prompt's."""
    if logprobs.top is not None and end > start:
        message.output_logprobs.CopyFrom(
            pb.OutputLogProbs(**smg_output(logprobs.output(start, end), logprobs.top, vllm))
        )
    if prompt and logprobs.prompt_top is not None:
        rows = logprobs.prompt_rows()
        message.input_logprobs.CopyFrom(
            pb.InputLogProbs(**smg_prompt(logprobs.prompt, rows, logprobs.prompt_top, vllm))
        )
