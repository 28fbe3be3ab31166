"""vLLM's request and output logs (--enable-log-requests, --enable-log-outputs): each request's prompt
and params as it is queued, each finished choice's text, ids and finish reason; prompts and outputs cut
to --max-log-len."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Sequence

from kiln.api.inputs import Inputs
from kiln.engine.prompt_embeds import GivenPrompt, PromptEmbeds, SplicedEmbeds
from kiln.engine.request_output import RequestOutput, merge
from kiln.pooling_params import PoolingParams
from kiln.sampling_params import SamplingParams
from kiln.server_config import ServerConfig

log = logging.getLogger(__name__)


def _name(response_id: str, i: int, count: int) -> str:
    return f"{response_id}-{i}" if count > 1 else response_id


async def log_requests(
    inputs: Inputs,
    response_id: str,
    prompts: Sequence[list[int] | GivenPrompt],
    params: Sequence[SamplingParams | PoolingParams],
) -> None:
    """Each prompt, as text (decoded on the inputs' worker where the body is large) and ids, or the shape
    of its embeddings, and its params, as the engine gets them."""
    if not inputs.limits.enable_log_requests:
        return
    n = inputs.limits.max_log_len
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        if isinstance(prompt, PromptEmbeds):
            shape = (len(prompt), prompt.shape[1])
            log.info(
                "Received request %s: prompt_embeds shape: %s, params: %s",
                _name(response_id, i, len(prompts)), shape, p,
            )  # fmt: skip
            continue
        given = ""
        if isinstance(prompt, SplicedEmbeds):  # its ids, and where its rows are given
            given = ", prompt_embeds at: " + str([(start, tuple(part.shape)) for start, part in prompt.parts])
            prompt = prompt.ids
        ids = prompt[:n]
        text = (await inputs.run(inputs.tokenizer.decode, ids))[:n] if inputs.has_tokenizer else None
        log.info(
            "Received request %s: prompt: %r, params: %s, prompt_token_ids: %s%s",
            _name(response_id, i, len(prompts)), text, p, ids, given,
        )  # fmt: skip


def log_outputs(server: ServerConfig, response_id: str, outputs: list[RequestOutput]) -> None:
    """Each finished choice of these whole outputs (one per prompt)."""
    if not server.enable_log_outputs:
        return
    n = server.max_log_len
    for i, out in enumerate(outputs):
        for c in out.outputs:
            log.info(
                "Generated response %s (choice %d): output: %r, output_token_ids: %s, finish_reason: %s",
                _name(response_id, i, len(outputs)), c.index, c.text[:n], c.token_ids[:n], c.finish_reason,
            )  # fmt: skip


def logged(
    server: ServerConfig,
    response_id: str,
    num_prompts: int,
    outputs: AsyncIterator[tuple[int, RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """A stream's outputs as they are, each prompt's logged whole once it finishes (log_outputs)."""
    if not server.enable_log_outputs:
        return outputs
    return _logged(server, response_id, num_prompts, outputs)


async def _logged(
    server: ServerConfig,
    response_id: str,
    num_prompts: int,
    outputs: AsyncIterator[tuple[int, RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    deltas: dict[int, list[RequestOutput]] = {}
    async with contextlib.aclosing(outputs):  # leaving early aborts, through merged()
        async for i, out in outputs:
            deltas.setdefault(i, []).append(out)
            if out.finished:
                log_outputs(server, _name(response_id, i, num_prompts), [merge(deltas.pop(i))])
            yield i, out
