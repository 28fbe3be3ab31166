"""The shared FlashInfer float workspace holds the largest split-KV scratch a plan asks for (no GPU)."""

from __future__ import annotations

from kiln.ops.flashinfer_workspace import FLOOR_BYTES, SLACK_BYTES, graph_decode_scratch, workspace_bytes

H100_SMS = 132


def test_a_graph_plans_the_scratch_flashinfer_asked_vllm_for() -> None:
    # vllm-project/vllm#40023: 32 query heads over 2 KV heads at head dim 256, a CUDA graph of 512 sequences:
    # "batch_prefill_tmp_v requested 536,346,624 bytes"; tmp_s is the same rows without the head dim.
    tmp_v, tmp_s = 536_346_624, 536_346_624 // 256
    assert graph_decode_scratch(32, 2, 256, H100_SMS, 512) == tmp_v + tmp_s


def test_llama3_8b_fits_the_floor_and_qwen3_32b_outgrows_it() -> None:
    assert workspace_bytes(32, 8, 128, H100_SMS, 512, tensor_cores=True, fa2_prefill=False) == FLOOR_BYTES
    # 64 query heads over 8: ceil(512 x 8 / 16) + 511 tiles of 16 rows, 129 floats a row and head.
    qwen3_32b = 64 * 767 * 16 * 129 * 4
    assert qwen3_32b > FLOOR_BYTES
    assert workspace_bytes(64, 8, 128, H100_SMS, 512, True, False) == qwen3_32b + SLACK_BYTES
    assert workspace_bytes(64, 8, 128, H100_SMS, 64, True, False) == FLOOR_BYTES  # a smaller top graph


def test_cuda_core_decode_and_fa3_prefill_take_the_floor() -> None:
    assert workspace_bytes(32, 16, 128, H100_SMS, 512, tensor_cores=False, fa2_prefill=False) == FLOOR_BYTES


def test_fa2_prefill_splits_into_two_ctas_per_sm_and_kv_head() -> None:
    # An L40S (142 SMs, FA2 prefill): 64 query heads over 4, query tiles of 128 rows.
    want = 64 * (2 * 142 // 4) * 128 * 129 * 4
    assert workspace_bytes(64, 4, 128, 142, 1, tensor_cores=False, fa2_prefill=True) == want + SLACK_BYTES
