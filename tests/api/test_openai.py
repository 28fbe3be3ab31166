"""The OpenAI SDK against a real `kiln serve` of the default model."""

from __future__ import annotations

import asyncio
import re

import httpx
import openai
import pytest

from tests.api.server import Server
from tests.conftest import API_KEY

pytestmark = pytest.mark.slow

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_chat_answers(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24)
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant"
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert (
        r.usage.completion_tokens > 0
        and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    )


def test_completion_answers(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=4)
    assert r.object == "text_completion"
    assert r.choices[0].text.startswith(" Paris")
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 4


def test_completion_prompt_shapes(client: openai.OpenAI, server: Server) -> None:
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "The capital of France is"}).json()["tokens"]
    one = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=4)
    many = client.completions.create(
        model=MODEL, prompt=["The capital of France is", "1, 2, 3,"], temperature=0, max_tokens=4, n=2
    )
    many_ids = client.completions.create(model=MODEL, prompt=[ids, ids], temperature=0, max_tokens=4)
    assert one.choices[0].text.startswith(" Paris")
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text == one.choices[0].text
    assert many.choices[2].text.startswith(" 4")
    assert [c.text for c in many_ids.choices] == [one.choices[0].text] * 2
    count = httpx.post(f"{server.url}/tokenize", json={"prompt": "1, 2, 3,"}).json()["count"]
    assert many.usage.prompt_tokens == 5 + count  # once per prompt, not per choice


def test_echo_with_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=2, echo=True, logprobs=1
    )
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith("The capital of France is Paris")
    assert len(lp.tokens) == 5 + 2
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == r.choices[0].text


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_stream_matches_whole(client: openai.OpenAI, kind: str) -> None:
    args = dict(model=MODEL, temperature=0, max_tokens=40)
    if kind == "chat":
        whole = client.chat.completions.create(messages=QUESTION, **args).choices[0].message.content
        stream = client.chat.completions.create(
            messages=QUESTION, stream=True, stream_options={"include_usage": True}, **args
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[0].choices[0].delta.role == "assistant"
    else:
        prompt = "Once upon a time, in a small village,"
        whole = client.completions.create(prompt=prompt, **args).choices[0].text
        stream = client.completions.create(
            prompt=prompt, stream=True, stream_options={"include_usage": True}, **args
        )
        chunks = list(stream)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole and len(whole) > 10
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_n_with_seed_is_reproducible(client: openai.OpenAI) -> None:
    def sample() -> list[str]:
        r = client.chat.completions.create(
            model=MODEL, messages=QUESTION, n=4, seed=1234, temperature=1.0, max_tokens=16
        )
        assert [c.index for c in r.choices] == [0, 1, 2, 3]
        return [c.message.content for c in r.choices]

    first = sample()
    assert sample() == first
    assert len(set(first)) > 1  # the n samples differ from each other


def test_stop_string_is_trimmed(client: openai.OpenAI) -> None:
    prompt = "Count: one, two, three, four, five,"
    whole = (
        client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12).choices[0].text
    )
    stop = whole.strip().split()[2]  # a word in the middle of the greedy continuation
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12, stop=[stop])
    assert r.choices[0].text == whole[: whole.index(stop)]
    assert r.choices[0].finish_reason == "stop" and r.choices[0].stop_reason == stop
    # Streamed, the held-back text never shows the stop string either.
    chunks = client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=12, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_max_tokens_gives_length(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_completion_tokens=3, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_logprobs_have_top_n(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=5, logprobs=True, top_logprobs=3, temperature=0
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy takes the top token
    assert "".join(e.token for e in content) == r.choices[0].message.content
    c = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, logprobs=2, temperature=0)
    assert all(len(top) >= 2 for top in c.choices[0].logprobs.top_logprobs)


def test_vllm_extra_body(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=6,
        extra_body={
            "top_k": 1,
            "min_p": 0.1,
            "repetition_penalty": 1.0,
            "min_tokens": 6,
            "ignore_eos": True,
            "stop_token_ids": [2],
            "skip_special_tokens": True,
            "spaces_between_special_tokens": False,  # SmolLM2's byte-level decoder puts none regardless
        },
    )
    assert r.usage.completion_tokens == 6 and r.choices[0].text.startswith(" Paris")


def test_allowed_token_ids_and_bad_words(client: openai.OpenAI, server: Server) -> None:
    def ids(text: str) -> list[int]:
        return httpx.post(f"{server.url}/tokenize", json={"prompt": text}).json()["tokens"]

    pets = [ids(" cat")[0], ids(" dog")[0]]
    r = client.completions.create(
        model=MODEL,
        prompt="My favourite animal is",
        max_tokens=6,
        seed=1,
        extra_body={"allowed_token_ids": pets},
    )
    assert set(re.findall(r" \w+", r.choices[0].text)) <= {" cat", " dog"} and r.usage.completion_tokens == 6
    base = client.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=4
    )
    assert base.choices[0].text.startswith(" Paris")
    r = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=24, extra_body={"bad_words": ["Paris"]}
    )
    assert "Paris" not in r.choices[0].message.content
    r = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        temperature=0,
        max_tokens=4,
        extra_body={"bad_words": ["Paris"]},
    )
    assert "Paris" not in r.choices[0].text


def test_truncate_prompt_tokens_keeps_the_end(client: openai.OpenAI, server: Server) -> None:
    text = "Count with me: one, two, three, four, five, six, seven, eight, nine, ten,"
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": text}).json()["tokens"]
    whole = client.completions.create(model=MODEL, prompt=ids[-6:], temperature=0, max_tokens=3, echo=True)
    cut = client.completions.create(
        model=MODEL,
        prompt=text,
        temperature=0,
        max_tokens=3,
        echo=True,
        extra_body={"truncate_prompt_tokens": 6},
    )
    assert cut.usage.prompt_tokens == 6 and cut.choices[0].text == whole.choices[0].text
    r = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=2, extra_body={"truncate_prompt_tokens": 4}
    )
    assert r.usage.prompt_tokens == 4
    # -1: what fits beside max_tokens (max_model_len 512).
    r = client.completions.create(
        model=MODEL, prompt=ids * 40, max_tokens=12, extra_body={"truncate_prompt_tokens": -1}
    )
    assert r.usage.prompt_tokens == 500 and r.usage.completion_tokens == 12


def test_prompt_logprobs(client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    echo = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    plp = r.choices[0].prompt_logprobs  # vLLM's field: token id -> {logprob, rank, decoded_token}
    assert len(plp) == r.usage.prompt_tokens == 5 and plp[0] is None
    for position, chosen in zip(plp[1:], echo.choices[0].logprobs.token_logprobs[1:], strict=True):
        assert 2 <= len(position) <= 3 and {e["rank"] for e in position.values()} >= {1, 2}
        first = next(iter(position.values()))  # the prompt's own token first, as vLLM
        assert first["logprob"] == pytest.approx(chosen, abs=1e-4)
    assert "".join(next(iter(p.values()))["decoded_token"] for p in plp[1:]) == echo.choices[0].text[3:]
    chat = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    plp = chat.prompt_logprobs
    assert len(plp) == chat.usage.prompt_tokens and plp[0] is None and all(len(p) in (1, 2) for p in plp[1:])
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert "prompt_logprobs" not in plain.choices[0].model_extra  # left out unless asked


def test_return_token_ids(client: openai.OpenAI, server: Server) -> None:
    prompt = "The capital of France is"
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}).json()["tokens"]
    args = dict(model=MODEL, temperature=0, max_tokens=6, extra_body={"return_token_ids": True})
    r = client.completions.create(prompt=prompt, logprobs=0, **args)
    c = r.choices[0]
    assert c.prompt_token_ids == ids and len(c.token_ids) == 6
    detok = httpx.post(f"{server.url}/detokenize", json={"tokens": c.token_ids}).json()["prompt"]
    assert detok == c.text
    chunks = list(client.completions.create(prompt=prompt, stream=True, **args))
    assert chunks[0].choices[0].prompt_token_ids == ids
    assert all("prompt_token_ids" not in ch.choices[0].model_extra for ch in chunks[1:])
    assert [t for ch in chunks for t in ch.choices[0].token_ids] == c.token_ids
    chat = client.chat.completions.create(messages=QUESTION, **args)
    chat_ids = httpx.post(f"{server.url}/tokenize", json={"messages": QUESTION}).json()["tokens"]
    assert (
        chat.prompt_token_ids == chat_ids and len(chat.choices[0].token_ids) == chat.usage.completion_tokens
    )
    chunks = list(client.chat.completions.create(messages=QUESTION, stream=True, **args))
    assert chunks[0].prompt_token_ids == chat_ids and "prompt_token_ids" not in chunks[1].model_extra
    streamed = [
        t for ch in chunks for choice in ch.choices for t in (getattr(choice, "token_ids", None) or [])
    ]
    assert streamed == chat.choices[0].token_ids
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
    assert "prompt_token_ids" not in plain.model_extra and "token_ids" not in plain.choices[0].model_extra


def test_return_tokens_as_token_ids(client: openai.OpenAI) -> None:
    extra = {"return_tokens_as_token_ids": True, "return_token_ids": True}
    r = client.completions.create(
        model=MODEL, prompt="Hello", temperature=0, max_tokens=3, logprobs=2, extra_body=extra
    )
    lp, ids = r.choices[0].logprobs, r.choices[0].token_ids
    assert lp.tokens == [f"token_id:{t}" for t in ids]
    assert all(f"token_id:{t}" in top for t, top in zip(ids, lp.top_logprobs, strict=True))
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(3)]  # as vLLM counts them
    chat = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        temperature=0,
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        extra_body=extra,
    )
    content = chat.choices[0].logprobs.content
    assert [e.token for e in content] == [f"token_id:{t}" for t in chat.choices[0].token_ids]
    assert all(e.top_logprobs[0].token == e.token and bytes(e.bytes) == e.token.encode() for e in content)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_continuous_usage_stats(client: openai.OpenAI, kind: str) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    args = dict(model=MODEL, temperature=0, max_tokens=12, stream=True, stream_options=options)
    if kind == "chat":
        chunks = list(client.chat.completions.create(messages=QUESTION, **args))
    else:
        chunks = list(client.completions.create(prompt="The capital of France is", **args))
    final = chunks[-1]
    assert not final.choices and final.usage.completion_tokens > 0
    counts = [c.usage.completion_tokens for c in chunks[:-1]]
    assert all(c.usage is not None and c.usage.prompt_tokens == final.usage.prompt_tokens for c in chunks)
    assert counts == sorted(counts) and counts[-1] == final.usage.completion_tokens
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)


def test_continue_final_message_and_echo(client: openai.OpenAI, server: Server) -> None:
    opened = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    extra = {"add_generation_prompt": False, "continue_final_message": True}
    args = dict(model=MODEL, messages=opened, temperature=0, max_tokens=3)
    r = client.chat.completions.create(**args, extra_body={**extra, "return_token_ids": True})
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content.startswith(" Paris")
    ids = httpx.post(f"{server.url}/tokenize", json={"messages": opened, **extra}).json()["tokens"]
    assert r.prompt_token_ids == ids  # the open message is the prompt's end
    echoed = client.chat.completions.create(**args, extra_body={**extra, "echo": True})
    assert echoed.choices[0].message.content == "The capital of France is" + r.choices[0].message.content
    chunks = list(client.chat.completions.create(**args, stream=True, extra_body={**extra, "echo": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == echoed.choices[0].message.content
    # Echo takes the last message only where it has the reply's role.
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=3)
    r = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=3, extra_body={"echo": True}
    )
    assert r.choices[0].message.content == plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        client.chat.completions.create(
            model=MODEL, messages=opened, extra_body={"continue_final_message": True}
        )


def test_tokenize_round_trip(server: Server) -> None:
    text = "Hello, world! Ünïcödé 🙂"
    tok = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 512
    back = httpx.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": tok["tokens"]}).json()
    assert back == {"prompt": text}
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": QUESTION}).json()
    assert chat["count"] > tok["count"]


def test_models_health_version(client: openai.OpenAI, server: Server) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", httpx.get(f"{server.url}/version").json()["version"])
    assert 503 in server.statuses_before_ready  # the port answered "starting" while the model loaded
    log = server.output()
    assert f"kiln is ready at {server.url}, serving {MODEL}" in log
    assert re.search(
        r"after start \(imports [\d.]+ s, kernels [\d.]+ s, weights [\d.]+ s, tokenizer [\d.]+ s, "
        r"runner [\d.]+ s, KV cache [\d.]+ s, compile [\d.]+ s, sampler [\d.]+ s, other [\d.]+ s \(the",
        log,
    )
    assert f"try: curl {server.url}/v1/chat/completions" in log


METRICS = [
    "kiln:num_requests_running",
    "kiln:num_requests_waiting",
    "kiln:num_requests_waiting_by_reason",
    "kiln:kv_cache_usage_perc",
    "kiln:prompt_tokens_total",
    "kiln:generation_tokens_total",
    "kiln:request_success_total",
    "kiln:time_to_first_token_seconds_bucket",
    "kiln:inter_token_latency_seconds_bucket",
    "kiln:e2e_request_latency_seconds_bucket",
    "kiln:prefix_cache_queries_total",
    "kiln:prefix_cache_hits_total",
]


def metric(server: Server, name: str, **labels: str) -> float:
    """The sum of a metric's samples over the series that carry the given labels."""
    text = httpx.get(f"{server.url}/metrics").text
    total = 0.0
    for series, value in re.findall(rf"^{re.escape(name)}{{([^}}]*)}} (\S+)$", text, re.M):
        if all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
    return total


def test_metrics(client: openai.OpenAI, server: Server) -> None:
    for _ in range(2):
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4)
    text = httpx.get(f"{server.url}/metrics").text
    for name in METRICS:
        assert re.search(rf"^{re.escape(name)}{{.*model_name=\"{re.escape(MODEL)}\".*}} ", text, re.M), name
    assert metric(server, "kiln:generation_tokens_total") >= 4
    assert metric(server, "kiln:prefix_cache_hits_total") > 0  # the chat template's system prompt repeats
    assert metric(server, "kiln:e2e_request_latency_seconds_count") >= 1
    [labels] = re.findall(r"^kiln:cache_config_info\{(.*)\} 1\.0$", text, re.M)
    info = dict(re.findall(r'(\w+)="([^"]*)"', labels))
    assert {k: info[k] for k in ("engine", "block_size", "cache_dtype", "enable_prefix_caching")} == {
        "engine": "0", "block_size": "32", "cache_dtype": "auto", "enable_prefix_caching": "True"
    }  # fmt: skip
    assert int(info["kv_cache_size_tokens"]) == 32 * int(info["num_gpu_blocks"]) > 0


PHASES = ["queue_time", "prefill_time", "decode_time", "inference_time"]
SIZES = ["prompt_tokens", "generation_tokens", "params_n", "params_max_tokens"]


def test_request_phase_metrics(client: openai.OpenAI, server: Server) -> None:
    """vLLM's per-request histograms: a request's queue, prefill and decode times add up to its latency,
    and its sizes are counted once."""
    names = [f"kiln:request_{p}_seconds" for p in PHASES] + [f"kiln:request_{s}" for s in SIZES]
    names += ["kiln:e2e_request_latency_seconds", "kiln:request_prefill_kv_computed_tokens"]
    names += ["kiln:request_time_per_output_token_seconds", "kiln:iteration_tokens_total"]
    names.append("kiln:request_max_num_generation_tokens")
    totals = ["kiln:prompt_tokens_total", "kiln:prompt_tokens_cached_total", "kiln:generation_tokens_total"]
    before = {n: (metric(server, f"{n}_count"), metric(server, f"{n}_sum")) for n in names}
    before_totals = {n: metric(server, n) for n in totals}
    r = client.completions.create(
        model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=5, n=2, extra_body={"ignore_eos": True}
    )
    after = {n: (metric(server, f"{n}_count"), metric(server, f"{n}_sum")) for n in names}
    count = {n: after[n][0] - before[n][0] for n in names}
    total = {n: after[n][1] - before[n][1] for n in names}
    steps = count.pop("kiln:iteration_tokens_total")
    assert all(c == 1 for c in count.values()), count
    assert total["kiln:request_prompt_tokens"] == r.usage.prompt_tokens
    assert total["kiln:request_generation_tokens"] == 10
    assert total["kiln:request_max_num_generation_tokens"] == 5  # each of the two sequences' 5
    assert (total["kiln:request_params_n"], total["kiln:request_params_max_tokens"]) == (2, 5)
    queue, prefill, decode, inference = (total[f"kiln:request_{p}_seconds"] for p in PHASES)
    assert min(queue, prefill, decode) >= 0 and inference == pytest.approx(prefill + decode, abs=1e-6)
    assert queue + inference <= total["kiln:e2e_request_latency_seconds"] + 1e-6
    assert total["kiln:request_time_per_output_token_seconds"] == pytest.approx(decode / 9)
    # The step histogram holds the prompt and generated tokens the counters took, over at least 5 steps;
    # the tokens computed are the prompt's, less those found cached.
    prompt, cached, generated = (metric(server, n) - before_totals[n] for n in totals)
    assert (
        steps >= 5
        and total["kiln:iteration_tokens_total"] == prompt + generated == r.usage.prompt_tokens + 10
    )
    assert total["kiln:request_prefill_kv_computed_tokens"] == r.usage.prompt_tokens - cached


def test_concurrent_streams_with_early_close(server: Server) -> None:
    async def run() -> list[tuple[int, str | None]]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)

        async def one(i: int) -> tuple[int, str | None]:
            stream = await client.completions.create(
                model=MODEL,
                prompt=f"Story number {i}:",
                max_tokens=32,
                temperature=0.8,
                seed=i,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            chunks, reason = 0, None
            async for chunk in stream:
                chunks += 1
                if chunk.usage is not None:
                    return chunk.usage.completion_tokens, reason
                reason = chunk.choices[0].finish_reason
                if i % 4 == 0 and chunks == 3:  # 8 of 32 leave early
                    await stream.close()
                    return chunks, "closed"
            return -1, "no usage chunk"

        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await client.close()

    results = asyncio.run(run())
    assert [r for i, r in enumerate(results) if i % 4 == 0] == [(3, "closed")] * 8
    assert [r for i, r in enumerate(results) if i % 4] == [(32, "length")] * 24
    for _ in range(50):  # aborts reach the engine between steps
        if (
            metric(server, "kiln:kv_cache_usage_perc") == 0
            and metric(server, "kiln:num_requests_running") == 0
        ):
            break
        asyncio.run(asyncio.sleep(0.1))
    assert metric(server, "kiln:kv_cache_usage_perc") == 0
    assert metric(server, "kiln:num_requests_running") == 0
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_disconnect_aborts_a_whole_request(server: Server) -> None:
    aborted = metric(server, "kiln:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up long before 400 tokens
        auth = {"Authorization": f"Bearer {API_KEY}"}
        httpx.post(f"{server.url}/v1/completions", json=body, headers=auth, timeout=2)
    for _ in range(50):
        if metric(server, "kiln:num_requests_running") == 0:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert metric(server, "kiln:num_requests_running") == 0
    assert metric(server, "kiln:kv_cache_usage_perc") == 0
    assert metric(server, "kiln:request_success_total", finished_reason="abort") == aborted + 1
