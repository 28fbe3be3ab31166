"""The offline API: `LLM(model).generate(prompts, params)`, as in vLLM."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
from tqdm import tqdm

from kiln.config import EngineConfig
from kiln.engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, advance_all
from kiln.engine.chat_template import render_chat
from kiln.engine.content_format import resolve_content_format, template_content, text_parts
from kiln.engine.engine import LLMEngine
from kiln.engine.pooler import check_pairs, pair_scores
from kiln.engine.prompt_embeds import PromptEmbeds
from kiln.engine.request_output import RequestOutput
from kiln.engine.tokenizer import NO_TOKENIZER
from kiln.llm_inputs import Prompt, as_batch, params_for, per_prompt
from kiln.lora_request import LoRARequest
from kiln.pooling_output import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Out,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from kiln.pooling_params import PoolingParams
from kiln.sampling_params import SamplingParams

Message = dict[str, Any]


class LLM:
    def __init__(self, model: str = "default", **options: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_options(model, **options))
        self.engine.warmup()
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's: forgets every cached prefix (between calls no request holds blocks, so it succeeds)."""
        return self.engine.reset_prefix_cache(reset_running_requests)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Prompts: strings, token-id lists, or vLLM's dicts ({"prompt": ...}, {"prompt_token_ids": ...} or,
        made with enable_prompt_embeds=True, {"prompt_embeds": a (tokens, hidden_size) tensor}; with an
        optional "cache_salt"); outputs keep their order. priority: one per prompt, smaller first
        (the engine's scheduler.policy must be "priority"). lora_request: the LoRA adapter of every prompt,
        or one per prompt (the engine made with enable_lora=True)."""
        batch = as_batch(prompts)
        params = params_for(batch, sampling_params, self.engine.sampling_defaults)
        return self._run(self._add(batch, params, priority, lora_request), use_tqdm)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """vLLM's, for a pooling model (runner="pooling"): each prompt's embedding (prompts as generate)."""
        batch = as_batch(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params = [pooling_params or PoolingParams()] * len(batch)
        elif len(pooling_params) != len(batch):
            raise ValueError(f"got {len(pooling_params)} pooling params for {len(batch)} prompts")
        else:
            params = list(pooling_params)
        outputs = self._run(self._add(batch, params, priority, lora_request), use_tqdm)
        return [_pooled(o, EmbeddingOutput(_vector(o).tolist())) for o in outputs]

    def score(
        self, data_1: str | Sequence[str], data_2: str | Sequence[str], use_tqdm: bool = True
    ) -> list[ScoringRequestOutput]:
        """vLLM's, for an embedding model: the cosine similarity of each pair's embeddings (1:1, 1:N or
        N:N), as vLLM scores with a bi-encoder."""
        firsts = [data_1] if isinstance(data_1, str) else list(data_1)
        seconds = [data_2] if isinstance(data_2, str) else list(data_2)
        check_pairs(len(firsts), len(seconds))
        params = [PoolingParams()] * (len(firsts) + len(seconds))
        outs = self._run(self._add(as_batch(firsts + seconds), params, None), use_tqdm)
        vectors = [_vector(o) for o in outs]
        scores = pair_scores(vectors[: len(firsts)], vectors[len(firsts) :])
        a = outs[: len(firsts)] * (len(seconds) if len(firsts) == 1 else 1)
        return [
            PoolingRequestOutput(
                f"{x.request_id}_{y.request_id}",
                x.prompt_token_ids + y.prompt_token_ids,
                True,
                ScoringOutput(s),
            )
            for x, y, s in zip(a, outs[len(firsts) :], scores, strict=True)
        ]

    def classify(
        self, prompts: Prompt | Sequence[Prompt], use_tqdm: bool = True
    ) -> list[ClassificationRequestOutput]:
        """vLLM's, for a sequence classifier: each prompt's class probabilities (prompts as generate)."""
        batch = as_batch(prompts)
        outs = self._run(self._add(batch, [PoolingParams()] * len(batch), None), use_tqdm)
        return [_pooled(o, ClassificationOutput(_vector(o).tolist())) for o in outs]

    def _add(
        self,
        batch: list[tuple[str | list[int] | PromptEmbeds, str | None]],
        params: Sequence[SamplingParams | PoolingParams],
        priority: list[int] | None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[str]:
        """Queues the batch; its request ids. A bad prompt leaves nothing of the call queued."""
        if priority is not None and len(priority) != len(batch):
            raise ValueError(f"got {len(priority)} priorities for {len(batch)} prompts")
        loras = per_prompt(lora_request, len(batch))
        ids = [f"offline-{next(self._ids)}" for _ in batch]
        added: list[str] = []
        try:
            for i, (rid, (prompt, salt), p) in enumerate(zip(ids, batch, params, strict=True)):
                rank = 0 if priority is None else priority[i]
                self.engine.add_request(rid, prompt, p, rank, salt, lora=loras[i])
                added.append(rid)
        except Exception:
            for rid in added:
                self.engine.abort(rid)
            raise
        return ids

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's: each prompt's params.beam_width best beams (kiln.engine.beam_search), the best first;
        a sequence's tokens and text hold the prompt too, as vLLM's. Prompts and lora_request as for
        generate."""
        batch = as_batch(prompts)
        loras = per_prompt(lora_request, len(batch))
        eos = frozenset(self.engine.eos_token_ids)
        searches = []
        for prompt, salt in batch:
            if isinstance(prompt, PromptEmbeds):
                raise ValueError("beam search takes text or token ids, not prompt_embeds")
            ids = self.engine.admission.tokenize(prompt)
            if len(ids) + params.max_tokens > self.engine.max_model_len:
                raise ValueError(
                    f"max_tokens {params.max_tokens} after a prompt of {len(ids)} tokens exceeds "
                    f"max_model_len={self.engine.max_model_len}"
                )
            searches.append(BeamSearch(ids, params, eos, salt))
        step = params.step_params()
        with tqdm(total=params.max_tokens, desc="Beam search", unit="step", disable=not use_tqdm) as bar:
            while running := [s for s in searches if s.running]:
                ids = []
                for search, lora in zip(searches, loras, strict=True):  # advance_all's order
                    for beam in search.beams if search.running else []:
                        ids.append(f"beam-{next(self._ids)}")
                        salt = search.cache_salt
                        self.engine.add_request(ids[-1], beam.tokens, step, cache_salt=salt, lora=lora)
                advance_all(running, self._run(ids, use_tqdm=False))
                bar.update()
        tokenizer = self.engine.tokenizer
        results = []
        for search in searches:
            best = search.best()
            for seq in best if tokenizer is not None else []:  # (skip_tokenizer_init: token ids alone)
                seq.text = tokenizer.decode(seq.tokens, skip_special_tokens=params.skip_special_tokens)
            results.append(BeamSearchOutput(best))
        return results

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_content_format: str = "auto",
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """tools: OpenAI's tool definitions, for a template that shows them to the model (vLLM's);
        chat_template_content_format: as `kiln serve --chat-template-content-format`; lora_request: as
        generate's, one per conversation."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        fmt = chat_template_content_format
        prompts = [
            self.apply_chat_template(
                c, add_generation_prompt, chat_template_kwargs, continue_final_message, tools, fmt
            )
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def apply_chat_template(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_content_format: str = "auto",
    ) -> list[int]:
        """continue_final_message: the last message left open, for the model to go on with it (then
        add_generation_prompt must be False, as in vLLM). Each message's content reaches the template as
        the API's does: text parts joined by newlines, or as a list for a template that loops over them."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError(NO_TOKENIZER)
        fmt = resolve_content_format(chat_template_content_format, tokenizer.chat_template)
        text = render_chat(
            tokenizer,
            [{**m, "content": template_content(text_parts(m.get("content")), fmt)} for m in messages],
            add_generation_prompt,
            chat_template_kwargs,
            tools,
            continue_final_message=continue_final_message,
        )
        return tokenizer.encode(text, add_special_tokens=False)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        try:
            with tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm) as bar:
                while self.engine.has_unfinished():
                    for out in self.engine.step(final_only=True):
                        done[out.request_id] = out
                        bar.update()
        finally:
            for rid in ids:  # after an error (or Ctrl-C) nothing of this call stays queued
                if rid not in done:
                    self.engine.abort(rid)
        return [done[i] for i in ids]


def _vector(out: RequestOutput) -> torch.Tensor:
    assert out.embedding is not None, "a pooling model's output"
    return out.embedding


def _pooled(out: RequestOutput, outputs: Out) -> PoolingRequestOutput[Out]:
    return PoolingRequestOutput(out.request_id, out.prompt_token_ids, out.finished, outputs)
