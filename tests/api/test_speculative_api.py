"""Speculative decoding behind a real `kiln serve --speculative-config`, through the OpenAI client: greedy
replies, whole and streamed, equal the same server's without drafts word for word; vLLM's spec_decode
counters and its SpecDecoding log line report the drafts."""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator

import openai
import pytest

from tests.api.server import Server, start_server
from tests.api.test_openai import metric
from tests.conftest import API_KEY, SERVE_CONFIG

pytestmark = pytest.mark.slow

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
COPY = [{"role": "user", "content": "Repeat exactly:\n" + CODE * 2}]


@pytest.fixture(scope="module")
def drafting(tmp_path_factory: pytest.TempPathFactory, server: Server) -> Iterator[Server]:
    config = copy.deepcopy(SERVE_CONFIG)
    config["server"]["log_stats_interval"] = 0.5
    srv = start_server(
        tmp_path_factory.mktemp("serve-spec"), config, "--speculative-config", json.dumps(SPEC)
    )
    yield srv
    assert srv.stop() == 0, srv.output()


def client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_greedy_replies_equal_the_server_without_drafts(drafting: Server, server: Server) -> None:
    def reply(srv: Server) -> tuple[str | None, str | None, list[str]]:
        chat = client(srv).chat.completions.create(model=MODEL, messages=COPY, max_tokens=80, temperature=0)
        stream = client(srv).completions.create(
            model=MODEL, prompt=CODE * 3, max_tokens=40, temperature=0, stream=True
        )
        return (
            chat.choices[0].message.content,
            chat.choices[0].finish_reason,
            [c.choices[0].text for c in stream],
        )

    plain, drafted = reply(server), reply(drafting)
    assert drafted[:2] == plain[:2]
    assert "".join(drafted[2]) == "".join(plain[2])
    assert len(drafted[2]) < len(plain[2])  # chunks of several tokens: the steps that kept drafts
    accepted = metric(drafting, "kiln:spec_decode_num_accepted_tokens_total", model_name=MODEL)
    drafts = metric(drafting, "kiln:spec_decode_num_draft_tokens_total", model_name=MODEL)
    assert 0 < accepted <= drafts
    assert metric(drafting, "kiln:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
    assert metric(server, "kiln:spec_decode_num_drafts_total") == 0  # none without --speculative-config
    deadline = time.monotonic() + 10
    while "SpecDecoding metrics: Mean acceptance length:" not in drafting.output():
        assert time.monotonic() < deadline, drafting.output()[-2000:]
        time.sleep(0.2)
