import torch
import triton
import triton.language as tl

from kiln.ops.sampling_metadata import SamplingMetadata
from kiln.ops.triton import launch, op


@triton.jit
def _sampling_prep(
    logits_ptr, temp_ptr, rep_ptr, freq_ptr, pres_ptr, prompt_ptr, counts_ptr,
    bias_indptr, bias_ids, bias_vals, ban_indptr, ban_ids, vocab, prompt_row, counts_row,
    HAS_PENALTIES: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_BANNED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One program per row, in the reference's order: banned ids, logit bias, penalties, temperature."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * vocab
    if HAS_BANNED:
        for j in range(tl.load(ban_indptr + row), tl.load(ban_indptr + row + 1)):
            tl.store(base + tl.load(ban_ids + j), float("-inf"))
    if HAS_BIAS:
        for j in range(tl.load(bias_indptr + row), tl.load(bias_indptr + row + 1)):
            at = base + tl.load(bias_ids + j)
            tl.store(at, tl.load(at) + tl.load(bias_vals + j))
    # The sparse stores above must land before the dense pass reads them back.
    tl.debug_barrier()
    inv_temp = 1.0 / tl.load(temp_ptr + row)
    if HAS_PENALTIES:
        rep, freq, pres = tl.load(rep_ptr + row), tl.load(freq_ptr + row), tl.load(pres_ptr + row)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < vocab
        x = tl.load(base + cols, mask=mask, other=0.0)
        if HAS_PENALTIES:
            counts = tl.load(counts_ptr + row * counts_row + cols, mask=mask, other=0).to(tl.float32)
            seen = (tl.load(prompt_ptr + row * prompt_row + cols, mask=mask, other=0) != 0) | (counts > 0)
            scale = tl.where(seen, rep, 1.0)
            x = tl.where(x > 0, x / scale, x * scale)
            x -= freq * counts + pres * (counts > 0).to(tl.float32)
        tl.store(base + cols, x * inv_temp, mask=mask)


@op("kiln::sampling_prep_", mutates_args=("logits",))
def sampling_prep_(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    repetition: torch.Tensor | None,
    frequency: torch.Tensor | None,
    presence: torch.Tensor | None,
    prompt_mask: torch.Tensor | None,
    output_counts: torch.Tensor | None,
    bias_indptr: torch.Tensor | None,
    bias_ids: torch.Tensor | None,
    bias_values: torch.Tensor | None,
    banned_indptr: torch.Tensor | None,
    banned_ids: torch.Tensor | None,
) -> None:
    """In place on contiguous fp32 logits [B, V]: per-row tensors [B]; prompt_mask [B, V] uint8 and
    output_counts [B, V] int32 (rows may be strided); bias and banned ids in CSR form (indptr [B + 1])."""
    batch, vocab = logits.shape
    launch(_sampling_prep)[(batch,)](
        logits, temperature, repetition, frequency, presence, prompt_mask, output_counts,
        bias_indptr, bias_ids, bias_values, banned_indptr, banned_ids, vocab,
        prompt_mask.stride(0) if prompt_mask is not None else 0,
        output_counts.stride(0) if output_counts is not None else 0,
        HAS_PENALTIES=repetition is not None, HAS_BIAS=bias_indptr is not None,
        HAS_BANNED=banned_indptr is not None, BLOCK=1024,
    )  # fmt: skip


def _indptr(rows: torch.Tensor, batch: int) -> torch.Tensor:
    # rows are sorted (SamplingMetadata builds them row by row): CSR offsets by binary search.
    return torch.searchsorted(rows, torch.arange(batch + 1, device=rows.device)).to(torch.int32)


def prepare_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """kiln.ops.sampler.prepare_logits as one kernel launch; returns a new fp32 tensor."""
    out = logits.to(torch.float32, copy=True)
    batch = out.shape[0]
    pen, bias, banned = meta.penalties, meta.logit_bias, meta.banned
    sampling_prep_(
        out,
        meta.temperature,
        *(
            (pen.repetition.flatten(), pen.frequency.flatten(), pen.presence.flatten())
            if pen is not None
            else (None, None, None)
        ),
        pen.prompt_mask.view(torch.uint8) if pen is not None else None,
        pen.output_counts if pen is not None else None,
        *((_indptr(bias[0], batch), bias[1], bias[2]) if bias is not None else (None, None, None)),
        *((_indptr(banned[0], batch), banned[1]) if banned is not None else (None, None)),
    )
    return out
