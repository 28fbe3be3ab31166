"""Hypothesis strategies for hostile request bodies: drawn from the API's own msgspec schemas (so most
fields are plausible and reach deep into the server), then mutated: wrong types, extreme numbers, deep
nesting, huge strings, invalid UTF-8, random token ids, missing and unknown fields, broken JSON."""

from __future__ import annotations

import json
from typing import Any

import httpx
import msgspec
from hypothesis import strategies as st

from kiln.api.messages_protocol import CountTokensRequest, MessagesRequest
from kiln.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
    TokenizeRequest,
)

ENDPOINTS: dict[str, type] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
}
ANTHROPIC = ("/v1/messages",)  # the paths with Anthropic's errors and events
SERVED = "tiny"  # tiny_server's name: a body's required `model` is often it, so that it gets past the 404
POOLING_ENDPOINTS: dict[str, type] = {  # a pooling model's
    "/v1/embeddings": EmbeddingRequest,
    "/score": ScoreRequest,
    "/rerank": RerankRequest,
    "/pooling": PoolingRequest,
}

# Words the schemas' strings should often be, so that draws get past the first check.
WORDS = ["text", "user", "Hi", "0", "1", "42", "stop", "\n", "</s>", "<|im_end|>", "image_url", ""]
# Keys of free-form objects (chat_template_kwargs, logit_bias) that mean something to the server.
KEYS = ["chat_template", "tokenize", "add_generation_prompt", "enable_thinking", "tools", "messages", "1"]
EXTREME_INTS = [0, -1, 1, 2**31, -(2**31), 2**63 - 1, 2**63, 2**64, -(2**64), 10**30, -(10**30)]
EXTREME_FLOATS = [0.0, -0.0, 1e-308, 5e-324, 1e308, -1e308, 1.7976931348623157e308, 3.4e38]

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
strings = st.sampled_from(WORDS) | st.text(max_size=40)
integers = st.integers(-3, 300) | st.sampled_from(EXTREME_INTS) | st.integers()
numbers = (
    st.floats(-3, 3) | st.sampled_from(EXTREME_FLOATS) | st.floats(allow_nan=False, allow_infinity=False)
)


def from_schema(schema: dict[str, Any], defs: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values that the JSON schema msgspec writes for a type describes (its subset of JSON schema)."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return st.deferred(lambda: from_schema(defs[name], defs))
    if "anyOf" in schema:
        return st.one_of([from_schema(s, defs) for s in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind is None:
        return json_values
    if kind == "object":
        if "properties" not in schema:
            extra = schema.get("additionalProperties", {})
            keys = st.sampled_from(KEYS) | st.text(max_size=8) | st.integers(-10, 60_000).map(str)
            return st.dictionaries(keys, from_schema(extra, defs), max_size=4)
        return _objects(
            {k: from_schema(v, defs) for k, v in schema["properties"].items()},
            set(schema.get("required", [])),
        )
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {}), defs), max_size=6)
    return {
        "string": strings,
        "integer": integers,
        "number": numbers,
        "boolean": st.booleans(),
        "null": st.none(),
    }[kind]


@st.composite
def _objects(draw: st.DrawFn, props: dict[str, st.SearchStrategy[Any]], required: set[str]) -> dict[str, Any]:
    """The required fields and a few optional ones: with many, one is nearly always invalid, and the
    request never gets past validation."""
    optional = sorted(set(props) - required)
    chosen = draw(st.lists(st.sampled_from(optional), max_size=4, unique=True)) if optional else []
    return {k: draw(props[k]) for k in sorted(required) + chosen}


def schema_bodies(kind: type) -> st.SearchStrategy[dict[str, Any]]:
    schema = msgspec.json.schema(kind)
    return from_schema(schema, schema.get("$defs", {}))


@st.composite
def mutated(draw: st.DrawFn, body: dict[str, Any]) -> bytes:
    """One body as bytes, with zero to three mutations."""
    body = dict(body)
    deep: dict[bytes, bytes] = {}  # nesting too deep for msgspec to encode is spliced in as text
    for _ in range(draw(st.integers(0, 3))):
        field = draw(st.sampled_from([*body, "prompt", "messages", "tokens", "n", "max_tokens", "stop"]))
        how = draw(
            st.sampled_from(
                ["type", "extreme", "deep", "huge", "ids", "drop", "unknown", "prompts", "many stops"]
            )
        )
        if how == "type":
            body[field] = draw(json_values)
        elif how == "extreme":
            body[field] = draw(st.sampled_from(EXTREME_INTS + EXTREME_FLOATS))
        elif how == "deep":
            depth = draw(st.sampled_from([2, 50, 1_000, 10_000]))
            open_, close = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
            marker = f"deep-{len(deep)}"
            deep[msgspec.json.encode(marker)] = open_ * depth + b"1" + close * depth
            body[field] = marker
        elif how == "huge":
            body[field] = draw(st.sampled_from(["word ", "é", "\U0001f600", "a"])) * draw(
                st.sampled_from([10_000, 100_000, 1_000_000])
            )
        elif how == "ids":
            ids = st.lists(st.integers(-5, 60_000) | st.sampled_from(EXTREME_INTS), min_size=1, max_size=40)
            body[field] = draw(ids | st.lists(ids, min_size=1, max_size=3))
        elif how == "drop":
            body.pop(field, None)
        elif how == "unknown":
            body[draw(st.text(min_size=1, max_size=12))] = draw(json_values)
        elif how == "prompts":
            body[field] = ["x"] * draw(st.sampled_from([5, 100, 2_000]))
        else:
            body[field] = ["s"] * draw(st.sampled_from([5, 64]))
    data = msgspec.json.encode(body)
    for marker, nested in deep.items():
        data = data.replace(marker, nested)
    damage = draw(st.sampled_from(["none"] * 6 + ["utf8", "truncate", "garbage"]))
    if damage == "utf8":  # bytes that are not UTF-8, inside a string where there is one
        at = data.find(b'"', 1) + 1 or len(data) // 2
        data = (
            data[:at] + draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80abc"])) + data[at:]
        )
    elif damage == "truncate":
        data = data[: draw(st.integers(0, max(len(data) - 1, 0)))]
    elif damage == "garbage":
        data = draw(st.binary(max_size=64))
    return data


@st.composite
def requests(draw: st.DrawFn, endpoints: dict[str, type] = ENDPOINTS) -> tuple[str, bytes]:
    """(path, body): an endpoint and a hostile body for it."""
    path = draw(st.sampled_from(list(endpoints)))
    body = draw(schema_bodies(endpoints[path]))
    if "model" in _required(endpoints[path]) and draw(st.booleans()):
        body["model"] = SERVED
    return path, draw(mutated(body))


def _required(kind: type) -> list[str]:
    return msgspec.json.schema(kind)["$defs"][kind.__name__].get("required", [])


def check(response: httpx.Response, stream: bool, path: str) -> None:
    """No 500; an error has OpenAI's shape (or Anthropic's, on its paths); a body parses; a stream ends
    with [DONE] (Anthropic's: message_stop, or its error event) and holds no 500."""
    status = response.status_code
    assert status < 500, response.text[:2000]
    if path.startswith(ANTHROPIC):
        _check_anthropic(response, stream)
        return
    if status >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == status, error
        return
    if not stream:
        response.json()
        return
    lines = [line for line in response.text.split("\n\n") if line]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    for line in lines[:-1]:
        event = json.loads(line.removeprefix("data: "))
        assert "error" not in event or event["error"]["code"] < 500, event


def _check_anthropic(response: httpx.Response, stream: bool) -> None:
    if response.status_code >= 400 or not stream:
        body = response.json()
        if response.status_code >= 400:
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        return
    frames = [frame.split("\n") for frame in response.text.split("\n\n") if frame]
    for name, data in frames:
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}", (name, data)
        assert event["type"] != "error" or event["error"]["type"] != "api_error", event  # a 500 mid-stream
    assert frames[-1][0] in ("event: message_stop", "event: error"), frames[-3:]
