"""The flat batch's host-side staging buffers (DESIGN.md: the flat batch), allocated once: each step fills
a prefix of them, the lowering pads them to its graphs' shapes, and the runner copies them to the device."""

from __future__ import annotations

import numpy as np

from kiln.ops.attention import table_width


class StepBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, max_model_len: int, block_size: int) -> None:
        self.block_size = block_size
        self.input_ids = np.zeros(max_tokens, dtype=np.int64)
        self.positions = np.zeros(max_tokens, dtype=np.int64)
        self.slot_mapping = np.zeros(max_tokens, dtype=np.int64)
        # One spare row: a mixed step of one request gets an empty second one (Lowering.pad).
        self.query_start_loc = np.zeros(max_seqs + 2, dtype=np.int32)
        self.seq_lens = np.zeros(max_seqs + 1, dtype=np.int32)
        self.block_table = np.zeros((max_seqs + 1, table_width(max_model_len, block_size)), dtype=np.int32)
        self.padding_block = 0  # the KV cache's extra block, which padding rows read and write (write_kv)

    def width(self, num_reqs: int) -> int:
        """Block-table columns this step reads: its longest context's blocks, and at least two."""
        return max(2, -(-int(self.seq_lens[:num_reqs].max()) // self.block_size))
