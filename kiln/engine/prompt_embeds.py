"""Prompts given as input embeddings (vLLM's prompt_embeds): one row per position, written over the token
embedding of that position. A client's payload is unpickled where the request arrives (weights only: no code
runs), checked on the event loop by its metadata alone, and cast to the model's dtype on the engine thread,
which does all of kiln's torch compute."""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from kiln.sampling_params import truncate_prompt


@dataclass(frozen=True, slots=True)
class PromptEmbeds:
    tensor: torch.Tensor  # (tokens, hidden_size), or (1, tokens, hidden_size): a batch of one
    kept: range | None = None  # the rows a truncation keeps (None: all), sliced on the engine thread

    @classmethod
    def decode(cls, payload: bytes) -> PromptEmbeds:
        """A torch.save'd tensor (the API's base64, decoded). ValueError names what is wrong."""
        # A sparse tensor's indices are checked as it loads, so none can point outside its values.
        with torch.sparse.check_sparse_tensor_invariants():
            try:
                tensor = torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
            except Exception as e:  # torch.load's errors: pickle's, zipfile's, the weights-only unpickler's
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise ValueError(f"`prompt_embeds` is not a tensor saved by torch.save: {first}") from None
        if not isinstance(tensor, torch.Tensor):
            raise ValueError("`prompt_embeds` payload did not deserialize to a torch.Tensor.")
        return cls(tensor)

    @property
    def shape(self) -> tuple[int, int]:
        """(tokens, hidden_size) of the whole tensor, a batch of one's dim dropped; ValueError for any
        other shape."""
        shape = tuple(self.tensor.shape)
        if len(shape) == 3 and shape[0] == 1:
            shape = shape[1:]
        if len(shape) != 2:
            raise ValueError(
                "`prompt_embeds` must be a 2D tensor of shape (num_tokens, hidden_size); "
                f"got shape {tuple(self.tensor.shape)}."
            )
        return shape  # type: ignore[return-value]

    @property
    def rows_kept(self) -> range:
        return range(self.shape[0]) if self.kept is None else self.kept

    def __len__(self) -> int:
        return len(self.rows_kept)

    @property
    def ids(self) -> list[int]:
        """The request's token ids: a placeholder (0) for each kept row."""
        return [0] * len(self)

    def check(self, hidden_size: int) -> None:
        """What can be told without reading the values (so on the event loop)."""
        width = self.shape[1]
        if width != hidden_size:
            raise ValueError(
                f"`prompt_embeds` hidden_size {width} does not match the model's hidden_size {hidden_size}."
            )
        if not self.tensor.is_floating_point():
            raise ValueError(
                f"`prompt_embeds` dtype {self.tensor.dtype} is not a floating-point type, cannot safely cast "
                "to the model's dtype."
            )

    def truncated(
        self, keep: int | None, max_tokens: int | None, max_model_len: int, side: Literal["left", "right"]
    ) -> PromptEmbeds:
        """The rows truncate_prompt_tokens keeps, as for token ids (kiln.sampling_params.truncate_prompt)."""
        kept = truncate_prompt(list(self.rows_kept), keep, max_tokens, max_model_len, side)
        return self if not kept else PromptEmbeds(self.tensor, range(kept[0], kept[-1] + 1))

    def rows(self, dtype: torch.dtype) -> torch.Tensor:
        """The kept rows, dense and contiguous in the model's dtype (the engine thread's work)."""
        tensor = self.tensor.to_dense() if self.tensor.layout != torch.strided else self.tensor
        kept = self.rows_kept
        return tensor.reshape(self.shape)[kept.start : kept.stop].to(dtype).contiguous()


# vLLM's: a chat content part {"type": "prompt_embeds", "data": ...} stands in the rendered template as this
# text, where the prompt is split; the tokenizer never sees it.
PLACEHOLDER = "<prompt_embeds>"


@dataclass(frozen=True, slots=True)
class SplicedEmbeds:
    """A chat prompt with prompt_embeds content parts (vLLM's): the template's token ids, and each part's
    rows where its placeholder stood. The engine thread looks the ids' rows up in the model's own
    embedding, so the whole prompt runs as given rows."""

    token_ids: list[int]  # placeholders (0) at the parts' rows
    parts: tuple[tuple[int, PromptEmbeds], ...]  # (its first row, the part)
    kept: range | None = None  # the rows a truncation keeps (None: all)

    @property
    def rows_kept(self) -> range:
        return range(len(self.token_ids)) if self.kept is None else self.kept

    def __len__(self) -> int:
        return len(self.rows_kept)

    @property
    def ids(self) -> list[int]:
        kept = self.rows_kept
        return self.token_ids[kept.start : kept.stop]

    def check(self, hidden_size: int) -> None:
        for _, part in self.parts:
            part.check(hidden_size)

    def truncated(
        self, keep: int | None, max_tokens: int | None, max_model_len: int, side: Literal["left", "right"]
    ) -> SplicedEmbeds:
        kept = truncate_prompt(list(self.rows_kept), keep, max_tokens, max_model_len, side)
        return self if not kept else SplicedEmbeds(self.token_ids, self.parts, range(kept[0], kept[-1] + 1))

    def rows(
        self, dtype: torch.dtype, embed: Callable[[torch.Tensor], torch.Tensor], device: torch.device
    ) -> torch.Tensor:
        """The kept rows in the model's dtype, on the host: the model's embedding of each id, with the parts'
        rows over their placeholders (the engine thread's work)."""
        with torch.no_grad():
            rows = embed(torch.tensor(self.token_ids, device=device)).to("cpu", dtype)
        for start, part in self.parts:
            rows[start : start + len(part)] = part.rows(dtype)
        kept = self.rows_kept
        return rows[kept.start : kept.stop].contiguous()


GivenPrompt = PromptEmbeds | SplicedEmbeds  # a prompt whose rows (some or all) are given as embeddings
