"""A request's outputs on the event loop, as the AsyncEngine hands them over."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kiln.engine.request_output import CompletionOutput, RequestOutput, merge
from kiln.pooling_params import PoolingParams
from kiln.sampling_params import SamplingParams


@dataclass(slots=True, eq=False)
class RequestStream:
    """The outputs of one request, as an async iterator of deltas; a reader that falls behind gets what
    it missed merged into one. `close()` aborts the request if it has not finished."""

    request_id: str
    abort: Callable[[str], None]  # the engine's, for a request closed before it finished
    params: SamplingParams | PoolingParams
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.monotonic)
    scheduled_at: float = 0.0  # time.monotonic() when first scheduled (the engine's output says)
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    num_tokens: int = 0
    seq_tokens: dict[int, int] = field(default_factory=dict)  # tokens by sequence index (n > 1: several)
    finished: bool = False
    prefill_tokens: int = 0  # prompt tokens x n until its first output, for max_num_queued_tokens
    prompt_token_ids: list[int] = field(default_factory=list)

    @property
    def seqs(self) -> int:
        """The sequences it runs (n), for scheduler.max_num_queued_reqs."""
        return self.params.n if isinstance(self.params, SamplingParams) else 1

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        error = next((i for i in items if isinstance(i, BaseException)), None)
        if error is not None:
            self.finished = True
            raise error
        out = merge(items)  # type: ignore[arg-type]
        self.finished = out.finished
        return out

    def aborted(self) -> RequestOutput:
        """Its last output when the server aborts it (vLLM's pause): each sequence ends with "abort"."""
        logprobs = None if isinstance(self.params, PoolingParams) or self.params.logprobs is None else []
        ends = [CompletionOutput(i, "", [], None, logprobs, "abort", None) for i in range(self.seqs)]
        return RequestOutput(self.request_id, None, self.prompt_token_ids, None, ends, True)

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self.abort(self.request_id)
