"""gpt-oss Harmony: analysis is reasoning, final is content, commentary to functions.* is a call."""

from __future__ import annotations

from tests.support.parsers import check_malformed, check_output, make

harmony = make("harmony")
ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather. Call the tool.<|end|>"


def test_reasoning_then_a_call() -> None:
    text = (ANALYSIS + "<|start|>assistant<|channel|>commentary to=functions.get_weather "
            '<|constrain|>json<|message|>{"location": "Tokyo"}<|call|>')
    check_output(harmony, text, ("", "The user wants the weather. Call the tool.",
                                 [("get_weather", {"location": "Tokyo"})]), markers=("<|",))


def test_recipient_in_the_role_and_a_call_cut_at_its_stop_token() -> None:
    text = (ANALYSIS + '<|start|>assistant to=functions.get_time<|channel|>commentary json'
            '<|message|>{"tz": "UTC"}')
    check_output(harmony, text, ("", "The user wants the weather. Call the tool.",
                                 [("get_time", {"tz": "UTC"})]))


def test_reasoning_then_a_final_answer() -> None:
    text = ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>"
    check_output(harmony, text, ("It is sunny.", "The user wants the weather. Call the tool.", []))


def test_the_harmony_reasoning_parser_alone_does_the_same() -> None:
    text = ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is sunny."
    check_output(make(None, "harmony"), text,
                 ("It is sunny.", "The user wants the weather. Call the tool.", []))


def test_a_call_with_bad_json_is_content() -> None:
    text = (ANALYSIS + "<|start|>assistant<|channel|>commentary to=functions.f"
            '<|message|>{"a": }<|call|>')
    check_malformed(harmony, text, '{"a": }')
