"""The staging buffers' block table: a row copies only the block ids new since the last step, and stays
equal to a full copy whatever wrote the row in between."""

import numpy as np

from kiln.compile.buffers import StepBuffers


def test_rows_equal_full_copies_through_growth_moves_and_padding() -> None:
    buf = StepBuffers(max_tokens=64, max_seqs=4, max_model_len=256, block_size=16)
    a, b = [3, 4], [7]

    def assert_row(row: int, ids: list[int]) -> None:
        assert buf.block_table[row, : len(ids)].tolist() == ids

    buf.set_blocks(0, a)
    buf.set_blocks(1, b)
    a.append(5)  # the block manager appends as the request grows
    buf.set_blocks(0, a)
    assert_row(0, [3, 4, 5])
    buf.set_blocks(0, b)  # a request moves up a row when one before it finishes
    buf.set_blocks(1, a)
    assert_row(0, [7])
    assert_row(1, [3, 4, 5])
    buf.fill_blocks(slice(1, 3), 9)  # padding rows of a captured graph, or a warm step
    buf.set_blocks(1, a)  # the same list as before the padding: copied again, not skipped
    assert_row(1, [3, 4, 5])
    assert buf.block_table[2].tolist() == [9] * buf.block_table.shape[1]
    fresh = [8]  # a preempted request gets a new list, whose first ids overwrite the old
    buf.set_blocks(1, fresh)
    assert_row(1, [8, 4, 5])
    np.testing.assert_array_equal(buf.block_table[3], 0)
