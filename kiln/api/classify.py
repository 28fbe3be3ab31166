"""POST /classify (vLLM's, for a sequence classifier: `*ForSequenceClassification`): each input's class
probabilities over its last token, and the likeliest class's label."""

from __future__ import annotations

from starlette.requests import Request

from kiln.api.embeddings import pool, prompts_of
from kiln.api.inputs import Inputs
from kiln.api.protocol import ClassificationRequest
from kiln.api.responses import ClassificationData, DataList
from kiln.api.serving import pooling, response_id
from kiln.engine.async_engine import AsyncEngine
from kiln.pooling_params import PoolingParams


async def create_classification(
    engine: AsyncEngine, inputs: Inputs, request: Request, body: ClassificationRequest
) -> DataList[ClassificationData] | None:
    pooling(engine, "Classification", "classify")
    assert engine.pooler is not None
    labels = engine.pooler.labels
    prompts = await prompts_of(inputs, body)
    rid = response_id("classify-", request, body.request_id)
    vectors = await pool(
        engine, inputs, request, body, rid, prompts, PoolingParams(use_activation=body.use_activation)
    )
    if vectors is None:
        return None
    data = []
    for i, v in enumerate(vectors):
        probs = v.tolist()
        data.append(ClassificationData(i, labels[int(v.argmax())], probs, len(probs)))
    return DataList.of(rid, engine.served_name(body.model), data, sum(map(len, prompts)))
