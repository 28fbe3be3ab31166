"""POST /pooling (vLLM's generic pooling API): each input's pooled output as the model's task makes it,
an embedding or class probabilities, without the task's own response shape."""

from __future__ import annotations

from starlette.requests import Request

from kiln.api.embeddings import encoded, pool, prompts_of
from kiln.api.errors import APIError
from kiln.api.inputs import Inputs
from kiln.api.protocol import PoolingRequest
from kiln.api.responses import DataList, PoolingData
from kiln.api.serving import pooling, response_id
from kiln.engine.async_engine import AsyncEngine
from kiln.pooling_params import PoolingParams


async def create_pooling(
    engine: AsyncEngine, inputs: Inputs, request: Request, body: PoolingRequest
) -> DataList[PoolingData] | None:
    pooling(engine, "Pooling", None)
    assert engine.pooler is not None
    task = engine.pooler.task
    if body.dimensions is not None:  # as vLLM's /pooling
        raise APIError(400, "dimensions is currently not supported", "dimensions")
    if body.task not in (None, task):
        raise APIError(400, f"Unsupported task: {body.task!r} Supported tasks: ({task!r},)", "task")
    prompts = await prompts_of(inputs, body)
    rid = response_id("pooling-", request, body.request_id)
    params = PoolingParams(use_activation=body.use_activation)
    vectors = await pool(engine, inputs, request, body, rid, prompts, params)
    if vectors is None:
        return None
    data = [PoolingData(i, encoded(v, body)) for i, v in enumerate(vectors)]
    return DataList.of(rid, engine.served_name(body.model), data, sum(map(len, prompts)))
