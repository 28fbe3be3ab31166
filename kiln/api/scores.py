"""POST /score and /rerank (vLLM's, also under /v1/, and /v2/rerank) for an embedding model: the cosine
similarity of each pair's embeddings, as vLLM scores with a bi-encoder. Each text is embedded once."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from kiln.api.embeddings import pool, truncated
from kiln.api.errors import APIError
from kiln.api.inputs import Inputs
from kiln.api.protocol import RerankRequest, ScoreRequest, _ScoringRequest
from kiln.api.responses import DataList, RerankDocument, RerankResponse, RerankResult, RerankUsage, ScoreData
from kiln.api.serving import pooling, response_id
from kiln.engine.async_engine import AsyncEngine
from kiln.engine.pooler import check_pairs, pair_scores
from kiln.pooling_params import PoolingParams

_PAIRS = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))


async def create_score(
    engine: AsyncEngine, inputs: Inputs, request: Request, body: ScoreRequest
) -> DataList[ScoreData] | None:
    pooling(engine, "Score", "embed")
    given = [(a, b) for a, b in _PAIRS if getattr(body, a) is not None and getattr(body, b) is not None]
    if len(given) != 1 or sum(getattr(body, f) is not None for f in {f for p in _PAIRS for f in p}) != 2:
        raise APIError(
            400, "give one pair: queries and documents (or items), data_1 and data_2, or text_1 and text_2"
        )
    first, second = given[0]
    scored = await _scores(engine, inputs, request, body, getattr(body, first), getattr(body, second))
    if scored is None:
        return None
    rid, scores, tokens = scored
    data = [ScoreData(i, s) for i, s in enumerate(scores)]
    return DataList.of(rid, engine.served_name(body.model), data, tokens)


async def create_rerank(
    engine: AsyncEngine, inputs: Inputs, request: Request, body: RerankRequest
) -> RerankResponse | None:
    pooling(engine, "Rerank (Score)", "embed")
    documents = [body.documents] if isinstance(body.documents, str) else body.documents
    scored = await _scores(engine, inputs, request, body, body.query, documents)
    if scored is None:
        return None
    rid, scores, tokens = scored
    results = [
        RerankResult(i, RerankDocument(d), s) for i, (d, s) in enumerate(zip(documents, scores, strict=True))
    ]
    results.sort(key=lambda r: r.relevance_score, reverse=True)
    return RerankResponse(
        rid, engine.served_name(body.model), RerankUsage(tokens, tokens), results[: body.top_n or None]
    )


async def _scores(
    engine: AsyncEngine,
    inputs: Inputs,
    request: Request,
    body: _ScoringRequest,
    first: str | list[str],
    second: str | list[str],
) -> tuple[str, list[float], int] | None:
    """(response id, each pair's score, the prompt tokens of every text), or None if the client left."""
    firsts = [first] if isinstance(first, str) else first
    seconds = [second] if isinstance(second, str) else second
    if not firsts:
        raise APIError(400, "At least one text element must be given")
    if not seconds:
        raise APIError(400, "At least one text_pair element must be given")
    try:
        check_pairs(len(firsts), len(seconds))
    except ValueError as e:
        raise APIError(400, str(e)) from None
    limit = inputs.limits.max_completion_prompts
    if len(firsts) + len(seconds) > limit:
        raise APIError(400, f"a request may hold at most {limit} texts (server.max_completion_prompts)")
    prompts = await inputs.run(_ids, inputs, body, firsts, seconds)
    rid = response_id("score-", request, body.request_id)
    vectors = await pool(engine, inputs, request, body, rid, prompts, PoolingParams())
    if vectors is None:
        return None
    scores = pair_scores(vectors[: len(firsts)], vectors[len(firsts) :])
    return rid, scores, sum(map(len, prompts))


def _ids(inputs: Inputs, body: _ScoringRequest, firsts: list[str], seconds: list[str]) -> list[list[int]]:
    """Every text's ids: the first texts' then the second's, each cut to its field's token limit."""
    inputs.check_chars(max(map(len, firsts + seconds)), "documents")
    out = []
    for texts, cap, name in (
        (firsts, body.max_tokens_per_query, "max_tokens_per_query"),
        (seconds, body.max_tokens_per_doc, "max_tokens_per_doc"),
    ):
        if cap >= inputs.max_model_len:
            raise APIError(
                400, f"{name} ({cap}) must be less than max_model_len ({inputs.max_model_len}).", name
            )
        out += [truncated(inputs, body, _encode(inputs.tokenizer, t, cap)) for t in texts]
    return out


def _encode(tokenizer: Any, text: str, cap: int) -> list[int]:
    """The text's ids with the tokenizer's special tokens; cap > 0: its text cut after that many tokens
    first, as vLLM cuts it (at a character boundary, so the cut text tokenizes as it did)."""
    if cap > 0:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if len(enc["input_ids"]) > cap:
            text = text[: enc["offset_mapping"][cap - 1][1]]
    return tokenizer.encode(text)
