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
        self.lora_slots = np.full(max_tokens, -1, dtype=np.int64)  # each token's adapter slot, -1: none
        # One spare row: a mixed step of one request gets an empty second one (Lowering.pad).
        self.query_start_loc = np.zeros(max_seqs + 2, dtype=np.int32)
        self.seq_lens = np.zeros(max_seqs + 1, dtype=np.int32)
        self.block_table = np.zeros((max_seqs + 1, table_width(max_model_len, block_size)), dtype=np.int32)
        self.padding_block = 0  # the KV cache's extra block, which padding rows read and write (write_kv)
        # Per block-table row: the block-id list it was copied from, and how many of them. A running
        # request's list only grows (the block manager appends, or hands it a new list), so a row that holds
        # the same list takes only its new ids.
        self.rows: list[tuple[list[int] | None, int]] = [(None, 0)] * (max_seqs + 1)

    def set_blocks(self, row: int, block_ids: list[int]) -> None:
        """The row's block table is block_ids: a step copies the ids new since the last, not a history."""
        held, n = self.rows[row]
        if held is not block_ids:
            n = 0
        if len(block_ids) > n:
            self.block_table[row, n : len(block_ids)] = block_ids[n:]
            self.rows[row] = (block_ids, len(block_ids))

    def fill_blocks(self, rows: slice, block: int) -> None:
        """Every entry of the rows is block (padding rows, warm steps)."""
        self.block_table[rows] = block
        self.rows[rows] = [(None, 0)] * len(self.rows[rows])

    def width(self, num_reqs: int) -> int:
        """Block-table columns this step reads: its longest context's blocks, and at least two."""
        return max(2, -(-int(self.seq_lens[:num_reqs].max()) // self.block_size))
