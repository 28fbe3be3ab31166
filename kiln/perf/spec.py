"""A sweep spec (configs/perf/*.yaml): what prompts, which loads, which SLOs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import yaml
from msgspec import Meta

from kiln.config_file import ConfigError, validation_message

Ratio = Annotated[float, Meta(ge=0, lt=1)]


class SLO(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A request counts toward goodput when it meets every bound given (milliseconds)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None


class Spec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str = "sweep"
    # "random": token-id prompts of exactly input_len tokens; "builtin": the prompts shipped with kiln;
    # anything else: a JSONL file of {"prompt": "..."} lines.
    dataset: str = "random"
    # (input, output) token lengths; a point per pair and load
    lengths: list[tuple[Annotated[int, Meta(ge=1)], Annotated[int, Meta(ge=1)]]] = msgspec.field(
        default_factory=lambda: [(128, 128)]
    )
    concurrency: list[Annotated[int, Meta(ge=1)]] | None = None
    request_rate: list[Annotated[float, Meta(gt=0)]] | None = None  # requests/s; Poisson arrivals
    burstiness: Annotated[float, Meta(gt=0)] = 1.0  # gamma shape of inter-arrival times; 1 is Poisson
    max_concurrency: Annotated[int, Meta(ge=1)] | None = None  # cap in request-rate mode
    num_prompts: Annotated[int, Meta(ge=1)] = 32  # per point; at least the concurrency
    warmup_requests: Annotated[int, Meta(ge=0)] = 2
    temperature: float = 0.0
    ignore_eos: bool = True
    seed: int = 0
    token_id_range: tuple[int, int] = (100, 10000)  # random prompts draw ids from here
    # vLLM's --random-range-ratio, for input and output apart: each request's length is drawn uniformly
    # from [L * (1 - r), L * (1 + r)] around its point's L (the input only for random prompts).
    range_ratio: tuple[Ratio, Ratio] = (0.0, 0.0)
    slo: SLO = msgspec.field(default_factory=SLO)
    # The API each request goes to, streamed: /v1/completions, /v1/chat/completions, or Anthropic's
    # /v1/messages (chat and messages send a text prompt as one user message; messages has no ignore_eos,
    # so its replies end where the model ends them).
    mode: Literal["completions", "chat", "messages"] = "completions"
    # Fields added to every request body as they are (e.g. response_format); over HTTP only.
    extra_body: dict[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.request_rate is None):
            raise ValueError("give exactly one of concurrency and request_rate")
        if self.mode != "completions" and self.dataset == "random":
            raise ValueError(f"mode {self.mode} sends text: give a text dataset (builtin, or a JSONL file)")

    def loads(self) -> list[tuple[str, float]]:
        """The sweep's load axis: ("concurrency", c) or ("request_rate", r) points."""
        if self.concurrency is not None:
            return [("concurrency", float(c)) for c in self.concurrency]
        return [("request_rate", r) for r in self.request_rate or []]


def load_spec(path: Path) -> Spec:
    try:
        raw = yaml.safe_load(path.read_text()) or {}
        return msgspec.convert(raw, Spec)
    except OSError as e:
        raise ConfigError(f"cannot read spec {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    except msgspec.ValidationError as e:
        raise ConfigError(f"{path}: {validation_message(e)}") from None
