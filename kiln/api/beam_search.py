"""use_beam_search over HTTP (vLLM's): kiln.engine.beam_search's beams, each step's requests run through
the AsyncEngine, the best n returned as the request's choices."""

from __future__ import annotations

import msgspec
from starlette.requests import Request

from kiln.api.errors import APIError
from kiln.api.protocol import _SamplingRequest
from kiln.api.serving import final_outputs, start_all
from kiln.engine.async_engine import AsyncEngine
from kiln.engine.beam_search import MAX_BEAM_WIDTH, BeamSearch, BeamSearchParams, advance_all, step_prompts
from kiln.engine.detokenizer import detokenizer
from kiln.engine.request_output import CompletionOutput, RequestOutput
from kiln.sampling_params import SamplingParams

# What a beam search has no use for: set, each is a 400 that names it, never silently dropped.
_UNSUPPORTED = (
    "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
    "seed", "stop", "stop_token_ids", "min_tokens", "bad_words", "allowed_token_ids", "response_format",
    "structured_outputs", "prompt_logprobs", "tools", "tool_choice", "repetition_detection",
    "thinking_token_budget",
)  # fmt: skip


def check_beam_search(body: _SamplingRequest) -> None:
    """The fields that go with use_beam_search, and length_penalty without it: 400s naming them."""
    if not body.use_beam_search:
        if body.length_penalty != 1.0:
            raise APIError(400, "length_penalty applies only with use_beam_search", "length_penalty")
        return
    if body.stream:
        raise APIError(400, "Streaming is not currently supported with beam search", "stream")
    if body.n > MAX_BEAM_WIDTH:
        raise APIError(400, f"n (the beam width) must be at most {MAX_BEAM_WIDTH} with use_beam_search", "n")
    defaults = {f.name: f.default for f in msgspec.structs.fields(body)}
    for name in _UNSUPPORTED:
        if name in defaults and getattr(body, name) != defaults[name]:
            raise APIError(400, f"{name} is not supported with use_beam_search", name)
    if getattr(body, "echo", False) and getattr(body, "logprobs", None) is not None:
        raise APIError(
            400, "echo with logprobs is not supported with beam search: it scores no prompt tokens", "echo"
        )


async def beam_search_all(
    engine: AsyncEngine,
    request: Request,
    body: _SamplingRequest,
    response_id: str,
    prompts: list[list[int]],
    params: list[SamplingParams],
) -> list[RequestOutput] | None:
    """Each prompt's beam search (n beams; max_tokens, logprobs, ignore_eos, include_stop_str_in_output and
    the detokenizing fields from its params), in lockstep: one engine batch a step holds every prompt's
    beams. None if the client left."""
    searches = [
        BeamSearch(
            ids,
            BeamSearchParams(
                beam_width=p.n,
                max_tokens=p.max_tokens or 1,
                ignore_eos=p.ignore_eos,
                length_penalty=body.length_penalty,
                include_stop_str_in_output=p.include_stop_str_in_output,
            ),
            engine.eos_token_ids,
        )
        for ids, p in zip(prompts, params, strict=True)
    ]
    step = searches[0].params.step_params(params[0].logprobs or 0)
    while running := [s for s in searches if s.running]:
        beams = step_prompts(running)
        outs = await final_outputs(
            request, start_all(engine, request, body, response_id, beams, [step] * len(beams))
        )
        if outs is None:
            return None
        advance_all(running, outs)
    pairs = enumerate(zip(searches, params, strict=True))
    return [_output(f"{response_id}-{i}", s, p, engine) for i, (s, p) in pairs]


def _output(request_id: str, search: BeamSearch, p: SamplingParams, engine: AsyncEngine) -> RequestOutput:
    """The best beams as choices. As vLLM: a final EOS is in the token ids (include_stop_str_in_output)
    but never in the text."""
    outputs = []
    for i, beam in enumerate(search.best()):
        ids = beam.tokens[len(search.prompt) :]
        shown = ids[:-1] if ids and ids[-1] in search.eos and not p.ignore_eos else ids
        detok = detokenizer(
            engine.tokenizer, search.prompt, p.skip_special_tokens, p.spaces_between_special_tokens
        )
        logprobs = beam.logprobs if p.logprobs is not None else None
        reason, stop = beam.finish_reason, beam.stop_reason
        outputs.append(CompletionOutput(i, detok.step(shown), ids, beam.cum_logprob, logprobs, reason, stop))
    return RequestOutput(request_id, None, search.prompt, None, outputs, True, search.num_cached_tokens)
