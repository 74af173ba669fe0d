"""Our tool parsers against vLLM's own on the same model outputs: the calls must be the same.

A model's call format is a contract between its chat template and whoever
parses its output; vLLM's parsers are what most deployments of these models
used, so a client moving to this router must get the same calls. Each case
is one complete output (non-streaming: our tests already hold every split of
a stream equal to the whole). vLLM's parsers run in the real-vLLM peer
environment (scripts/real_vllm.py builds it), fed over a pipe; ours run here.

    python scripts/parser_parity.py                     # the peer env real_vllm.py left
    python scripts/parser_parity.py --peer PYTHON --tokenizer DIR

Calls compare by name and by arguments as JSON values; content compares
with surrounding whitespace stripped (vLLM trims it in some parsers, we keep
the model's). A parser vLLM cannot build with the tokenizer given (one that
needs its model's special tokens) is reported as skipped. Exit status 1 on
any difference.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from direct_frontend.openai.parsers.base import collect  # noqa: E402
from direct_frontend.openai.parsers.registry import ChoiceParser  # noqa: E402

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string"}}, "note": {"type": "string"}}}
NOW = {"type": "object", "properties": {}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now", "parameters": NOW}}]

#: (our parser name, vLLM's name, model output)
CASES: list[tuple[str, str, str]] = [
    ("hermes", "hermes", "No call here, just prose."),
    ("hermes", "hermes", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Zürich", "days": 3}}\n</tool_call>'),
    ("hermes", "hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
     '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'),
    ("qwen3_coder", "qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\n"
     "Zürich\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n"
     "</parameter>\n</function>\n</tool_call>"),
    ("qwen3_coder", "qwen3_coder", "Let me look.\n<tool_call>\n<function=now>\n</function>\n"
     "</tool_call>"),
    ("llama3_json", "llama3_json", '{"name": "get_weather", "parameters": {"city": "Lima"}}'),
    ("pythonic", "pythonic", '[get_weather(city="Zürich", days=3), now()]'),
    ("deepseek_v31", "deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather"
     '<｜tool▁sep｜>{"city": "Tokyo"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    ("kimi_k2", "kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
     '<|tool_call_argument_begin|>{"city": "Rome"}<|tool_call_end|><|tool_calls_section_end|>'),
    ("glm45", "glm45", "No call, only words."),
    ("glm45", "glm45", "Let me check.<tool_call>get_weather\n<arg_key>city</arg_key>\n"
     "<arg_value>Zürich</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"
     "<arg_key>metric</arg_key>\n<arg_value>true</arg_value>\n</tool_call>"),
    ("glm45", "glm45", "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value>"
     '<arg_key>tags</arg_key><arg_value>["a", "b"]</arg_value></tool_call>'
     "<tool_call>now</tool_call>"),
    ("glm45", "glm47", "<tool_call>get_weather<arg_key>note</arg_key><arg_value>42</arg_value>"
     "<arg_key>days</arg_key><arg_value>7</arg_value></tool_call>"),
    ("deepseek_v32", "deepseek_v32", "Sure.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke "
     'name="get_weather">\n<｜DSML｜parameter name="city" string="true">杭州</｜DSML｜parameter>\n'
     '<｜DSML｜parameter name="days" string="false">5</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
     "</｜DSML｜function_calls>"),
    ("deepseek_v4", "deepseek_v4", '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
     '<｜DSML｜parameter name="note" string="true">007</｜DSML｜parameter>\n'
     '<｜DSML｜parameter name="tags" string="false">["x"]</｜DSML｜parameter>\n'
     '</｜DSML｜invoke>\n<｜DSML｜invoke name="now">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'),
    ("minimax_m2", "minimax_m2", "Only words."),
    ("minimax_m2", "minimax_m2", 'Checking.\n<minimax:tool_call>\n<invoke name="get_weather">\n'
     '<parameter name="city">Zürich</parameter>\n<parameter name="days">3</parameter>\n'
     '<parameter name="metric">false</parameter>\n</invoke>\n</minimax:tool_call>'),
    ("minimax_m2", "minimax_m2", '<minimax:tool_call>\n<invoke name="get_weather">\n'
     '<parameter name="note">007</parameter>\n<parameter name="tags">["x"]</parameter>\n'
     '</invoke>\n<invoke name="now">\n</invoke>\n</minimax:tool_call>'),
]

#: runs in the peer environment: cases in on stdin, vLLM's parse of each out on stdout
PEER = r"""
import json, sys
from vllm.tool_parsers import ToolParserManager
from vllm.tokenizers import get_tokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
job = json.load(sys.stdin)
tokenizer = get_tokenizer(job["tokenizer"])
request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                tools=job["tools"])
out = []
for name, text in job["cases"]:
    try:
        parser = ToolParserManager.get_tool_parser(name)(tokenizer)
    except Exception as exc:
        out.append({"skipped": f"{type(exc).__name__}: {exc}"[:200]})
        continue
    r = parser.extract_tool_calls(text, request)
    out.append({"content": r.content or "", "calls": [
        [c.function.name, json.loads(c.function.arguments or "{}")]
        for c in (r.tool_calls if r.tools_called else [])]})
print(json.dumps(out))
"""


def ours(parser: str, text: str) -> dict[str, Any]:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    choice = ChoiceParser(tool_parser=parser, tools=schemas, stream_arguments=False)
    message = collect([choice.feed(text), choice.finish()])
    return {"content": message.content or "", "calls": [
        [c.function.name, json.loads(c.function.arguments)] for c in message.tool_calls]}


def theirs(peer: Path, tokenizer: Path) -> list[dict[str, Any]]:
    job = {"tokenizer": str(tokenizer), "tools": TOOLS,
           "cases": [(name, text) for _, name, text in CASES]}
    done = subprocess.run([str(peer), "-c", PEER], input=json.dumps(job), capture_output=True,
                          text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the peer environment failed: {done.stderr[-2000:]}")
    results: list[dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    return results


def compare(peer: Path, tokenizer: Path) -> tuple[int, int, list[str]]:
    """(cases equal, cases skipped, a line per difference)."""
    equal, skipped, diffs = 0, 0, []
    for (parser, name, text), them in zip(CASES, theirs(peer, tokenizer), strict=True):
        if "skipped" in them:
            skipped += 1
            continue
        us = ours(parser, text)
        if us["calls"] == them["calls"] and us["content"].strip() == them["content"].strip():
            equal += 1
        else:
            diffs.append(f"{parser} (vLLM {name}) on {text[:60]!r}: ours {us}, vLLM's {them}")
    return equal, skipped, diffs


def main(argv: list[str] | None = None) -> int:
    cache = Path.home() / ".cache" / "direct-frontend" / "real-vllm"
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peer", type=Path, default=cache / "venv" / "bin" / "python",
                   help="the real-vLLM peer environment's python")
    p.add_argument("--tokenizer", type=Path, default=cache / "tiny-llama",
                   help="a model directory vLLM's parsers can load a tokenizer from")
    args = p.parse_args(argv)
    equal, skipped, diffs = compare(args.peer, args.tokenizer)
    for line in diffs:
        print("DIFF ", line)
    print(f"{equal} equal, {len(diffs)} different, {skipped} skipped (of {len(CASES)} outputs)")
    return 1 if diffs else 0


if __name__ == "__main__":
    raise SystemExit(main())
