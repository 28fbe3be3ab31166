"""Engine configuration: msgspec Structs, one per concern. YAML files and CLI flags decode into these."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from kiln.config_section import Section
from kiln.speculative_config import SpeculativeConfig

MaxLoraRank = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512]  # vLLM's choices
LogprobsMode = Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
# vLLM's --kv-cache-dtype names kiln stores: auto is the model's dtype; fp8 is e4m3, as on CUDA.
KvCacheDtype = Literal["auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"]


class PoolerConfig(Section):
    """vLLM's --pooler-config: how an embedding is made of the final hidden states (null: the model
    folder's sentence-transformers modules, else LAST, normalized)."""

    pooling_type: Literal["LAST", "MEAN", "CLS"] | None = None
    use_activation: bool | None = None  # scaled to unit length
    dimensions: Annotated[int, Meta(ge=1)] | None = None  # a Matryoshka model's default embedding size


class StructuredOutputsConfig(Section):
    """vLLM's --structured-outputs-config. kiln's one backend is xgrammar (auto picks it)."""

    backend: Literal["auto", "xgrammar"] = "auto"
    disable_any_whitespace: bool = False  # every JSON constraint compact, as a request's own field makes it
    # guidance's: xgrammar's JSON already follows additionalProperties, so it changes nothing, as in vLLM
    disable_additional_properties: bool = False
    enable_in_reasoning: bool = False  # constraints cover the <think> text too


class ModelConfig(Section):
    model: str = "default"  # a model folder, or "default" for the embedded SmolLM2-135M-Instruct
    tokenizer: str | None = None  # defaults to the model folder
    chat_template: str | None = None  # a Jinja file, or the template itself, in place of the tokenizer's
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len: Annotated[int, Meta(ge=2)] | None = None  # defaults to the model's max_position_embeddings
    seed: int = 0
    device: str = "auto"  # auto: the GPU where there is one, else the CPU
    # vLLM's: where the sampling defaults of a request that leaves a field unset come from. auto: the model
    # folder's generation_config.json (its temperature, top_p, top_k, min_p, penalties, max_new_tokens as
    # max_tokens); vllm: none (OpenAI's defaults); else a folder holding a generation_config.json.
    generation_config: str = "auto"
    # vLLM's: the most logprobs (and prompt_logprobs) a request may ask for; -1: the whole vocabulary.
    max_logprobs: Annotated[int, Meta(ge=-1)] = 20
    override_generation_config: dict[str, Any] | None = None  # laid over it, e.g. {"temperature": 0.5}
    # A reasoning model's <think> ... </think> (vLLM's --reasoning-parser): chat replies give it as
    # `reasoning`, structured outputs constrain only the answer after it, and a request's
    # thinking_token_budget can end it.
    reasoning_parser: Literal["deepseek_r1", "qwen3"] | None = None
    structured_outputs_config: StructuredOutputsConfig = msgspec.field(
        default_factory=StructuredOutputsConfig
    )
    # vLLM's --runner: generate (text), or pooling (embeddings, /v1/embeddings); auto: pooling for a
    # sentence-transformers folder with a Pooling module, else generate.
    runner: Literal["auto", "generate", "pooling"] = "auto"
    convert: Literal["auto", "none", "embed"] = "auto"  # vLLM's --convert: embed serves a causal LM pooled
    pooler_config: PoolerConfig | None = None
    # vLLM's --load-format: auto and safetensors read the folder's safetensors; dummy reads no weights and
    # draws them at random (a config.json and a tokenizer suffice: for measuring speed).
    load_format: Literal["auto", "safetensors", "dummy"] = "auto"
    # vLLM's --hf-overrides: laid over config.json's top-level keys, e.g. {"max_position_embeddings": 4096}.
    hf_overrides: dict[str, Any] | None = None
    # vLLM's --logprobs-mode: raw_* the model's own (a grammar's mask applied), processed_* after penalties,
    # bias, bans, temperature, min-p, top-k and top-p (what the draw saw, -inf where cut); *_logits the
    # values before log-softmax. Prompt logprobs: raw or processed alike.
    logprobs_mode: LogprobsMode = "raw_logprobs"
    # vLLM's --enable-prompt-embeds: /v1/completions and LLM.generate take a prompt as its input embeddings
    # (a base64 torch.save of a (tokens, hidden_size) tensor; {"prompt_embeds": tensor}). Off by default, as
    # vLLM: torch.load is then run on what clients send (weights_only).
    enable_prompt_embeds: bool = False
    # vLLM's --skip-tokenizer-init: no tokenizer is loaded (a model folder needs none). Prompts are token ids
    # (or embeddings), outputs token ids with empty text; whatever needs text (chat, text prompts, stop
    # strings, bad words, structured outputs, a reasoning parser) is refused.
    skip_tokenizer_init: bool = False
    # vLLM's --disable-sliding-window: a sliding-window model attends to its whole context, which is then no
    # longer than the window (within it the two agree). Changes nothing for a model without one.
    disable_sliding_window: bool = False

    def __post_init__(self) -> None:
        if self.skip_tokenizer_init and self.reasoning_parser is not None:
            raise ValueError(
                "model.reasoning_parser finds the reasoning's tags with the tokenizer, which "
                "model.skip_tokenizer_init leaves out"
            )


class CacheConfig(Section):
    # null: 32 on a CPU (kiln's AMX attention takes 32 keys of a block per value tile multiply; vLLM's CPU
    # backend asks for multiples of 32 too), 16 on a GPU.
    block_size: Annotated[int, Meta(ge=1)] | None = None
    # null: on a GPU, sized from gpu_memory_utilization; on a CPU, 1 GiB. Set, it wins over both.
    kv_cache_gib: Annotated[float, Meta(gt=0)] | None = None
    enable_prefix_caching: bool = True
    # The share of the GPU's memory kiln may use (null: 0.9, as vLLM); the KV cache gets what the weights,
    # the largest step and the CUDA graphs leave of it.
    gpu_memory_utilization: Annotated[float, Meta(gt=0, le=1)] | None = None
    # vLLM's: exactly this many KV blocks, whatever the memory settings say (for testing preemption).
    num_gpu_blocks_override: Annotated[int, Meta(ge=1)] | None = None
    # What the cache stores K and V as. fp8 halves a 16-bit cache (a quarter of a float32 one), so it holds
    # twice the tokens; K and V are stored with a scale of 1.0 (vLLM's where a checkpoint gives none),
    # saturating, and read back widened.
    kv_cache_dtype: KvCacheDtype = "auto"

    def on(self, device_type: str) -> CacheConfig:
        """This section with its block size decided for the device."""
        if self.block_size is not None:
            return self
        return msgspec.structs.replace(self, block_size=32 if device_type == "cpu" else 16)


class SchedulerConfig(Section):
    # null: vLLM's server defaults for the device (`on`). vLLM's offline LLM takes more tokens on a GPU (16384
    # on the large ones, 8192 on others); kiln's LLM takes the server's.
    max_num_seqs: Annotated[int, Meta(ge=1)] | None = None
    max_num_batched_tokens: Annotated[int, Meta(ge=1)] | None = None
    # vLLM's chunked-prefill fairness knob: a step gives each prompt with more than this many tokens left
    # this many (kiln hands the long prompts' share out oldest first), so a short prompt that arrives while
    # a long one is chunked starts in the next step, beside the long one's chunk. null: on the CPU, where a
    # long prompt's late chunks cost most (BENCHMARKS.md, fairness), 128, or 1024 where kiln's kernels
    # multiply on AMX tiles (a chunk costs a fraction as much there); no limit on a GPU, as vLLM's
    # default; 0: no limit.
    long_prefill_token_threshold: Annotated[int, Meta(ge=0)] | None = None
    # vLLM's async scheduling: the next step is scheduled and launched while the device still runs this one,
    # its decode inputs taken from the sampled tokens on the device; a stop is then seen one step late, and
    # that step's token for the stopped request is dropped. null: on CUDA, where it hides the step's host
    # work behind the GPU; off on the CPU, where the host is the device and there is nothing to hide.
    async_scheduling: bool | None = None
    # vLLM's scheduling policy. fcfs: requests in arrival order, the newest preempted first. priority: by
    # each request's `priority` (smaller first), then arrival; the least urgent running request is
    # preempted first. Under fcfs a request that sets a priority is refused.
    policy: Literal["fcfs", "priority"] = "fcfs"
    # vLLM's capacity valves, checked as a request arrives: a 503 when the sequences in flight (waiting or
    # running; a request takes n) would exceed max_num_queued_reqs, or when the prompt tokens of requests
    # not yet past prefill already reach max_num_queued_tokens. null: no limit.
    max_num_queued_reqs: Annotated[int, Meta(ge=0)] | None = None
    max_num_queued_tokens: Annotated[int, Meta(ge=0)] | None = None
    # vLLM's: false prefills each prompt in one step (long_prefill_token_threshold, if set, still splits it),
    # and a prompt waits while the step has too few tokens left for it; max_num_batched_tokens must then
    # hold max_model_len, which is its default.
    enable_chunked_prefill: bool = True
    # vLLM's --speculative-config (n-gram prompt lookup): drafts checked in one step. null: off.
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.speculative_config is not None and self.async_scheduling:
            raise ValueError(
                "async_scheduling with speculative_config is not supported: drafts are looked up in the "
                "tokens the last step landed"
            )

    def on(
        self, device_type: str, gpu_memory: int = 0, gpu_name: str = "", max_model_len: int = 0
    ) -> SchedulerConfig:
        """This section with its batch limits decided for the device: on a GPU of 70 GiB or more other than
        an A100 (vLLM found an A100 slower with more tokens), 1024 sequences and 8192 tokens a step; on other
        GPUs 256 and 2048; on a CPU 128 and 2048. Without chunked prefill, at least max_model_len tokens."""
        if device_type == "cpu":
            seqs, tokens = 128, 2048
        elif gpu_memory >= 70 * 2**30 and "a100" not in gpu_name.lower():
            seqs, tokens = 1024, 8192
        else:
            seqs, tokens = 256, 2048
        if not self.enable_chunked_prefill:
            tokens = max(tokens, max_model_len)
            given = self.max_num_batched_tokens
            if given is not None and given < max_model_len:
                raise ValueError(
                    f"max_num_batched_tokens ({given}) is smaller than max_model_len ({max_model_len}). "
                    "This effectively limits the maximum sequence length to max_num_batched_tokens and makes "
                    "kiln reject longer sequences. Please increase max_num_batched_tokens or decrease "
                    "max_model_len."
                )
        return msgspec.structs.replace(
            self,
            max_num_seqs=self.max_num_seqs or seqs,
            max_num_batched_tokens=self.max_num_batched_tokens or tokens,
        )

    def use_async(self, device_type: str) -> bool:
        if self.async_scheduling is None:
            return device_type == "cuda" and self.speculative_config is None
        return self.async_scheduling

    def prefill_chunk(self, device_type: str, tiles: bool = False) -> int:
        """The most tokens one request prefills in a step; tiles: the CPU kernels run on AMX tiles."""
        threshold = self.long_prefill_token_threshold
        if threshold is None:
            cpu = (1024 if tiles else 128) if self.enable_chunked_prefill else 0
            threshold = cpu if device_type == "cpu" else 0
        return threshold or self.max_num_batched_tokens


class ParallelConfig(Section):
    tensor_parallel_size: Annotated[int, Meta(ge=1)] = 1
    pipeline_parallel_size: Annotated[int, Meta(ge=1)] = 1
    data_parallel_size: Annotated[int, Meta(ge=1)] = 1


class LoraConfig(Section):
    """vLLM's LoRA options: with enable_lora, every attention and dense MLP projection has max_loras adapter
    slots of rank max_lora_rank (the most adapters one step runs, and the largest rank served)."""

    enable_lora: bool = False
    max_loras: Annotated[int, Meta(ge=1)] = 1
    max_lora_rank: MaxLoraRank = 16
    max_cpu_loras: Annotated[int, Meta(ge=1)] | None = None  # adapters kept on the host (null: max_loras)
    # The adapters' precision: their weights are rounded to it (auto: as read); the slots keep them in the
    # activations' dtype.
    lora_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    fully_sharded_loras: bool = False  # a tensor-parallel layout: one device has nothing to shard

    def __post_init__(self) -> None:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")


class CompileConfig(Section):
    # auto: cudagraph on CUDA (compiled layers, decode steps replayed as CUDA graphs), compiled on a CPU.
    mode: Literal["auto", "eager", "compiled", "cudagraph"] = "auto"
    # Batch sizes decode steps are padded to, each a CUDA graph on a GPU (null: vLLM's, 1, 2, 4, then steps of
    # 8 to 256 and of 16 to 512, up to max_num_seqs and max_num_batched_tokens); a larger decode runs the
    # compiled graph without one. None may exceed either limit: no decode step is that large.
    decode_sizes: list[Annotated[int, Meta(ge=1)]] | None = None
    # Token counts mixed and prefill steps are padded to (null: powers of two up to max_num_batched_tokens,
    # which none may exceed).
    token_sizes: list[Annotated[int, Meta(ge=2)]] | None = None
    # vLLM's max_cudagraph_capture_size: the largest default decode size (null: 512). With decode_sizes
    # set, it must be their largest.
    max_decode_size: Annotated[int, Meta(ge=1)] | None = None
    cache_file: str | None = None  # a `kiln warmup --export` file to install before warming up


class BackendConfig(Section):
    # auto: Triton kernels and FlashInfer on CUDA when they import; on a CPU, kiln's C++ kernels (linear
    # layers and paged attention, batch-invariant); the torch references otherwise.
    kernels: Literal["auto", "torch", "triton", "cpu"] = "auto"
    attention: Literal["auto", "torch", "flashinfer", "cpu"] = "auto"
    sampler: Literal["auto", "torch", "flashinfer"] = "auto"
    # CUDA: batch-invariant kernels (a Triton GEMM of one tile shape, FlashInfer attention without split-KV),
    # so a request's output does not depend on its batch, the prefix cache or chunked prefill; slower. The
    # CPU backend is deterministic regardless.
    deterministic: bool = False
    # CPU: the CPUs the engine's OpenMP threads are pinned to, one each (vLLM's VLLM_CPU_OMP_THREADS_BIND):
    # "auto" pins the server's engine thread one per physical core (LLM offline: not at all, as pinning the
    # caller's thread pins whatever it starts later), a list such as "0-3,8" pins wherever the engine runs,
    # with that many threads, and "nobind" never pins.
    cpu_threads_bind: Annotated[str, Meta(pattern=r"^(auto|nobind|\d+(-\d+)?(,\d+(-\d+)?)*)$")] = "auto"


class EngineConfig(Section):
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    compile: CompileConfig = msgspec.field(default_factory=CompileConfig)
    parallel: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    backend: BackendConfig = msgspec.field(default_factory=BackendConfig)
    lora: LoraConfig = msgspec.field(default_factory=LoraConfig)

    def check_supported(self) -> None:
        """Knobs kept for vLLM compatibility but not built yet fail loudly rather than being ignored."""
        p = self.parallel
        for key, size in [("tensor", p.tensor_parallel_size), ("pipeline", p.pipeline_parallel_size),
                          ("data", p.data_parallel_size)]:  # fmt: skip
            if size != 1:
                raise ValueError(f"{key}_parallel_size > 1 is not supported yet: kiln runs on one device")

    @classmethod
    def from_options(cls, model: str = "default", **options: Any) -> EngineConfig:
        """Flat keyword options (vLLM's LLM(...) style) placed into their sections by field name.
        `enforce_eager=True` is vLLM's spelling of compile mode "eager", `scheduling_policy` its name for
        scheduler.policy."""
        if options.pop("enforce_eager", False):
            options["mode"] = "eager"
        if "scheduling_policy" in options:
            options["policy"] = options.pop("scheduling_policy")
        sections: dict[str, dict[str, Any]] = {"model": {"model": model}}
        for key, value in options.items():
            section = next((s for s, t in _SECTIONS.items() if key in t.__struct_fields__), None)
            if section is None:
                raise TypeError(f"unknown engine option {key!r}")
            sections.setdefault(section, {})[key] = value
        return msgspec.convert(sections, cls)


_SECTIONS: dict[str, type[Section]] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "compile": CompileConfig,
    "parallel": ParallelConfig,
    "backend": BackendConfig,
    "lora": LoraConfig,
}
