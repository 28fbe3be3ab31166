"""Request bodies into engine inputs, bounded before any work: the operator's limits and range checks come
first, then decoding, tokenizing and templating. Small inputs are handled inline; a large one on a worker
thread, so the event loop never does work that grows with a body and small requests never queue behind
a large one. The worker never calls torch: the engine's thread keeps the only OpenMP pool."""

from __future__ import annotations

import asyncio
import copy
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from kiln.api.chat_render import content_chars, render_prompt
from kiln.api.defaults import with_defaults
from kiln.api.errors import APIError
from kiln.api.protocol import ChatRender, CompletionRequest, Tool, _SamplingRequest
from kiln.engine.bad_words import MAX_BAD_WORDS
from kiln.engine.prompt_embeds import PromptEmbeds, SplicedEmbeds
from kiln.engine.tokenizer import NO_TOKENIZER
from kiln.sampling_params import truncate_prompt
from kiln.server_config import ServerConfig

if TYPE_CHECKING:
    from kiln.api.template_traits import TemplateTraits

T = TypeVar("T")

# Bodies up to this many bytes are handled on the event loop: tokenizing this much text takes ~10 ms.
INLINE_SIZE = 16384


@dataclass(slots=True)
class Prompt:
    ids: list[int]  # given embeddings: a placeholder (0) for each row the request keeps
    text: str | None  # the prompt as text, for echo: a string prompt, or token ids decoded when echo asks
    embeds: PromptEmbeds | None = None  # the prompt given as embeddings (truncated)

    @property
    def engine_prompt(self) -> list[int] | PromptEmbeds:
        return self.ids if self.embeds is None else self.embeds


class Inputs:
    """Shared by every request; `for_body(size)` gives one request's view, which works inline when the
    request's body is small and on the worker when it is not."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        max_model_len: int,
        check_prompt: Callable[[list[int]], None],
        limits: ServerConfig,
        template_traits: Callable[[], TemplateTraits],
        embeds_width: int | None = None,
    ) -> None:
        """tokenizer: None where the server runs without one (skip_tokenizer_init): what needs text is a 400.
        template_traits: what /v1/messages needs to know of the chat template, found at its first call.
        embeds_width: the model's hidden size, where completions take prompt_embeds
        (model.enable_prompt_embeds)."""
        self._tokenizer = tokenizer
        self.embeds_width = embeds_width
        self._template_traits = template_traits
        self.vocab_size = vocab_size
        self.check_prompt = check_prompt  # the engine's: token ids in range, room left to generate
        self.max_model_len = max_model_len
        self.limits = limits
        longest = max(map(len, tokenizer.get_vocab())) if tokenizer is not None else 0
        self.max_prompt_chars = limits.max_prompt_chars or 2 * max_model_len * longest
        # Pooling requests cut from the tokenizer's side where they do not say (HF's default without one).
        self.truncation_side = "right" if tokenizer is None else tokenizer.truncation_side
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="kiln-inputs")
        self.inline = True

    @property
    def has_tokenizer(self) -> bool:
        return self._tokenizer is not None

    @property
    def tokenizer(self) -> Any:
        """The tokenizer: a 400 where the server runs without one (skip_tokenizer_init)."""
        if self._tokenizer is None:
            raise APIError(400, NO_TOKENIZER)
        return self._tokenizer

    def template_traits(self) -> TemplateTraits:
        self.tokenizer  # noqa: B018 (a 400 without one)
        return self._template_traits()

    def for_body(self, size: int) -> Inputs:
        view = copy.copy(self)
        view.inline = size <= INLINE_SIZE
        return view

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self.inline:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args))

    async def parse(self, data: bytes, kind: type[T]) -> T:
        """The body, with the server's defaults for the fields it leaves unset (kiln.api.defaults)."""
        return with_defaults(await self.run(_parse, data, kind), self.limits)

    # -- limits ---------------------------------------------------------------------------------

    def check_request(self, body: _SamplingRequest) -> None:
        """The limits on what one request may ask for, before anything is tokenized or queued (all O(1),
        so on the event loop)."""
        lim = self.limits
        if body.n > lim.max_n_sequences:
            raise APIError(400, f"n must be at most {lim.max_n_sequences} (server.max_n_sequences)", "n")
        # More entries than tokens repeat or are out of range.
        for name in ("logit_bias", "stop_token_ids", "allowed_token_ids"):
            if len(getattr(body, name) or ()) > self.vocab_size:
                raise APIError(400, f"{name} may hold at most {self.vocab_size} entries", name)
        # The engine tokenizes bad words on the event loop: a bounded few.
        words = body.bad_words or []
        if len(words) > MAX_BAD_WORDS or sum(map(len, words)) > INLINE_SIZE:
            raise APIError(
                400,
                f"bad_words may hold at most {MAX_BAD_WORDS} words of {INLINE_SIZE} characters in all",
                "bad_words",
            )
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "Stream options can only be defined when `stream=True`.", "stream_options")
        if body.prompt_logprobs is not None and body.stream:
            raise APIError(400, "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
        stops = 1 if isinstance(body.stop, str) else len(body.stop or [])
        if stops > lim.max_stop_strings:
            raise APIError(
                400, f"stop may hold at most {lim.max_stop_strings} strings (server.max_stop_strings)", "stop"
            )

    def check_chars(self, chars: int, param: str) -> None:
        if chars and not self.has_tokenizer:
            raise APIError(400, NO_TOKENIZER)
        if chars > self.max_prompt_chars:
            raise APIError(
                400,
                f"the prompt has {chars} characters, over the limit of {self.max_prompt_chars} "
                "(server.max_prompt_chars)",
                param,
            )

    # -- completions ----------------------------------------------------------------------------

    async def completion_prompts(self, body: CompletionRequest, max_tokens: int | None) -> list[Prompt]:
        """max_tokens: what the request generates, for truncate_prompt_tokens -1."""
        return await self.run(self._completion_prompts, body, max_tokens)

    def _completion_prompts(self, body: CompletionRequest, max_tokens: int | None) -> list[Prompt]:
        prompt, echo, keep = body.prompt, body.echo, body.truncate_prompt_tokens
        embedded = self._embeds(body, max_tokens)
        prompts = [] if prompt is None or prompt == "" else prompt_list(prompt)
        if not prompts and not embedded:
            raise APIError(400, "Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
        if echo:
            self.tokenizer  # noqa: B018 (the prompt's text: a 400 without one)
        if len(embedded) + len(prompts) > self.limits.max_completion_prompts:
            raise APIError(
                400,
                f"a request may hold at most {self.limits.max_completion_prompts} prompts "
                "(server.max_completion_prompts)",
                "prompt",
            )
        self.check_chars(max((len(p) if isinstance(p, str) else 0 for p in prompts), default=0), "prompt")
        out = embedded
        for p in prompts:
            ids = (
                self.tokenizer.encode(p, add_special_tokens=body.add_special_tokens)
                if isinstance(p, str)
                else p
            )
            kept = truncate_prompt(ids, keep, max_tokens, self.max_model_len, body.truncation_side or "left")
            if isinstance(p, str) and len(kept) == len(ids):
                out.append(Prompt(ids, p))
                continue
            try:
                self.check_prompt(kept)
            except ValueError as e:
                raise APIError(400, str(e), "prompt") from None
            out.append(Prompt(kept, self.tokenizer.decode(kept) if echo else None))
        return out

    def _embeds(self, body: CompletionRequest, max_tokens: int | None) -> list[Prompt]:
        """prompt_embeds, unpickled (as weights only) where the server takes them."""
        given = body.prompt_embeds
        if given is None:
            return []
        if self.embeds_width is None:
            message = "You must set `--enable-prompt-embeds` to input `prompt_embeds`."
            raise APIError(400, message, "prompt_embeds")
        if body.echo:
            raise APIError(400, "Echo is unsupported with prompt embeds.", "echo")
        if body.prompt_logprobs is not None:
            raise APIError(400, "prompt_logprobs is not compatible with prompt embeds.", "prompt_logprobs")
        out = []
        side = body.truncation_side or "left"
        for payload in given if isinstance(given, list) else [given]:
            try:
                embeds = PromptEmbeds.decode(payload)
                embeds.check(self.embeds_width)
            except ValueError as e:
                raise APIError(400, str(e), "prompt_embeds") from None
            embeds = embeds.truncated(body.truncate_prompt_tokens, max_tokens, self.max_model_len, side)
            out.append(Prompt([0] * len(embeds), None, embeds))
        return out

    # -- chat and tokenize ----------------------------------------------------------------------

    async def chat_ids(self, body: ChatRender, tools: list[Tool] | None = None) -> list[int]:
        """The request's messages through the chat template, as its fields ask (tools: those it shows)."""
        prompt = await self.chat_prompt(body, tools)
        if isinstance(prompt, SplicedEmbeds):
            raise APIError(
                400, "prompt_embeds content parts are taken by /v1/chat/completions alone", "messages"
            )
        return prompt

    async def chat_prompt(
        self, body: ChatRender, tools: list[Tool] | None = None
    ) -> list[int] | SplicedEmbeds:
        """chat_ids, or where the server takes prompt embeddings and content parts give them, the prompt
        with their rows spliced in."""
        return await self.run(self._chat_prompt, body, tools)

    def _chat_prompt(self, body: ChatRender, tools: list[Tool] | None) -> list[int] | SplicedEmbeds:
        tokenizer = self.tokenizer
        messages = body.messages or []
        chars = sum(content_chars(m) for m in messages)
        chars += sum(len(v) for d in body.documents or () for v in d.values())
        self.check_chars(chars, "messages")
        if body.chat_template is not None and not self.limits.trust_request_chat_template:
            raise APIError(
                400,
                "Chat template is passed with request, but --trust-request-chat-template is not set. "
                "Refused request with untrusted chat template.",
                "chat_template",
            )
        if body.continue_final_message and body.add_generation_prompt:
            raise APIError(
                400,
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                "continue_final_message",
            )
        fmt = self.limits.chat_template_content_format
        return render_prompt(tokenizer, messages, body, tools, fmt, self.embeds_width)

    async def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        encode = functools.partial(self.tokenizer.encode, add_special_tokens=add_special_tokens)
        self.check_chars(len(text), "prompt")
        return await self.run(encode, text)

    async def detokenize(self, tokens: list[int]) -> str:
        return await self.run(self._detokenize, tokens)

    def _detokenize(self, tokens: list[int]) -> str:
        if any(not 0 <= t < self.vocab_size for t in tokens):
            raise APIError(400, f"token ids must be in [0, {self.vocab_size})", "tokens")
        return self.tokenizer.decode(tokens)


def prompt_list(prompt: Any) -> list[str | list[int]]:
    """OpenAI's four prompt shapes as a list of single prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [prompt]
    if prompt and (all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt)):
        return list(prompt)
    raise APIError(
        400,
        "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists",
        "prompt",
    )


def _parse(data: bytes, kind: type[T]) -> T:
    try:
        return msgspec.json.decode(data, type=kind)
    except RecursionError:  # msgspec's own depth guard
        raise APIError(400, "the request body is not valid JSON: it is nested too deeply") from None
