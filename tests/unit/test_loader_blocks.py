"""`vidray.data.pipeline.plan_blocks`: how a window's micro-batches are grouped into the loader's Ray Data blocks."""

from __future__ import annotations

import numpy as np
import pytest

from vidray.data.pipeline import plan_blocks


def _covered(blocks):
    return [i for first, n in blocks for i in range(first, first + n)]


def test_blocks_start_at_one_and_double_up_to_block_batches():
    buckets = np.tile([[9, 64, 64]], (40, 1))
    blocks = plan_blocks(buckets, np.full(40, 2), max_batches=8)
    assert [n for _, n in blocks] == [1, 2, 4, 8, 8, 8, 8, 1]
    assert _covered(blocks) == list(range(40))  # every step once, in order


def test_a_block_never_mixes_buckets_nor_passes_the_byte_budget():
    a, b = [9, 64, 64], [17, 32, 32]
    buckets = np.array([a] * 3 + [b] * 10 + [a] * 2)
    blocks = plan_blocks(buckets, np.full(15, 2), max_batches=4)
    assert _covered(blocks) == list(range(15))
    for first, n in blocks:
        assert (buckets[first:first + n] == buckets[first]).all()
    assert [n for _, n in blocks] == [1, 2, 4, 4, 2, 2]  # cut at each bucket change
    # 2 clips x 9 x 64 x 64 x 3 = 221 184 bytes a micro-batch: a budget of 3 of them caps blocks at 3
    step_bytes = 2 * 9 * 64 * 64 * 3
    blocks = plan_blocks(np.tile([a], (20, 1)), np.full(20, 2), max_batches=16, max_bytes=3 * step_bytes)
    assert max(n for _, n in blocks) == 3
    # a micro-batch larger than the budget still travels, alone
    assert plan_blocks(np.tile([a], (3, 1)), np.full(3, 2), max_batches=8, max_bytes=10) == [(0, 1), (1, 1), (2, 1)]


def test_one_micro_batch_per_block_and_bad_sizes():
    blocks = plan_blocks(np.tile([[9, 64, 64]], (5, 1)), np.full(5, 2), max_batches=1)
    assert blocks == [(i, 1) for i in range(5)]
    assert plan_blocks(np.zeros((0, 3), np.int32), np.zeros(0, np.int64), max_batches=8) == []
    with pytest.raises(ValueError, match="max_batches"):
        plan_blocks(np.tile([[9, 64, 64]], (5, 1)), np.full(5, 2), max_batches=0)
