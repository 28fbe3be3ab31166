"""A reasoning model's thinking on CUDA (kiln.engine.thinking): a budget forces </think> through the
sampler's keep_only in CUDA-graph decode steps, the grammar then holds the answer, beside a free row, and
nothing in a step synchronizes the stream."""

import re
from pathlib import Path

import torch

from kiln import LLM, SamplingParams
from kiln.sampling_params import StructuredOutputsParams
from tests.models.tiny import build_default_vocab

DATE = r"\d{4}-\d{2}-\d{2}"


def test_a_budget_then_a_grammar_beside_a_free_row(tmp_path: Path, default_model_dir: Path) -> None:
    # Head dim 64 (FlashInfer's); SmolLM2's vocabulary writes </think> as three tokens.
    model = build_default_vocab(tmp_path, default_model_dir, hidden_size=256)
    llm = LLM(str(model), dtype="bfloat16", device="cuda", mode="cudagraph", kv_cache_gib=0.05,
              max_num_seqs=16, reasoning_parser="deepseek_r1")  # fmt: skip
    close = list(llm.engine.admission.think_tags.close)  # type: ignore[union-attr]
    free = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    so = StructuredOutputsParams(regex=DATE)
    held = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=40, thinking_token_budget=4, structured_outputs=so)
        for s in range(4)
    ]
    llm.generate(["a b c"] * 5, [free, *held], use_tqdm=False)  # the grammar compiled
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = llm.generate(["a b c"] * 5, [free, *held], use_tqdm=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(outs[0].outputs[0].token_ids) == 16  # the free row runs on, unforced and unmasked
    tok = llm.get_tokenizer()
    for out in outs[1:]:
        got = out.outputs[0]
        assert got.token_ids[4:7] == close and got.finish_reason == "stop"
        assert re.fullmatch(DATE, tok.decode(got.token_ids[7:], skip_special_tokens=True))
