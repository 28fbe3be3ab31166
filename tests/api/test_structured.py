"""Structured output through a real `kiln serve` of the default model, with the OpenAI SDK: every kind of
constraint is obeyed, forced tool calls come back as tool_calls (whole and streamed), and every bad
constraint or unknown field is a 400 that names its field."""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from tests.api.server import Server, expect_error, post
from tests.conftest import API_KEY

pytestmark = pytest.mark.slow

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
}
ASK_PERSON = [{"role": "user", "content": "Invent a person and describe them as JSON."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 20}},
            "required": ["zone"],
        },
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def person_format(schema: dict = PERSON) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def check_person(text: str, reason: str | None) -> None:
    """A finished reply validates. JSON's free whitespace (any_whitespace, vLLM's default) lets the default
    model at temperature 1 loop on newlines until max_tokens in about 1% of requests (kiln: 7 of seeds
    0-479; 4 of 160-479 with the sampler before): such a reply ends in the whitespace the grammar allowed."""
    if reason == "length":
        assert not text[-40:].strip(), text
        return
    assert reason == "stop", text
    jsonschema.validate(json.loads(text), PERSON)


def test_json_schema_holds_over_sampled_requests(client: openai.OpenAI) -> None:
    """20 requests at temperature 1.0, run as one batch: each parses and validates."""

    def one(seed: int) -> tuple[str, str | None]:
        r = client.chat.completions.create(
            model=MODEL, messages=ASK_PERSON, response_format=person_format(), temperature=1.0,
            seed=seed, max_tokens=300,
        )  # fmt: skip
        return r.choices[0].message.content, r.choices[0].finish_reason

    with ThreadPoolExecutor(20) as pool:
        replies = list(pool.map(one, range(20)))
    for text, reason in replies:
        check_person(text, reason)
    assert sum(reason == "length" for _, reason in replies) <= 2  # at 1.5%, more has odds under 1 in 250
    assert len({text for text, _ in replies}) > 10  # sampled, not one answer


def test_json_object_parses(client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "Return a JSON object with your name."}]
    for temperature, seed in ((0.0, None), (0.7, 0), (0.7, 1), (0.7, 2)):
        r = client.chat.completions.create(
            model=MODEL, messages=ask, response_format={"type": "json_object"}, temperature=temperature,
            seed=seed, max_tokens=400,
        )  # fmt: skip
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_regex_choice_and_grammar(client: openai.OpenAI) -> None:
    date = r"\d{4}-\d{2}-\d{2}"
    for endpoint in ("completions", "chat"):
        extra = {"structured_outputs": {"regex": date}}
        if endpoint == "chat":
            ask = [{"role": "user", "content": "When did the French revolution begin?"}]
            r = client.chat.completions.create(model=MODEL, messages=ask, extra_body=extra, max_tokens=20)
            text = r.choices[0].message.content
        else:
            r = client.completions.create(model=MODEL, prompt="The date:", extra_body=extra, max_tokens=20)
            text = r.choices[0].text
        assert re.fullmatch(date, text) and r.choices[0].finish_reason == "stop", text

    choices = ["Paris", "London", "a city I cannot name"]
    ask = [{"role": "user", "content": "Which city is the capital of England?"}]
    for seed in range(4):
        r = client.chat.completions.create(
            model=MODEL, messages=ask, temperature=1.0, seed=seed, max_tokens=20,
            extra_body={"structured_outputs": {"choice": choices}},
        )  # fmt: skip
        assert r.choices[0].message.content in choices

    grammar = 'root ::= answer " because " digit digit\nanswer ::= "yes" | "no"\ndigit ::= [0-9]'
    for seed in range(4):
        r = client.completions.create(
            model=MODEL, prompt="Is 7 a prime number? Answer:", temperature=1.0, seed=seed, max_tokens=20,
            extra_body={"structured_outputs": {"grammar": grammar}},
        )  # fmt: skip
        assert re.fullmatch(r"(yes|no) because [0-9]{2}", r.choices[0].text), r.choices[0].text


def test_tokens_a_grammar_rules_out_show_logprob_minus_9999(client: openai.OpenAI) -> None:
    """As vLLM's API: a masked token's -inf is -9999.0 (JSON has no -inf), in both formats."""
    extra = {"structured_outputs": {"choice": ["yes", "no"]}}
    ask = [{"role": "user", "content": "Is Paris in France?"}]
    r = client.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=1, logprobs=True, top_logprobs=10, extra_body=extra
    )
    top = [t.logprob for t in r.choices[0].logprobs.content[0].top_logprobs]
    assert len(top) == 10 and top[-1] == -9999.0 and top[0] > -9999.0  # a few prefixes of yes or no
    r = client.completions.create(model=MODEL, prompt="Yes?", max_tokens=1, logprobs=10, extra_body=extra)
    assert sorted(r.choices[0].logprobs.top_logprobs[0].values())[0] == -9999.0


def check_calls(calls: list, allowed: dict[str, dict]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call.function.arguments), allowed[call.function.name])


def streamed_calls(stream: openai.Stream) -> tuple[list, str | None, str | None]:
    """Tool calls put back together from their deltas, with the finish reason and any content."""
    calls: dict[int, dict] = {}
    reason, content = None, ""
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
            call["arguments"] += d.function.arguments or ""
        reason = choice.finish_reason or reason
    out = [
        openai.types.chat.ChatCompletionMessageFunctionToolCall(
            id=c["id"], type="function", function={"name": c["name"], "arguments": c["arguments"]}
        )
        for c in calls.values()
    ]
    return out, reason, content or None


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_calls(client: openai.OpenAI, stream: bool) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, parallel in ((named, True), ("required", False), ("required", True)):
        kwargs = dict(
            model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, CLOCK], tool_choice=choice,
            parallel_tool_calls=parallel, max_tokens=200, temperature=0,
        )  # fmt: skip
        if stream:
            calls, reason, content = streamed_calls(client.chat.completions.create(stream=True, **kwargs))
        else:
            r = client.chat.completions.create(**kwargs)
            calls, reason, content = r.choices[0].message.tool_calls, r.choices[0].finish_reason, None
            assert r.choices[0].message.content is None
        assert reason == "tool_calls" and not content
        check_calls(calls, schemas)
        if choice is named:
            assert [c.function.name for c in calls] == ["get_weather"]
        if not parallel:
            assert len(calls) == 1


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_parses_hermes_calls(tiny_server: Server, stream: bool) -> None:
    """tool_choice "auto" on a server with the hermes parser: the reply's text (forced here by a choice
    constraint, as a random model writes no calls) becomes its content and tool calls."""
    client = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    for text, content in ((f"Let me check. {CALL}", "Let me check. "), (CALL + "\n" + CALL, None)):
        kwargs = dict(
            model=model, messages=ASK_WEATHER, tools=[WEATHER], max_tokens=120, temperature=0,
            extra_body={"structured_outputs": {"choice": [text]}},
        )  # fmt: skip
        if stream:
            calls, reason, got = streamed_calls(client.chat.completions.create(stream=True, **kwargs))
        else:
            r = client.chat.completions.create(**kwargs)
            calls, reason, got = (
                r.choices[0].message.tool_calls,
                r.choices[0].finish_reason,
                r.choices[0].message.content,
            )
        assert reason == "tool_calls" and got == content
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            ("get_weather", {"city": "Paris", "unit": "celsius"})
        ] * text.count("<tool_call>")
        assert len({c.id for c in calls}) == len(calls)
    # Without a call in the text, the reply is content, as without tools.
    r = client.chat.completions.create(
        model=model, messages=ASK_WEATHER, tools=[WEATHER], max_tokens=20, temperature=0,
        extra_body={"structured_outputs": {"choice": ["No tool <tool needed."]}},
    )  # fmt: skip
    assert r.choices[0].message.content == "No tool <tool needed." and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_apart_from_the_answer(tiny_server: Server, stream: bool) -> None:
    """A qwen3 reasoning parser: <think> text is the reply's `reasoning`, the rest its content, and tool
    calls (tool_choice "auto") are read from the content only."""
    client = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    cases = [
        ("<think>The user asks for 2+2.</think>It is 4.", "The user asks for 2+2.", "It is 4.", 0, {}, {}),
        ("No thinking here.", None, "No thinking here.", 0, {}, {}),
        (f"<think>Weather: call it.</think>{CALL}", "Weather: call it.", None, 1, {"tools": [WEATHER]}, {}),
        ("<think>Hidden.</think>Shown.", None, "Shown.", 0, {}, {"include_reasoning": False}),
    ]
    for text, reasoning, content, calls, tools, extra in cases:
        body = {"structured_outputs": {"choice": [text]}, **extra}
        kwargs = dict(
            model=model, messages=ASK_WEATHER, max_tokens=120, temperature=0, extra_body=body, **tools
        )
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            deltas = [c.choices[0].delta for c in chunks if c.choices]
            got_reasoning = "".join(getattr(d, "reasoning", None) or "" for d in deltas) or None
            got_content = "".join(d.content or "" for d in deltas) or None
            got_calls = sum(len(d.tool_calls or []) for d in deltas)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            choice = client.chat.completions.create(**kwargs).choices[0]
            message, reason = choice.message, choice.finish_reason
            got_reasoning, got_content = getattr(message, "reasoning", None), message.content
            got_calls = len(message.tool_calls or [])
        assert (got_reasoning, got_content, got_calls) == (reasoning, content, calls)
        assert reason == ("tool_calls" if calls else "stop")


def test_structural_tags(client: openai.OpenAI) -> None:
    """vLLM's structural_tag: xgrammar's current form, as response_format or structured_outputs (a JSON
    string), holds the whole reply; the older form leaves text free until a trigger."""
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "<a>"}, {"type": "regex", "pattern": "[0-9]{3}"},
        {"type": "const_string", "value": "</a>"},
    ]}}  # fmt: skip
    for extra in ({"response_format": tag}, {"structured_outputs": {"structural_tag": json.dumps(tag)}}):
        r = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=20, extra_body=extra)
        assert re.fullmatch("<a>[0-9]{3}</a>", r.choices[0].message.content or "")
        assert r.choices[0].finish_reason == "stop"
    older = {"type": "structural_tag", "triggers": ["<function="], "structures": [
        {"begin": "<function=w>", "schema": {"type": "object"}, "end": "</function>"},
    ]}  # fmt: skip
    plain = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=8, temperature=0)
    held = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, max_tokens=8, temperature=0, extra_body={"response_format": older}
    )
    assert held.choices[0].message.content == plain.choices[0].message.content  # no trigger: free text


def test_tool_choice_none_ignores_the_tools(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=12, temperature=0)
    none = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, max_tokens=12, temperature=0, tools=[WEATHER], tool_choice="none"
    )
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.choices[0].message.tool_calls == [] and none.choices[0].finish_reason == "length"


def test_a_tool_turn_renders(client: openai.OpenAI) -> None:
    """A conversation holding the assistant's call and the tool's answer goes through the template."""
    first = client.chat.completions.create(
        model=MODEL,
        messages=ASK_WEATHER,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=200,
        temperature=0,
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK_WEATHER,
        first.choices[0].message,
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    r = client.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0)
    assert r.choices[0].message.content


BAD = [
    ({"response_format": person_format({"type": "nonsense"})}, "response_format", "invalid JSON schema"),
    (
        {"response_format": person_format({"type": "integer", "multipleOf": 3})},
        "response_format",
        "multipleOf",
    ),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs its json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format", "Invalid enum value"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "invalid regex"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs", "invalid grammar"),
    ({"structured_outputs": {"grammar": 'start ::= "a"'}}, "structured_outputs", "root"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty strings"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "not valid JSON"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs", "`whitespace_pattern`"),
    (
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        "structured_outputs",
        "only one constraint",
    ),
    ({"tools": [WEATHER]}, "tool_choice", '"auto"'),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", '"auto"'),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
        "not in tools",
    ),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools", "distinct"),
    ({"service_tier": "auto"}, "service_tier", "`service_tier`"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction", "`prediction`"),
    ({"messages": [{"role": "user", "content": "x", "audio": None}]}, "messages", "`audio`"),
    (
        {"response_format": {"type": "structural_tag", "format": {"type": "nonsense"}}},
        "response_format",
        "invalid structural tag",
    ),
    (
        {"response_format": {"type": "structural_tag", "structures": [{"begin": "<a>"}], "triggers": ["<"]}},
        "response_format",
        "needs begin, schema and end",
    ),
    ({"structured_outputs": {"structural_tag": "{not json"}}, "structured_outputs", "not valid JSON"),
    ({"response_format": {"type": "json_object", "triggers": ["<"]}}, "response_format", "only with type"),
]


@pytest.mark.parametrize(("extra", "param", "says"), BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_constraints_are_400s(server: Server, extra: dict, param: str, says: str) -> None:
    body = {"model": MODEL, "messages": ASK_WEATHER, "max_tokens": 4, **extra}
    assert says in expect_error(
        post(server, "/v1/chat/completions", json=body), 400, "BadRequestError", param
    )


def test_bad_constraints_on_completions_and_the_server_lives_on(server: Server) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4, "structured_outputs": {"regex": "[a-"}}
    expect_error(post(server, "/v1/completions", json=body), 400, "BadRequestError", "structured_outputs")
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4, "tools": [WEATHER]}  # chat only
    assert "`tools`" in expect_error(
        post(server, "/v1/completions", json=body), 400, "BadRequestError", "tools"
    )
    informational = {"model": MODEL, "prompt": "x", "max_tokens": 2, "user": "u", "metadata": {"k": "v"}}
    assert post(server, "/v1/completions", json=informational).status_code == 200


def test_unsatisfiable_within_max_tokens_ends_by_length(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=ASK_PERSON, response_format=person_format(), max_tokens=5
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5


def test_constrained_and_free_rows_share_a_batch(client: openai.OpenAI) -> None:
    """A free greedy request gives the same text alone and beside constrained ones (its row is left
    unmasked), and the constrained ones still hold."""
    free = dict(model=MODEL, messages=ASK_WEATHER, max_tokens=40, temperature=0)
    alone = client.chat.completions.create(**free).choices[0].message.content

    def constrained(seed: int) -> tuple[str, str | None]:
        r = client.chat.completions.create(
            model=MODEL, messages=ASK_PERSON, response_format=person_format(), temperature=1.0, seed=seed,
            max_tokens=300,
        )  # fmt: skip
        return r.choices[0].message.content, r.choices[0].finish_reason

    with ThreadPoolExecutor(5) as pool:
        futures = [pool.submit(constrained, s) for s in range(4)]
        beside = pool.submit(lambda: client.chat.completions.create(**free).choices[0].message.content)
        for f in futures:
            check_person(*f.result())
        assert beside.result() == alone


def test_seeded_constrained_request_repeats(client: openai.OpenAI) -> None:
    def once() -> str:
        r = client.chat.completions.create(
            model=MODEL, messages=ASK_PERSON, response_format=person_format(), temperature=1.0, seed=7,
            max_tokens=300,
        )  # fmt: skip
        return r.choices[0].message.content

    assert once() == once()


def _metric(server: Server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_slow_grammar_does_not_hold_up_running_requests(client: openai.OpenAI, server: Server) -> None:
    """A schema whose grammar takes seconds to compile: a stream already running keeps its pace, and the
    constrained request waits in the queue, then is served."""
    # Patterns of their own: xgrammar's cache compiles a pattern seen before (in this schema too) at once.
    fields = {f"f{i}": {"type": "string", "pattern": f"[a-z]{{3,{40 + i}}}[0-9]{{2,9}}"} for i in range(40)}
    slow = {"type": "object", "properties": fields, "required": list(fields)}
    compile_before = _metric(server, "kiln:grammar_compile_seconds_sum")
    arrivals: list[float] = []
    started = threading.Event()

    def run() -> None:
        stream = client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=400, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        for _ in stream:
            arrivals.append(time.monotonic())
            if len(arrivals) == 20:
                started.set()

    runner = threading.Thread(target=run)
    runner.start()
    assert started.wait(120)
    sent = time.monotonic()
    r = client.chat.completions.create(
        model=MODEL, messages=ASK_PERSON, response_format=person_format(slow), max_tokens=5
    )
    answered = time.monotonic()
    runner.join()
    compile_seconds = _metric(server, "kiln:grammar_compile_seconds_sum") - compile_before
    assert r.choices[0].finish_reason == "length"
    assert compile_seconds > 1.0, "the schema should take a while to compile"
    during = [t for t in arrivals if sent <= t <= sent + compile_seconds]
    gaps = [b - a for a, b in itertools.pairwise(arrivals) if sent <= b <= answered]
    assert len(during) >= 5 and max(gaps) < compile_seconds / 3, (compile_seconds, max(gaps), len(during))


def test_grammar_metrics(client: openai.OpenAI, server: Server) -> None:
    """A new constraint is a miss and a compile; the same again is a hit."""
    names = ("kiln:grammar_cache_misses", "kiln:grammar_cache_hits", "kiln:grammar_compile_seconds_count")
    before = [_metric(server, n) for n in names]
    extra = {"structured_outputs": {"regex": f"metrics {time.time_ns()}"}}
    for _ in range(2):
        client.completions.create(model=MODEL, prompt="x", max_tokens=40, extra_body=extra)
    assert [_metric(server, n) - b for n, b in zip(names, before, strict=True)] == [1, 1, 1]
