from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from kiln.engine.bad_words import BadWords, banned_next
from kiln.engine.detokenizer import SequenceText
from kiln.engine.grammar import SequenceGrammar
from kiln.engine.pooler import Pooling
from kiln.engine.speculative import NgramIndex
from kiln.engine.thinking import Thinking
from kiln.lora_request import LoRARequest
from kiln.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int
    decoded_token: str


# One entry per position: the sampled (or prompt) token's id -> Logprob, then the top-k.
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True, eq=False)
class Request:
    """One sequence being generated. `token_ids` is prompt + output; the KV of the first
    `num_computed_tokens` of them is in the cache. Under async scheduling the last `num_pending` tokens
    are sampled but still on the device: they follow token_ids, and the next step reads them there."""

    request_id: str
    parent_id: str  # the user's request id; differs from request_id only for n > 1
    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    max_tokens: int  # at most max_model_len less the prompt
    text: SequenceText
    generator: torch.Generator | None = None
    min_tokens_banned: list[int] = field(default_factory=list)  # EOS and stop ids, until min_tokens
    stop_ids: frozenset[int] = frozenset()  # params.stop_token_ids, checked against every output token
    bad_words: BadWords = ()  # params.bad_words as token sequences
    grammar: SequenceGrammar | None = None  # params.structured_outputs, compiled
    thinking: Thinking | None = None  # where its reasoning ends, when a grammar or a budget needs to know
    pooling: Pooling | None = None  # an embedding request (runner pooling): it ends with its prompt
    # A prompt given as embeddings (vLLM's prompt_embeds): one row per prompt token, in the model's dtype, on
    # the host; its token_ids there are placeholders (0), which the runner's rows replace.
    prompt_embeds: torch.Tensor | None = None
    # vLLM's request options beside the params: a smaller priority is scheduled first (policy "priority");
    # arrival orders the queue within a priority; only requests with the same cache_salt share cached blocks.
    priority: int = 0
    arrival: int = 0
    cache_salt: str = ""
    lora: LoRARequest | None = None  # the LoRA adapter it runs with
    ngrams: NgramIndex | None = None  # its n-grams, where it drafts (speculative decoding)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    num_pending: int = 0
    num_cached_tokens: int = -1  # prompt tokens served from the prefix cache at first admission
    scheduled_at: float = 0.0  # time.monotonic() at first admission (0: still waiting)
    # Appended to, or replaced by a new list; never changed in place (StepBuffers.set_blocks relies on it).
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0  # leading blocks already offered to the prefix cache
    num_sent_tokens: int = 0  # output tokens (and logprob rows) already in an output
    logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] = field(init=False)  # a copy made once: outputs share it every step
    bad_prefixes: bool = field(init=False)  # some bad word has several tokens

    def __post_init__(self) -> None:
        self.prompt_token_ids = self.token_ids[: self.num_prompt_tokens]
        self.bad_prefixes = any(len(w) > 1 for w in self.bad_words)

    @property
    def hash_root(self) -> bytes:
        """The parent of its first block's hash: blocks are shared only under one salt and one adapter. No
        salt's UTF-8 holds the byte 0xff, so none can pass for an adapter's."""
        salt = self.cache_salt.encode()
        return salt if self.lora is None else b"\xfflora %d\xff" % self.lora.lora_int_id + salt

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def banned_ids(self) -> list[int]:
        produced = self.num_output_tokens + self.num_pending
        banned = self.min_tokens_banned if produced < self.params.min_tokens else []
        if self.bad_words:
            # A word's prefix is matched against tokens on the host: the engine lands them first.
            assert self.num_pending == 0 or not self.reads_output, "a bad word's prefix needs its tokens"
            banned = banned + banned_next(self.bad_words, self.token_ids, self.num_prompt_tokens)
        return banned

    @property
    def reads_output(self) -> bool:
        """Its next sampling reads its last tokens on the host: a grammar's state, a bad word's prefix,
        whether its thinking has ended."""
        return (
            self.bad_prefixes
            or (self.grammar is not None and self.grammar.active)
            or (self.thinking is not None and not self.thinking.answering)
        )

    @property
    def constrained(self) -> bool:
        """Its grammar constrains this step's token (not its thinking, unless the grammar covers it)."""
        t = self.thinking
        return (
            self.grammar is not None
            and self.grammar.active
            and (t is None or t.answering or t.opener is not None)
        )

    @property
    def drafts_ok(self) -> bool:
        """Its next tokens may be drafted and checked in one step: its sampling reads no state on the host
        that the drafts before a token would change (a grammar's, its thinking's, a bad word's prefix,
        min_tokens' bans). The penalties' counts take them on the device."""
        return (
            self.grammar is None
            and self.thinking is None
            and not self.bad_prefixes
            and self.num_output_tokens >= self.params.min_tokens
        )

    @property
    def ends_by_length(self) -> bool:
        """Its pending token is its last: the step that would read it is not needed."""
        return self.num_pending > 0 and self.num_output_tokens + self.num_pending >= self.max_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
