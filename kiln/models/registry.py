"""The supported architectures, keyed on config.json's `architectures`."""

from dataclasses import replace
from typing import Any

from kiln.models.spec import ArchSpec, ModelDims, WeightRule

R = WeightRule
_L = "model.layers.{i}."


def _rope(c: Any) -> tuple[float, dict | None]:
    params = getattr(c, "rope_parameters", None)  # transformers >= 5
    if params:
        return float(params["rope_theta"]), dict(params)
    scaling = dict(getattr(c, "rope_scaling", None) or {}) or None
    if scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.get("type", "default")
    return float(getattr(c, "rope_theta", 10000.0)), scaling


def llama_dims(c: Any, **overrides: Any) -> ModelDims:
    if c.hidden_act != "silu":
        raise NotImplementedError(f"hidden_act {c.hidden_act!r}: gated MLPs support only 'silu'")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    theta, scaling = _rope(c)
    bias = bool(getattr(c, "attention_bias", False))
    fields: dict[str, Any] = dict(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        num_layers=c.num_hidden_layers,
        num_heads=c.num_attention_heads,
        num_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
        head_dim=head_dim,
        intermediate_size=c.intermediate_size,
        norm_eps=c.rms_norm_eps,
        max_positions=c.max_position_embeddings,
        tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bool(getattr(c, "mlp_bias", False)),
        rope_theta=theta,
        rope_scaling=scaling,
        rotary_dim=int(head_dim * getattr(c, "partial_rotary_factor", 1.0)),
        sliding_window=getattr(c, "sliding_window", None) or 0,
    )
    return ModelDims(**(fields | overrides))


def qwen2_dims(c: Any) -> ModelDims:
    window = c.sliding_window if getattr(c, "use_sliding_window", False) else 0
    return llama_dims(c, qkv_bias=True, o_bias=False, sliding_window=window or 0)


def qwen3_dims(c: Any) -> ModelDims:
    window = c.sliding_window if getattr(c, "use_sliding_window", False) else 0
    return llama_dims(c, qk_norm=True, sliding_window=window or 0)


def mixtral_dims(c: Any) -> ModelDims:
    return llama_dims(
        c,
        num_experts=c.num_local_experts,
        experts_per_token=c.num_experts_per_tok,
        moe_intermediate_size=c.intermediate_size,
        moe_renormalize=True,
        moe_layers=(True,) * c.num_hidden_layers,
    )


def qwen3_moe_dims(c: Any) -> ModelDims:
    dense = set(getattr(c, "mlp_only_layers", None) or [])
    step = getattr(c, "decoder_sparse_step", 1) or 1
    return replace(
        qwen3_dims(c),
        num_experts=c.num_experts,
        experts_per_token=c.num_experts_per_tok,
        moe_intermediate_size=c.moe_intermediate_size,
        moe_renormalize=bool(c.norm_topk_prob),
        moe_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(c.num_hidden_layers)),
    )


def gpt2_dims(c: Any) -> ModelDims:
    if getattr(c, "scale_attn_by_inverse_layer_idx", False):
        raise NotImplementedError("GPT-2 with scale_attn_by_inverse_layer_idx is not supported")
    return ModelDims(
        vocab_size=c.vocab_size,
        hidden_size=c.n_embd,
        num_layers=c.n_layer,
        num_heads=c.n_head,
        num_kv_heads=c.n_head,
        head_dim=c.n_embd // c.n_head,
        intermediate_size=c.n_inner or 4 * c.n_embd,
        norm_eps=c.layer_norm_epsilon,
        max_positions=c.n_positions,
        tie_word_embeddings=True,
        hidden_act=c.activation_function,
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
    )


def _common(norm_names: tuple[str, str]) -> tuple[WeightRule, ...]:
    attn_norm, mlp_norm = norm_names
    return (
        R("model.embed_tokens.weight", "embed.weight"),
        R(_L + f"{attn_norm}.weight", "layers.{i}.attn_norm.weight"),
        R(_L + f"{mlp_norm}.weight", "layers.{i}.mlp_norm.weight"),
        R("model.norm.weight", "norm.weight"),
        R("lm_head.weight", "lm_head.weight", when="untied"),
    )


def _attention() -> tuple[WeightRule, ...]:
    a = _L + "self_attn."
    rules = [R(a + f"{p}_proj.weight", "layers.{i}.attn.qkv.weight", p) for p in "qkv"]
    rules += [R(a + f"{p}_proj.bias", "layers.{i}.attn.qkv.bias", p, when="qkv_bias") for p in "qkv"]
    rules += [
        R(a + "o_proj.weight", "layers.{i}.attn.o.weight"),
        R(a + "o_proj.bias", "layers.{i}.attn.o.bias", when="o_bias"),
        R(a + "q_norm.weight", "layers.{i}.attn.q_norm.weight", when="qk_norm"),
        R(a + "k_norm.weight", "layers.{i}.attn.k_norm.weight", when="qk_norm"),
    ]
    return tuple(rules)


def _gated_mlp() -> tuple[WeightRule, ...]:
    m, d = _L + "mlp.", "dense"
    rules = [
        R(m + "gate_proj.weight", "layers.{i}.mlp.gate_up.weight", "gate", layers=d),
        R(m + "up_proj.weight", "layers.{i}.mlp.gate_up.weight", "up", layers=d),
        R(m + "down_proj.weight", "layers.{i}.mlp.down.weight", layers=d),
    ]
    rules += [
        R(m + "gate_proj.bias", "layers.{i}.mlp.gate_up.bias", "gate", when="mlp_bias", layers=d),
        R(m + "up_proj.bias", "layers.{i}.mlp.gate_up.bias", "up", when="mlp_bias", layers=d),
        R(m + "down_proj.bias", "layers.{i}.mlp.down.bias", when="mlp_bias", layers=d),
    ]
    return tuple(rules)


def _experts(block: str, router: str, gate: str, up: str, down: str) -> tuple[WeightRule, ...]:
    b, x = _L + block + ".", _L + block + ".experts.{e}."
    return (
        R(b + f"{router}.weight", "layers.{i}.mlp.router.weight", layers="moe"),
        R(x + f"{gate}.weight", "layers.{i}.mlp.w13", "gate", layers="moe"),
        R(x + f"{up}.weight", "layers.{i}.mlp.w13", "up", layers="moe"),
        R(x + f"{down}.weight", "layers.{i}.mlp.w2", layers="moe"),
    )


_DENSE = _common(("input_layernorm", "post_attention_layernorm")) + _attention() + _gated_mlp()
_ROTARY_BUFFERS = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)


def _llama_like(name: str, dims: Any, rules: tuple[WeightRule, ...] = _DENSE) -> ArchSpec:
    return ArchSpec(name, "rms", "rope", "gated", rules, dims, ignore=_ROTARY_BUFFERS)


def _headless(name: str, spec: ArchSpec) -> ArchSpec:
    """The backbone alone (`LlamaModel`, ...: how embedding models such as e5-mistral are saved): no LM
    head to load. The engine's warmup and sampler paths still find one, so it is tied to the embedding."""

    def dims(c: Any) -> ModelDims:
        return replace(spec.dims(c), tie_word_embeddings=True)

    return replace(spec, name=name, rules=tuple(r for r in spec.rules if r.when != "untied"), dims=dims)


def _classifier(name: str, spec: ArchSpec) -> ArchSpec:
    """A causal LM with a classification head (`score`: classes x hidden) in place of its LM head, as
    transformers' `*ForSequenceClassification` saves it; served for /classify. The engine's warmup and
    sampler paths still find an LM head, so one is tied to the embedding."""

    def dims(c: Any) -> ModelDims:
        return replace(spec.dims(c), tie_word_embeddings=True, num_labels=c.num_labels)

    rules = (*(r for r in spec.rules if r.when != "untied"), R("score.weight", "score"))
    return replace(spec, name=name, rules=rules, dims=dims)


_GPT2_RULES = tuple(
    [
        R("wte.weight", "embed.weight"),
        R("wpe.weight", "pos_embed.weight"),
        R("ln_f.weight", "norm.weight"),
        R("ln_f.bias", "norm.bias"),
    ]
    + [
        R(
            f"h.{{i}}.{src}.{kind}",
            f"layers.{{i}}.{dst}.{kind}",
            transpose=kind == "weight" and "ln" not in src,
        )
        for src, dst in [
            ("ln_1", "attn_norm"),
            ("attn.c_attn", "attn.qkv"),
            ("attn.c_proj", "attn.o"),
            ("ln_2", "mlp_norm"),
            ("mlp.c_fc", "mlp.fc"),
            ("mlp.c_proj", "mlp.proj"),
        ]
        for kind in ("weight", "bias")
    ]
)

ARCHITECTURES: dict[str, ArchSpec] = {
    "LlamaForCausalLM": _llama_like("LlamaForCausalLM", llama_dims),
    "MistralForCausalLM": _llama_like("MistralForCausalLM", llama_dims),
    "Qwen2ForCausalLM": _llama_like("Qwen2ForCausalLM", qwen2_dims),
    "Qwen3ForCausalLM": _llama_like("Qwen3ForCausalLM", qwen3_dims),
    "MixtralForCausalLM": _llama_like(
        "MixtralForCausalLM",
        mixtral_dims,
        _DENSE + _experts("block_sparse_moe", "gate", "w1", "w3", "w2"),
    ),
    "Qwen3MoeForCausalLM": _llama_like(
        "Qwen3MoeForCausalLM",
        qwen3_moe_dims,
        _DENSE + _experts("mlp", "gate", "gate_proj", "up_proj", "down_proj"),
    ),
    "LlamaModel": _headless("LlamaModel", _llama_like("LlamaModel", llama_dims)),
    "MistralModel": _headless("MistralModel", _llama_like("MistralModel", llama_dims)),
    "Qwen2Model": _headless("Qwen2Model", _llama_like("Qwen2Model", qwen2_dims)),
    "Qwen3Model": _headless("Qwen3Model", _llama_like("Qwen3Model", qwen3_dims)),
    **{
        f"{arch}ForSequenceClassification": _classifier(
            f"{arch}ForSequenceClassification", _llama_like(f"{arch}ForSequenceClassification", dims)
        )
        for arch, dims in (
            ("Llama", llama_dims),
            ("Mistral", llama_dims),
            ("Qwen2", qwen2_dims),
            ("Qwen3", qwen3_dims),
        )
    },
    "GPT2LMHeadModel": ArchSpec(
        "GPT2LMHeadModel",
        "layer",
        "learned",
        "plain",
        _GPT2_RULES,
        gpt2_dims,
        ignore=(r"h\.\d+\.attn\.(masked_)?bias", "lm_head.weight"),
        strip_prefix="transformer.",
    ),
}


class UnsupportedArchitecture(ValueError):
    pass


def headless(spec: ArchSpec) -> bool:
    """A backbone saved without its head: served for embeddings (vLLM's default runner for `*Model`)."""
    return spec.name.endswith("Model") and not spec.name.endswith("LMHeadModel")


def spec_for(architectures: list[str] | None) -> ArchSpec:
    for arch in architectures or []:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    raise UnsupportedArchitecture(
        f"unsupported architecture {architectures!r}; kiln supports: {', '.join(sorted(ARCHITECTURES))}"
    )
