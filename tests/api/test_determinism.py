"""Same request, same answer through the server: streamed or not, first time or repeated (its prefix then
cached), and sent while other requests share its steps."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

from tests.api.server import Server
from tests.conftest import API_KEY

pytestmark = pytest.mark.slow

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SEA = [{"role": "user", "content": "Write one sentence about the sea, then one about the mountains."}]
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 48}
SEEDED: dict[str, Any] = {"temperature": 0.8, "seed": 11, "max_tokens": 48}


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def chat(client: openai.OpenAI, stream: bool, **params: Any) -> str:
    if not stream:
        return client.chat.completions.create(model=MODEL, messages=SEA, **params).choices[0].message.content
    chunks = client.chat.completions.create(model=MODEL, messages=SEA, stream=True, **params)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def complete(client: openai.OpenAI, stream: bool, **params: Any) -> str:
    prompt = "The three most important inventions in history are"
    if not stream:
        return client.completions.create(model=MODEL, prompt=prompt, **params).choices[0].text
    chunks = client.completions.create(model=MODEL, prompt=prompt, stream=True, **params)
    return "".join(c.choices[0].text for c in chunks if c.choices)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("ask", [chat, complete], ids=["chat", "completion"])
def test_streamed_and_repeated_answers_are_equal(client: openai.OpenAI, ask: Any, params: dict) -> None:
    first = ask(client, False, **params)
    assert first
    assert [ask(client, s, **params) for s in (True, False, True)] == [first] * 3


def test_answers_are_equal_next_to_other_requests(client: openai.OpenAI) -> None:
    alone = chat(client, False, **GREEDY)
    others = [{"role": "user", "content": f"Count from {i} to {i + 20}."} for i in range(7)]
    with ThreadPoolExecutor(8) as pool:
        create = client.chat.completions.create
        busy = [pool.submit(create, model=MODEL, messages=[m], max_tokens=64, temperature=1) for m in others]
        answer = pool.submit(chat, client, True, **GREEDY)
        assert answer.result() == alone
        assert all(f.result().choices[0].message.content for f in busy)
