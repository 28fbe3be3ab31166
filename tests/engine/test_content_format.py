"""--chat-template-content-format auto: which templates read a message's content as a list of parts, as
vLLM's detection decides (its answers for these templates, checked against vLLM 0.32)."""

from __future__ import annotations

import pytest

from kiln.engine.content_format import detect_content_format

PARTS_LOOP = (
    "{% for message in messages %}{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{{ content['text'] }}{% endfor %}{% endif %}{% endfor %}"
)
MACRO = (
    "{% macro render(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
    "{% for m in messages %}{{ render(m.content) }}{% endfor %}"
)
ALIAS = "{% set msgs = messages[1:] %}{% for m in msgs %}{% for x in m['content'] %}{% endfor %}{% endfor %}"
PLAIN = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
NOT_MESSAGES = "{% for t in tools %}{% for x in t['content'] %}{{ x }}{% endfor %}{% endfor %}"


@pytest.mark.parametrize(
    "template, expected",
    [
        (PARTS_LOOP, "openai"),
        (MACRO, "openai"),
        (ALIAS, "openai"),
        (PLAIN, "string"),
        (NOT_MESSAGES, "string"),
        ("{% for %}", "string"),  # does not compile: rendering will say so
        ("{% generation %}{% for m in messages %}{% for p in m.content %}{% endfor %}{% endfor %}"
         "{% endgeneration %}", "openai"),  # transformers' own tags parse
    ],
)  # fmt: skip
def test_detected_as_vllm_detects_it(template: str, expected: str) -> None:
    assert detect_content_format(template) == expected
