"""The template environment renders exactly as Jinja's immutable sandbox does."""

from __future__ import annotations

from typing import Any

import pytest
from jinja2.exceptions import SecurityError, UndefinedError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from direct_frontend.text.template_env import TemplateEnvironment

MESSAGE: dict[str, Any] = {
    "role": "user", "content": "hi", "items": "a field named like a method",
    "function": {"name": "read", "arguments": "{}"}, "none": None,
}
TEMPLATES = [
    "{{ m.role }}: {{ m.content }}",
    "{{ m.function.name }}({{ m.function.arguments }})",
    "{% for k, v in m.function.items() %}{{ k }}={{ v }};{% endfor %}",
    "{{ m.items() | list | length }}",  # dict's own attribute: the method, not the field
    "{{ m.missing is defined }} {{ m.none is none }} {{ m['items'] }}",
    "{{ m.keys() | list | join(',') }} {{ m.get('role') }}",
    "{{ m.content.upper() }} {{ [m][0].role }} {{ m | length }}",
    "{% if m.tool_calls %}calls{% else %}none{% endif %}",
]


def render(env: ImmutableSandboxedEnvironment, source: str) -> str:
    return env.from_string(source).render(m=dict(MESSAGE))


@pytest.mark.parametrize("source", TEMPLATES)
def test_renders_as_the_sandbox_does(source: str) -> None:
    assert render(TemplateEnvironment(), source) == render(ImmutableSandboxedEnvironment(),
                                                           source)


@pytest.mark.parametrize("source", [
    "{{ m.__class__.__mro__ }}", "{{ m.update({'a': 1}) }}", "{{ m.missing.deeper }}",
    "{{ m.pop('role') }}",
])
def test_refuses_what_the_sandbox_refuses(source: str) -> None:
    outcomes = []
    for env in (TemplateEnvironment(), ImmutableSandboxedEnvironment()):
        try:
            outcomes.append(("ok", render(env, source)))
        except (SecurityError, UndefinedError) as exc:
            outcomes.append((type(exc).__name__, str(exc)))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0] != "ok" or "mro" not in source
