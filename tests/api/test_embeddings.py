"""/v1/embeddings from a pooling model (--runner pooling) through the OpenAI SDK and raw HTTP: text, token
ids and chat messages in; floats and base64 of each dtype and byte order out, equal to transformers'
normalized last hidden state; Matryoshka dimensions, truncation, and vLLM's errors, including the 501s
of the APIs the other kind of model does not serve. /score and /rerank: cosine similarities of those
embeddings, as vLLM's bi-encoder scoring."""

from __future__ import annotations

import base64
import collections
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F
import transformers
from hypothesis import HealthCheck, given, settings
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.api.fuzz import POOLING_ENDPOINTS, check, requests
from tests.api.server import AUTH, Server, expect_error, post, start_server
from tests.conftest import API_KEY
from tests.models.tiny import CONFIGS, build_default_vocab, save_tokenizer

pytestmark = pytest.mark.slow

NAME = "tiny-embed"
TEXTS = ["The sea is grey and restless.", "Bread", "Rivers shape the land they cross, slowly, over ages."]


@pytest.fixture(scope="module")
def embed_model(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    path = build_default_vocab(tmp_path_factory.mktemp("tiny-embed"), default_model_dir)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"matryoshka_dimensions": [16, 32]}))
    return path


@pytest.fixture(scope="module")
def embed_server(tmp_path_factory: pytest.TempPathFactory, embed_model: Path) -> Iterator[Server]:
    config = {
        "model": {"model": str(embed_model), "max_model_len": 64, "dtype": "float32"},
        "cache": {"kv_cache_gib": 0.02},
        "compile": {"mode": "eager"},
        "server": {"api_key": API_KEY, "served_model_name": NAME},
    }
    srv = start_server(tmp_path_factory.mktemp("serve-embed"), config, "--runner", "pooling")
    yield srv
    assert srv.stop() == 0, srv.output()


@pytest.fixture(scope="module")
def reference(embed_model: Path) -> tuple[torch.nn.Module, object]:
    model = AutoModelForCausalLM.from_pretrained(embed_model, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(embed_model)


def expected(reference: tuple[torch.nn.Module, object], ids: list[int], dims: int = 64) -> np.ndarray:
    with torch.no_grad():
        h = reference[0].model(torch.tensor([ids])).last_hidden_state[0, -1]
    return F.normalize(h[:dims], dim=-1).numpy()


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_the_sdk_gets_each_texts_normalized_last_hidden_state(embed_server: Server, reference: tuple) -> None:
    tokenizer = reference[1]
    ids = [tokenizer.encode(t) for t in TEXTS]
    for fmt in (openai.NOT_GIVEN, "float"):  # unless told, the SDK asks for base64 and decodes it
        got = client(embed_server).embeddings.create(model=NAME, input=TEXTS, encoding_format=fmt)
        assert got.model == NAME and got.object == "list"
        assert [d.index for d in got.data] == [0, 1, 2]
        assert got.usage.prompt_tokens == got.usage.total_tokens == sum(map(len, ids))
        for d, one in zip(got.data, ids, strict=True):
            np.testing.assert_allclose(d.embedding, expected(reference, one), atol=1e-5)


def test_token_ids_and_matryoshka_dimensions(embed_server: Server, reference: tuple) -> None:
    ids = [5, 900, 17, 4000, 23]
    got = client(embed_server).embeddings.create(model=NAME, input=ids, dimensions=16)
    np.testing.assert_allclose(got.data[0].embedding, expected(reference, ids, 16), atol=1e-5)
    r = post(embed_server, "/v1/embeddings", json={"input": ids, "dimensions": 8})
    assert "Matryoshka dimensions [16, 32]" in expect_error(r, 400, "BadRequestError", "dimensions")


def test_a_conversation_is_embedded_through_the_chat_template(embed_server: Server, reference: tuple) -> None:
    messages = [{"role": "user", "content": "Hello there"}]
    r = post(embed_server, "/v1/embeddings", json={"messages": messages, "model": NAME})
    assert r.status_code == 200, r.text
    ids = reference[1].apply_chat_template(messages, add_generation_prompt=False, return_dict=False)
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    np.testing.assert_allclose(r.json()["data"][0]["embedding"], expected(reference, ids), atol=1e-5)


@pytest.mark.parametrize(
    ("dtype", "endianness", "numpy_dtype"),
    [("float16", "big", ">f2"), ("float32", "little", "<f4"), ("bfloat16", "native", None)],
)
def test_base64_in_each_dtype_and_byte_order(
    embed_server: Server, reference: tuple, dtype: str, endianness: str, numpy_dtype: str | None
) -> None:
    body = {"input": TEXTS[0], "encoding_format": "base64", "embed_dtype": dtype, "endianness": endianness}
    r = post(embed_server, "/v1/embeddings", json=body)
    assert r.status_code == 200, r.text
    raw = base64.b64decode(r.json()["data"][0]["embedding"])
    if numpy_dtype is None:  # bfloat16: the high half of a float32
        got = torch.frombuffer(bytearray(raw), dtype=torch.bfloat16).float().numpy()
    else:
        got = np.frombuffer(raw, dtype=numpy_dtype).astype(np.float32)
    np.testing.assert_allclose(got, expected(reference, reference[1].encode(TEXTS[0])), atol=1e-2)


def test_truncation_and_the_context_limit(embed_server: Server, reference: tuple) -> None:
    ids = list(range(100, 170))  # 70 tokens, over max_model_len 64
    r = post(embed_server, "/v1/embeddings", json={"input": ids})
    assert "maximum context length is 64" in expect_error(r, 400, "BadRequestError", "input")
    for side, kept in (("left", ids[-10:]), ("right", ids[:10])):
        body = {"input": ids, "truncate_prompt_tokens": 10, "truncation_side": side}
        r = post(embed_server, "/v1/embeddings", json=body)
        np.testing.assert_allclose(r.json()["data"][0]["embedding"], expected(reference, kept), atol=1e-5)
    r = post(embed_server, "/v1/embeddings", json={"input": ids, "truncate_prompt_tokens": -1})
    assert r.json()["usage"]["prompt_tokens"] == 64
    r = post(embed_server, "/v1/embeddings", json={"input": ids, "truncate_prompt_tokens": 65})
    expect_error(r, 400, "BadRequestError", "truncate_prompt_tokens")
    r = post(embed_server, "/v1/embeddings", json={"input": ids, "truncate_prompt_tokens": 0})
    expect_error(r, 400, "BadRequestError", "truncate_prompt_tokens")


def test_bad_embedding_requests_name_their_field(embed_server: Server) -> None:
    r = post(embed_server, "/v1/embeddings", json={"input": "a", "normalize": True})
    assert "normalize" in expect_error(r, 400, "BadRequestError", "normalize")
    r = post(embed_server, "/v1/embeddings", json={"input": "a", "encoding_format": "bytes"})
    expect_error(r, 400, "BadRequestError", "encoding_format")
    r = post(
        embed_server, "/v1/embeddings", json={"input": "a", "messages": [{"role": "user", "content": "b"}]}
    )
    expect_error(r, 400, "BadRequestError", "input")
    r = post(embed_server, "/v1/embeddings", json={"input": [5, 10**6]})
    expect_error(r, 400, "BadRequestError", "input")


def test_a_pooling_model_does_not_generate_and_sagemaker_gets_embeddings(embed_server: Server) -> None:
    for path, api, body in (
        ("/v1/chat/completions", "Chat Completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", "Completions", {"prompt": "hi"}),
        ("/v1/responses", "Responses", {"input": "hi"}),
    ):
        message = expect_error(post(embed_server, path, json=body), 501, "NotImplementedError")
        assert message == f"The model does not support {api} API"
    r = post(embed_server, "/invocations", json={"input": ["a", "b"]})
    assert r.status_code == 200 and len(r.json()["data"]) == 2, r.text
    assert post(embed_server, "/tokenize", json={"prompt": "hi"}).status_code == 200


def test_a_generating_model_does_not_embed_nor_score(tiny_server: Server) -> None:
    for path, api, body in (
        ("/v1/embeddings", "Embeddings", {"input": "hi"}),
        ("/score", "Score", {"text_1": "a", "text_2": "b"}),
        ("/v1/rerank", "Rerank (Score)", {"query": "a", "documents": ["b"]}),
        ("/pooling", "Pooling", {"input": "hi"}),
    ):
        message = expect_error(post(tiny_server, path, json=body), 501, "NotImplementedError")
        assert message == f"The model does not support {api} API"


def cosines(reference: tuple, first: list[str], second: list[str], doc_cap: int = 0) -> list[float]:
    tokenizer = reference[1]
    a = [expected(reference, tokenizer.encode(t)) for t in first]
    docs = [tokenizer.encode(t)[:doc_cap] if doc_cap else tokenizer.encode(t) for t in second]
    b = [expected(reference, ids) for ids in docs]
    a = a * len(b) if len(a) == 1 else a
    return [float(np.dot(x, y)) for x, y in zip(a, b, strict=True)]


def scores(r: httpx.Response) -> list[float]:
    assert r.status_code == 200, r.text
    return [d["score"] for d in r.json()["data"]]


def test_scores_are_the_cosines_of_the_embeddings(embed_server: Server, reference: tuple) -> None:
    query, docs = TEXTS[0], TEXTS
    tokens = sum(len(reference[1].encode(t)) for t in [query, *docs])
    for first, second in (("text_1", "text_2"), ("queries", "documents"), ("data_1", "data_2")):
        r = post(embed_server, "/v1/score", json={"model": NAME, first: query, second: docs})
        np.testing.assert_allclose(scores(r), cosines(reference, [query], docs), atol=1e-5)
        got = r.json()
        assert got["id"].startswith("score-") and got["object"] == "list" and got["model"] == NAME
        assert [d["index"] for d in got["data"]] == [0, 1, 2] and got["data"][0]["object"] == "score"
        assert got["usage"]["prompt_tokens"] == tokens
    r = post(embed_server, "/score", json={"queries": docs, "items": docs[::-1]})  # N:N
    np.testing.assert_allclose(scores(r), cosines(reference, docs, docs[::-1]), atol=1e-5)
    # The documents cut to their first two tokens (the default tokenizer adds no special tokens).
    r = post(embed_server, "/score", json={"text_1": query, "text_2": docs, "max_tokens_per_doc": 2})
    np.testing.assert_allclose(scores(r), cosines(reference, [query], docs, 2), atol=1e-5)


def test_rerank_orders_the_documents_by_score(embed_server: Server, reference: tuple) -> None:
    query, docs = "Bread and rivers", TEXTS
    want = cosines(reference, [query], docs)
    order = sorted(range(3), key=lambda i: -want[i])
    for path, top_n in (("/rerank", 0), ("/v2/rerank", 2)):
        r = post(embed_server, path, json={"model": NAME, "query": query, "documents": docs, "top_n": top_n})
        got = r.json()
        assert got["id"].startswith("score-") and got["model"] == NAME
        kept = order[: top_n or 3]
        assert [x["index"] for x in got["results"]] == kept
        assert [x["document"] for x in got["results"]] == [
            {"text": docs[i], "multi_modal": None} for i in kept
        ]
        relevance = [x["relevance_score"] for x in got["results"]]
        np.testing.assert_allclose(relevance, [want[i] for i in kept], atol=1e-5)
        assert got["usage"]["prompt_tokens"] == got["usage"]["total_tokens"] > 0


def test_bad_score_requests(embed_server: Server) -> None:
    r = post(embed_server, "/score", json={"text_1": ["a", "b"], "text_2": ["a", "b", "c"]})
    assert expect_error(r, 400, "BadRequestError") == "Input lengths must be either 1:1, 1:N or N:N"
    r = post(embed_server, "/score", json={"text_1": "a", "documents": ["b"]})
    assert "give one pair" in expect_error(r, 400, "BadRequestError")
    r = post(embed_server, "/score", json={"text_1": "a", "text_2": []})
    assert expect_error(r, 400, "BadRequestError") == "At least one text_pair element must be given"
    r = post(embed_server, "/rerank", json={"query": "a", "documents": ["b"], "max_tokens_per_query": 64})
    expect_error(r, 400, "BadRequestError", "max_tokens_per_query")


def test_hostile_pooling_bodies_get_no_500(embed_server: Server) -> None:
    statuses: collections.Counter[int] = collections.Counter()

    @settings(
        max_examples=150,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(requests(POOLING_ENDPOINTS))
    def one(path_body: tuple[str, bytes]) -> None:
        path, body = path_body
        response = client.post(path, content=body, headers={**AUTH, "Content-Type": "application/json"})
        statuses[response.status_code] += 1
        check(response, False, path)

    with httpx.Client(base_url=embed_server.url, timeout=60) as client:
        one()
    assert statuses[200] > 0 and statuses[400] > 0, statuses
    assert post(embed_server, "/v1/embeddings", json={"input": "still here"}).status_code == 200


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("tiny-classifier")
    config_cls, kwargs = CONFIGS["llama"]
    config = getattr(transformers, config_cls)(**kwargs, num_labels=2, id2label={0: "calm", 1: "angry"})
    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(path)
    save_tokenizer(path)
    return path, model


@pytest.fixture(scope="module")
def classify_server(tmp_path_factory: pytest.TempPathFactory, classifier: tuple) -> Iterator[Server]:
    config = {
        "model": {"model": str(classifier[0]), "max_model_len": 64, "dtype": "float32"},
        "cache": {"kv_cache_gib": 0.02},
        "compile": {"mode": "eager"},
        "server": {"api_key": API_KEY},
    }
    srv = start_server(tmp_path_factory.mktemp("serve-classify"), config)  # runner auto: a classifier
    yield srv
    assert srv.stop() == 0, srv.output()


def test_classify_gives_each_inputs_class_probabilities(classify_server: Server, classifier: tuple) -> None:
    texts = ["t5 t6 t7", "t100", "t9 t9 t9 t9 t9"]
    r = post(classify_server, "/classify", json={"input": texts})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["id"].startswith("classify-") and got["object"] == "list"
    tokenizer = AutoTokenizer.from_pretrained(classifier[0])
    for i, (d, text) in enumerate(zip(got["data"], texts, strict=True)):
        with torch.no_grad():
            want = classifier[1](torch.tensor([tokenizer.encode(text)])).logits[0].softmax(-1)
        np.testing.assert_allclose(d["probs"], want.numpy(), atol=1e-5)
        assert (d["index"], d["num_classes"], d["label"]) == (i, 2, ["calm", "angry"][int(want.argmax())])
    assert got["usage"]["prompt_tokens"] == 3 + 1 + 5
    r = post(classify_server, "/classify", json={"input": texts[0], "use_activation": False})
    with torch.no_grad():
        logits = classifier[1](torch.tensor([tokenizer.encode(texts[0])])).logits[0]
    np.testing.assert_allclose(r.json()["data"][0]["probs"], logits.numpy(), atol=1e-5)
    assert len(post(classify_server, "/invocations", json={"input": texts}).json()["data"]) == 3


def test_each_pooling_task_answers_only_its_own_apis(classify_server: Server, embed_server: Server) -> None:
    for server, path, api, body in (
        (classify_server, "/v1/embeddings", "Embeddings", {"input": "t1"}),
        (classify_server, "/rerank", "Rerank (Score)", {"query": "t1", "documents": ["t2"]}),
        (classify_server, "/v1/completions", "Completions", {"prompt": "t1"}),
        (embed_server, "/classify", "Classification", {"input": "hi"}),
    ):
        message = expect_error(post(server, path, json=body), 501, "NotImplementedError")
        assert message == f"The model does not support {api} API"


def test_pooling_gives_the_models_own_output(
    embed_server: Server, reference: tuple, classify_server: Server, classifier: tuple
) -> None:
    """vLLM's /pooling: an embedding model's embeddings, a classifier's class probabilities, each in the
    pooling API's own shape."""
    ids = [reference[1].encode(t) for t in TEXTS]
    r = post(embed_server, "/pooling", json={"input": TEXTS, "task": "embed"})
    got = r.json()
    assert got["id"].startswith("pooling-") and got["object"] == "list" and got["model"] == NAME
    assert [(d["index"], d["object"]) for d in got["data"]] == [
        (0, "pooling"),
        (1, "pooling"),
        (2, "pooling"),
    ]
    for d, one in zip(got["data"], ids, strict=True):
        np.testing.assert_allclose(d["data"], expected(reference, one), atol=1e-5)
    assert got["usage"]["prompt_tokens"] == sum(map(len, ids))
    got = post(classify_server, "/pooling", json={"input": "t5 t6 t7"}).json()
    tokenizer = AutoTokenizer.from_pretrained(classifier[0])
    with torch.no_grad():
        want = classifier[1](torch.tensor([tokenizer.encode("t5 t6 t7")])).logits[0].softmax(-1)
    np.testing.assert_allclose(got["data"][0]["data"], want.numpy(), atol=1e-5)
    r = post(embed_server, "/pooling", json={"input": "hi", "task": "classify"})
    assert (
        expect_error(r, 400, "BadRequestError", "task")
        == "Unsupported task: 'classify' Supported tasks: ('embed',)"
    )
    r = post(embed_server, "/pooling", json={"input": "hi", "dimensions": 16})
    assert expect_error(r, 400, "BadRequestError", "dimensions") == "dimensions is currently not supported"
