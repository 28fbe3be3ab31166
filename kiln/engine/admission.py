"""Admission: what a request is checked against before it is queued (the model's vocabulary and context,
the engine's limits and scheduling policy), and the Requests it becomes, one per sample. The checks raise
ValueError, beginning with the field's name; LLMEngine.add_request queues what passes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from kiln.engine.bad_words import BadWords, tokenize_bad_words
from kiln.engine.constraint import Constraint
from kiln.engine.detokenizer import SequenceText, detokenizer
from kiln.engine.grammar import Grammars
from kiln.engine.pooler import Pooler
from kiln.engine.prompt_embeds import GivenPrompt, SplicedEmbeds
from kiln.engine.request import Request
from kiln.engine.thinking import Thinking, ThinkTags
from kiln.pooling_params import PoolingParams
from kiln.sampling_params import SamplingParams, StructuredOutputsParams, truncate_prompt

_POOLED = SamplingParams(max_tokens=1)  # an embedding request's: it samples nothing


@dataclass(frozen=True, slots=True)
class Admission:
    tokenizer: Any  # a fast tokenizer is not safe to share between threads: one Admission per thread (None:
    # skip_tokenizer_init)
    grammars: Grammars
    eos_token_ids: set[int]
    vocab_size: int
    max_model_len: int
    policy: str  # the scheduler's: "fcfs" or "priority"
    max_logprobs: int  # the most logprobs a request may ask for (model.max_logprobs, -1 resolved)
    device: torch.device  # where seeded requests' generators live
    think_tags: ThinkTags | None = None  # a reasoning parser's (model.reasoning_parser)
    constrain_thinking: bool = False  # structured_outputs_config.enable_in_reasoning
    pooler: Pooler | None = None  # runner pooling's: requests are for embeddings
    # model.enable_prompt_embeds, and what the embeddings must fit: the model's hidden size and dtype
    prompt_embeds: bool = False
    hidden_size: int = 0
    dtype: torch.dtype = torch.float32
    # the model's token embedding, for the token rows of a prompt spliced with embeddings (SplicedEmbeds)
    embed: Callable[[torch.Tensor], torch.Tensor] | None = None

    def tokenize(
        self, prompt: str | list[int], params: SamplingParams | PoolingParams | None = None
    ) -> list[int]:
        """The prompt's ids, truncated as params ask."""
        if isinstance(prompt, str) and self.tokenizer is None:
            raise ValueError("You cannot pass text prompts when `skip_tokenizer_init=True`")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if isinstance(params, SamplingParams):
            keep, side = params.truncate_prompt_tokens, params.truncation_side
            ids = truncate_prompt(ids, keep, params.max_tokens, self.max_model_len, side)
        self.check_prompt(ids, isinstance(params, PoolingParams))
        return ids

    def check_embeds(self, embeds: GivenPrompt, params: SamplingParams | PoolingParams) -> GivenPrompt:
        """A prompt given as embeddings, checked by its metadata alone (so on the event loop), with the rows
        truncate_prompt_tokens keeps. In the engine a given row's id is a placeholder (0), which the row
        replaces."""
        if not self.prompt_embeds:
            raise ValueError("You must set `--enable-prompt-embeds` to input `prompt_embeds`.")
        if isinstance(params, PoolingParams):
            raise ValueError("prompt_embeds are for generating: a pooling model embeds token ids")
        if params.prompt_logprobs is not None:  # no prompt token to score
            raise ValueError("prompt_logprobs is not compatible with prompt embeds.")
        embeds.check(self.hidden_size)
        keep, side = params.truncate_prompt_tokens, params.truncation_side
        embeds = embeds.truncated(keep, params.max_tokens, self.max_model_len, side)
        self.check_prompt(embeds.ids)
        return embeds

    def embeds_prompt(
        self, embeds: GivenPrompt, params: SamplingParams | PoolingParams
    ) -> tuple[list[int], torch.Tensor]:
        """The ids (placeholders where rows are given) and every kept row of a prompt given as embeddings,
        in the model's dtype."""
        embeds = self.check_embeds(embeds, params)
        if isinstance(embeds, SplicedEmbeds):
            assert self.embed is not None, "an engine that takes prompt_embeds gives its embedding"
            return embeds.ids, embeds.rows(self.dtype, self.embed, self.device)
        return embeds.ids, embeds.rows(self.dtype)

    def check_prompt(self, ids: list[int], pooled: bool = False) -> None:
        """pooled: for an embedding, which may fill max_model_len."""
        if not ids:
            raise ValueError("prompt is empty")
        if pooled and len(ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len}")
        if not pooled and len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens, which leaves no room to generate within "
                f"max_model_len={self.max_model_len}"
            )
        vocab = self.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")

    def check_params(self, params: SamplingParams | PoolingParams) -> BadWords:
        """What the params can't check alone: limits that depend on the model, and the kind of request
        its runner serves (a pooling model embeds, a generating one generates). Returns the bad words as
        token sequences, which checking them makes."""
        if isinstance(params, PoolingParams):
            if self.pooler is None:
                raise ValueError("embeddings need a pooling model: serve it with --runner pooling")
            self.pooler.sequence(params)
            return ()
        if self.pooler is not None:
            raise ValueError("a pooling model (--runner pooling) gives embeddings and does not generate")
        vocab = self.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.max_logprobs:
                raise ValueError(f"{name} must be at most {self.max_logprobs}, got {k}")
        for name in ("logit_bias", "stop_token_ids", "allowed_token_ids"):
            bad = [t for t in getattr(params, name) or () if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{name} token ids must be in [0, {vocab}), got {bad[:4]}")
        if self.tokenizer is None:
            for name, needs in (("stop", "text to find stop strings in"), ("bad_words", "a tokenizer")):
                if getattr(params, name):
                    raise ValueError(f"{name} needs {needs}, and the server runs with skip_tokenizer_init")
        if params.structured_outputs is not None:
            self.check_constraint(params.structured_outputs)
        if params.thinking_token_budget is not None:
            if self.think_tags is None:
                raise ValueError("thinking_token_budget needs a reasoning parser (--reasoning-parser)")
            if self.constrain_thinking and params.structured_outputs is not None:
                raise ValueError(
                    "thinking_token_budget cannot end the thinking while a constraint holds it "
                    "(structured_outputs_config.enable_in_reasoning)"
                )
        return tokenize_bad_words(self.tokenizer, params.bad_words, vocab)

    def check_constraint(self, so: StructuredOutputsParams) -> Constraint:
        """A constraint parsed (thread-safe, cached): ValueError if it is bad, or if there is no tokenizer to
        compile its grammar against."""
        if self.tokenizer is None:  # (vLLM's words)
            raise ValueError(
                "Structured outputs requires a tokenizer so it can't be used with 'skip_tokenizer_init'"
            )
        return self.grammars.check(so)

    def pooled_request(
        self, request_id: str, ids: list[int], params: PoolingParams, priority: int, cache_salt: str | None
    ) -> Request:
        """An embedding request: it runs its prompt and ends with its embedding."""
        assert self.pooler is not None
        text = SequenceText(detokenizer(self.tokenizer, ids, True, True), [])
        return Request(
            request_id=request_id,
            parent_id=request_id,
            params=_POOLED,
            token_ids=list(ids),
            num_prompt_tokens=len(ids),
            max_tokens=1,
            text=text,
            pooling=self.pooler.sequence(params),
            priority=priority,
            cache_salt=cache_salt or "",
        )

    def check_options(self, priority: int, cache_salt: str | None) -> None:
        """vLLM's request options beside the params."""
        if priority and self.policy != "priority":
            raise ValueError(
                f"priority {priority} needs the priority scheduling policy (--scheduling-policy priority)"
            )
        if cache_salt == "":
            raise ValueError("cache_salt must be a non-empty string if given")

    def requests(
        self,
        request_id: str,
        ids: list[int],
        params: SamplingParams,
        bad_words: BadWords,
        priority: int,
        cache_salt: str | None,
        embeds: torch.Tensor | None = None,
    ) -> list[Request]:
        """The checked request as one Request per sample: with n > 1 each gets its own seed (seed + i)
        and id (request_id-i); only the first scores the prompt. embeds: the prompt's rows, where it was
        given as embeddings (ids then hold placeholders)."""
        so = params.structured_outputs
        constraint = None if so is None else self.check_constraint(so)  # parsed once, for every sample
        requests = []
        for i in range(params.n):
            p = (
                params
                if params.n == 1
                else msgspec.structs.replace(
                    params,
                    n=1,
                    seed=None if params.seed is None else params.seed + i,
                    prompt_logprobs=params.prompt_logprobs if i == 0 else None,
                )
            )
            child_id = f"{request_id}-{i}" if params.n > 1 else request_id
            requests.append(
                self._request(
                    child_id, request_id, ids, p, constraint, bad_words, priority, cache_salt or "", embeds
                )
            )
        return requests

    def _request(
        self,
        request_id: str,
        parent_id: str,
        ids: list[int],
        p: SamplingParams,
        constraint: Constraint | None,
        bad_words: BadWords,
        priority: int,
        cache_salt: str,
        embeds: torch.Tensor | None,
    ) -> Request:
        banned = (
            []
            if p.min_tokens == 0
            else sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids))
        )
        room = self.max_model_len - len(ids)
        generator = None
        if p.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(p.seed)
        context = ids if embeds is None else []  # placeholders are no text to follow
        detok = detokenizer(self.tokenizer, context, p.skip_special_tokens, p.spaces_between_special_tokens)
        return Request(
            request_id=request_id,
            parent_id=parent_id,
            params=p,
            token_ids=list(ids),
            num_prompt_tokens=len(ids),
            max_tokens=min(p.max_tokens or room, room),
            text=SequenceText(detok, p.stop),
            generator=generator,
            min_tokens_banned=banned,
            stop_ids=frozenset(p.stop_token_ids),
            bad_words=bad_words,
            grammar=None if constraint is None else self.grammars.start(constraint),
            thinking=self._thinking(p, constraint is not None),
            priority=priority,
            cache_salt=cache_salt,
            prompt_embeds=embeds,
            logprobs=[] if p.logprobs is not None else None,
            prompt_logprobs=[None] if p.prompt_logprobs is not None else None,
        )

    def _thinking(self, p: SamplingParams, constrained: bool) -> Thinking | None:
        """Where a sequence's thinking ends matters to a grammar that holds only the answer, and to a
        budget; otherwise it is not followed."""
        grammar = constrained and not self.constrain_thinking
        if self.think_tags is None or (p.thinking_token_budget is None and not grammar):
            return None
        return Thinking(self.think_tags, p.thinking_token_budget, grammar)
