"""The sample schedule: which clips each rank trains on at every step, computed from (seed, epoch) alone.

The schedule is identical on every rank, deals the same number of batches to each rank, and puts one bucket
in each batch. Because it is a pure function of (bucket of each sample, batch size, world size, seed, epoch),
the data position of a run is just (epoch, batch_index): resume, prefetch and elastic re-dealing read it
instead of iterator state (Ray Data iterators cannot resume mid-epoch, ray issues 37633 and 48224).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from vidray.data.buckets import Bucket


@dataclass(frozen=True)
class DataPosition:
    """Where a run is in its schedule: `epoch` (0-based) and `batch_index` (0-based) within that epoch."""

    epoch: int
    batch_index: int


class SampleSchedule:
    """Deterministic, bucketed, rank-dealt batches over a fixed list of samples.

    Each epoch: permute the samples with `np.random.default_rng((seed, epoch))`, group them by bucket, cut each
    group into batches of `batch_size` (a short last batch is filled by wrapping around its own bucket, so no
    sample is dropped and a batch never mixes buckets), shuffle the batch order, and pad the batch list by
    wrapping so it divides evenly by `world_size`. Step k of the epoch gives rank r the batch `k*world_size + r`.

    Args:
        buckets: the bucket of each sample, indexed like the sample list.
        batch_size: samples per batch on one rank.
        world_size: number of data-parallel ranks.
        seed: schedule seed (the run's `train.seed`).
    Raises:
        ValueError: empty sample list, or batch_size / world_size < 1.
    """

    def __init__(self, buckets: Sequence[Bucket], *, batch_size: int, world_size: int, seed: int):
        if not buckets:
            raise ValueError("the schedule needs at least one sample; did `vidray prepare` keep any clips?")
        if batch_size < 1 or world_size < 1:
            raise ValueError(f"batch_size and world_size must be >= 1, got {batch_size} and {world_size}")
        self.buckets = [Bucket(*b) for b in buckets]
        self.batch_size = batch_size
        self.world_size = world_size
        self.seed = seed
        counts: dict[Bucket, int] = {}
        for bucket in self.buckets:
            counts[bucket] = counts.get(bucket, 0) + 1
        num_batches = sum(-(-n // batch_size) for n in counts.values())
        self.steps_per_epoch = -(-num_batches // world_size)
        """Optimizer steps in one epoch (the same every epoch)."""
        self._cached: tuple[int, list[list[int]]] | None = None

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """All batches of `epoch` (sample indices), padded to `steps_per_epoch * world_size` batches."""
        rng = np.random.default_rng((self.seed, epoch))
        order = rng.permutation(len(self.buckets))
        groups: dict[Bucket, list[int]] = {}
        for index in order:
            groups.setdefault(self.buckets[index], []).append(int(index))
        batches: list[list[int]] = []
        for bucket in sorted(groups):
            members = groups[bucket]
            for start in range(0, len(members), self.batch_size):
                batch = members[start : start + self.batch_size]
                batch += [members[i % len(members)] for i in range(self.batch_size - len(batch))]
                batches.append(batch)
        batches = [batches[i] for i in rng.permutation(len(batches))]
        total = self.steps_per_epoch * self.world_size
        return [batches[i % len(batches)] for i in range(total)]

    def position(self, step: int) -> DataPosition:
        """Data position of optimizer step `step` (1-based)."""
        if step < 1:
            raise ValueError(f"steps are 1-based, got {step}")
        epoch, batch_index = divmod(step - 1, self.steps_per_epoch)
        return DataPosition(epoch, batch_index)

    def batch_for(self, step: int, rank: int) -> list[int]:
        """Sample indices that `rank` trains on at optimizer step `step` (1-based)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        pos = self.position(step)
        if self._cached is None or self._cached[0] != pos.epoch:
            self._cached = (pos.epoch, self.epoch_batches(pos.epoch))
        return self._cached[1][pos.batch_index * self.world_size + rank]
