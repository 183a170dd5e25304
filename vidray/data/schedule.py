"""The sample schedule: which samples every rank trains on at every step, independent of the world size.

Vectorised numpy throughout (no per-sample Python loops): planning one epoch of 26.6 M samples over 512 ranks,
with the shard-local walk, takes a few seconds and under 4 GB on one core (`benchmarks/schedule.py`).

## The epoch's micro-batches (world-size independent)
For epoch `e` (0-based), with `rng = np.random.default_rng([seed, e])`:
1. The samples are grouped by bucket and each bucket's samples are put in this epoch's order, bucket by bucket:
   - with `shards` (the shard of each sample, `SampleIndex.shard`): a **shard-local walk**. The bucket's shards
     are visited in a random order (`rng.permutation`), cut into blocks of `shuffle_block_shards` consecutive
     shards of that order, and the samples are shuffled within each block only (a stable sort of
     `(block, random 32-bit key)`). A block's samples are consecutive in the bucket's sequence, so a loader
     holds about `shuffle_block_shards` shards per bucket at once and fetches each shard about once per epoch.
     This is mosaicml streaming's block shuffle (`streaming/base/shuffle/py1b.py`: the shards' sample spans are
     permuted, then samples are shuffled within fixed blocks of `block_size` samples, 2**18 by default;
     `py1br.py` draws each block's size in 0.75-1.25x `block_size` and staggers block starts per node), with
     one change: blocks are counted in whole shards, not samples, so no block straddles a shard and each shard
     is read in one contiguous run of the sequence (py1b's blocks cut shards at arbitrary samples). `prepare` writes
     each shard with one bucket and similar captions (`vidray.data.grouping`), so a block is also a few content
     clusters; the random shard order keeps clusters apart from one epoch to the next.
   - without `shards`: every sample is its own group, a full shuffle (`rng.shuffle`).
2. Each bucket `k` is cut into `m_k = ceil(n_k / b_k)` micro-batches of `b_k` samples (`b_k`: the bucket's batch
   size, `batch_sizes_for_buckets`). A micro-batch holds one bucket. **Short batches**: the last micro-batch of a
   bucket, and the only one of a bucket holding fewer samples than one batch, is filled up to `b_k` by repeating
   that batch's own r real samples cyclically, with loss weight 0: repeats cost compute but count neither in the
   loss nor as "seen", and need no other clip fetched. Nothing is dropped.
3. The global sequence: a uniformly random interleaving of all micro-batches in which each bucket's micro-batches
   keep their order (each bucket draws sorted uniform keys, as cumulated exponentials; the sequence sorts by key).

## The position
`DataPosition(epoch, consumed)`: `consumed[k]` micro-batches of bucket `k` of the epoch are done; they are always
the first `consumed[k]` of that bucket. Its sum is the epoch's batches consumed (`batches_consumed`). It does not
depend on the world size. When every micro-batch of an epoch is consumed the position is `(epoch + 1, 0...)`.

## Dealing a step: G micro-batches to W ranks
A step deals a global batch of G micro-batches (`train.micro_batches_per_step`; by default the configured
(max) worker count, so that G = W in a fixed-size run). It takes the bucket whose next micro-batch comes first in
the global sequence and deals that bucket's next G micro-batches, in order, as the step's slots 0..G-1: **every
micro-batch of a step holds the same bucket at the same batch size**. When the bucket has r < G micro-batches left
(its tail, once per bucket per epoch), slots r..G-1 are padding (a copy of the step's first micro-batch) whose
samples all have loss weight 0. The slots, their samples and their weights do not depend on W.

Rank r of W trains slots r, r+W, r+2W, ... (`StepDeal.rank_slots`: ceil((G - r) / W) micro-batches, at least one
since G >= W), accumulating gradients over them (DDP synchronises on the last backward only). With G = W every
rank trains one micro-batch, as before gradient accumulation existed; with W < G some ranks train one more than
others. G < W is refused (a rank would have nothing to train: DDP's all-reduce would wait for it forever).

Guarantee: the step dealt at a position is a pure function of (seed, epoch, position, G), identical on every rank
and process and for every W <= G. Whatever sequence of world sizes a run uses (changed at any resume or elastic
restart), every sample of an epoch is trained with weight 1 exactly once in that epoch: each bucket's micro-batches
are consumed as a prefix, each once. With a constant G the steps of an epoch are the groups `(c_k, c_k+G, ...)` of
each bucket sorted by the sequence position of their first micro-batch (`plan`, vectorised), and resuming from any
position reached, at any W <= G, gives exactly the remaining steps of the uninterrupted run. Padding costs at most
(G - 1) micro-batches per bucket per epoch.

Loss normalisation: a step's loss is the mean over its weighted samples across all slots; each micro-batch's
weighted sum of per-sample losses is scaled by `W / StepDeal.total_weight` (known to every rank from the deal, no
communication). A rank's accumulated gradient is the sum over its slots; DDP averages over the W ranks (divides
by W), so the gradient is exactly the step's mean, whatever W is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

from vidray.buckets import Bucket


@dataclass(frozen=True)
class DataPosition:
    """Where a run is in its schedule: `epoch` (0-based) and `consumed[k]`, the micro-batches of bucket k (in
    `SampleSchedule.buckets` order) of that epoch already trained. World-size independent."""

    epoch: int
    consumed: tuple[int, ...]

    @property
    def batches_consumed(self) -> int:
        """Micro-batches of the epoch consumed (all buckets)."""
        return int(sum(self.consumed))

    def to_dict(self, buckets: Sequence[Bucket]) -> dict[str, int]:
        """{"9x64x64": consumed, ...} for a checkpoint (keys are bucket names, so it survives reordering)."""
        return {str(Bucket(*b)): int(c) for b, c in zip(buckets, self.consumed, strict=True)}


@dataclass(frozen=True)
class StepDeal:
    """One optimizer step: G micro-batches (slots) dealt to `world_size` ranks (module docstring).

    bucket, batch_size: shared by every slot. micro_batches: G (>= W). batch_ids: (G,) micro-batch ids of the epoch
    (bucket-major numbering); real: (G,) bool, False for a padded slot. sample_rows: (G, B) int rows of the sample
    index; weights: (G, B) float32 loss weights (0 = padding: not trained, not seen). next_position: the position
    after this step. Slot j is trained by rank j % W.
    """

    epoch: int
    bucket: Bucket
    batch_size: int
    world_size: int
    batch_ids: np.ndarray
    real: np.ndarray
    sample_rows: np.ndarray
    weights: np.ndarray
    next_position: DataPosition
    micro_batches: int = 0
    """G; 0 (the default of older callers) means G = world_size."""

    def __post_init__(self):
        if not self.micro_batches:
            object.__setattr__(self, "micro_batches", int(self.world_size))

    @property
    def total_weight(self) -> float:
        """Sum of loss weights over every slot (>= 1: a step always has a real micro-batch)."""
        return float(self.weights.sum())

    def rank_slots(self, rank: int) -> np.ndarray:
        """(n_r,) slots trained by `rank`: rank, rank + W, ... < G (n_r = ceil((G - rank) / W) >= 1). Raises
        ValueError for a rank outside [0, W)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        return np.arange(rank, self.micro_batches, self.world_size)

    def rank(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """(sample_rows (n_r, B), weights (n_r, B)) of the micro-batches `rank` trains (`rank_slots`), in slot
        order. Raises ValueError for a rank outside [0, W)."""
        slots = self.rank_slots(rank)
        return self.sample_rows[slots], self.weights[slots]


@dataclass(frozen=True)
class EpochDeal:
    """The remaining steps of one epoch from a position, G micro-batches per step (`SampleSchedule.plan`).

    step_bucket: (S,) bucket index of each step; step_first: (S,) micro-batch id (epoch numbering) of slot 0;
    step_count: (S,) real micro-batches of the step (<= G; the others are padded). world_size: the W it was
    planned for (slot j goes to rank j % W); micro_batches: G.
    """

    epoch: int
    world_size: int
    step_bucket: np.ndarray
    step_first: np.ndarray
    step_count: np.ndarray
    micro_batches: int = 0
    """G; 0 means G = world_size."""

    def __post_init__(self):
        if not self.micro_batches:
            object.__setattr__(self, "micro_batches", int(self.world_size))

    @property
    def num_steps(self) -> int:
        return int(len(self.step_bucket))

    def batch_ids(self) -> tuple[np.ndarray, np.ndarray]:
        """((S, G) int micro-batch id of every slot at every step, (S, G) bool real mask). A padded slot gets the
        step's first micro-batch, with every weight 0."""
        slots = np.arange(self.micro_batches, dtype=np.int64)
        real = slots[None, :] < self.step_count[:, None]
        ids = self.step_first[:, None] + np.where(real, slots[None, :], 0)
        return ids, real


@dataclass(frozen=True)
class _Epoch:
    slot_samples: np.ndarray  # (T,) sample row of every slot; slots of batch j: batch_slot[j] .. + b
    slot_weight: np.ndarray  # (T,) bool: False for the repeats that fill a short batch
    seq_pos: np.ndarray  # (M,) float key of each micro-batch (bucket-major id): the global sequence sorts by it


class SampleSchedule:
    """Deterministic, bucketed, world-size-independent schedule over a fixed table of samples.

    Args:
        bucket_ids: (N,) int bucket index of each sample (into `buckets`), e.g. `SampleIndex.bucket_id`.
        buckets: the buckets, sorted (bucket index k is `buckets[k]`).
        batch_sizes: samples per micro-batch, one int for all buckets or {Bucket: int}.
        seed: schedule seed (the run's `train.seed`).
        shards: (N,) int shard of each sample (`SampleIndex.shard`): each bucket's epoch order walks its shards
            in blocks of `shuffle_block_shards` (module docstring). None: every bucket is fully shuffled.
        shuffle_block_shards: shards per block of the walk (`data.shuffle_block_shards`); unused without `shards`.
    Raises:
        ValueError: no samples, a bucket id outside `buckets`, a batch size < 1 or missing for a bucket, `shards`
            not one int per sample, `shuffle_block_shards` < 1.
    """

    def __init__(self, bucket_ids: np.ndarray, buckets: Sequence[Bucket], *,
                 batch_sizes: int | Mapping[Bucket, int], seed: int, shards: np.ndarray | None = None,
                 shuffle_block_shards: int = 4):
        bucket_ids = np.asarray(bucket_ids)
        if bucket_ids.ndim != 1 or len(bucket_ids) == 0:
            raise ValueError("the schedule needs at least one sample; did `vidray prepare` keep any clips?")
        self.buckets = tuple(Bucket(*b) for b in buckets)
        num_buckets = len(self.buckets)
        if bucket_ids.min() < 0 or bucket_ids.max() >= num_buckets:
            raise ValueError(f"bucket ids must be in [0, {num_buckets}), got {bucket_ids.min()}..{bucket_ids.max()}")
        self.bucket_ids = bucket_ids.astype(np.int16 if num_buckets < 2**15 else np.int32)
        if isinstance(batch_sizes, Mapping):
            missing = [str(b) for b in self.buckets if b not in batch_sizes]
            if missing:
                raise ValueError(f"no batch size for bucket(s) {', '.join(missing)}")
            sizes = [int(batch_sizes[b]) for b in self.buckets]
        else:
            sizes = [int(batch_sizes)] * num_buckets
        if min(sizes) < 1:
            raise ValueError(f"batch sizes must be >= 1, got {sizes}")
        self.seed = int(seed)
        self.num_samples = len(bucket_ids)
        self.bucket_sizes = np.bincount(self.bucket_ids, minlength=num_buckets).astype(np.int64)  # n_k
        """(K,) samples per bucket."""
        self.batch_sizes = np.asarray(sizes, dtype=np.int64)  # b_k
        self.num_batches = -(-self.bucket_sizes // self.batch_sizes)  # m_k (0 for an empty bucket)
        """(K,) micro-batches of each bucket per epoch (the same every epoch)."""
        self.batch_start = np.concatenate([[0], np.cumsum(self.num_batches)])  # (K+1,) bucket-major batch ids
        self.slot_start = np.concatenate([[0], np.cumsum(self.num_batches * self.batch_sizes)])  # (K+1,)
        self.batches_per_epoch = int(self.batch_start[-1])
        self._sample_start = np.concatenate([[0], np.cumsum(self.bucket_sizes)])
        if int(shuffle_block_shards) < 1:
            raise ValueError(f"data.shuffle_block_shards must be >= 1 shards, got {shuffle_block_shards}")
        self.shuffle_block_shards = int(shuffle_block_shards)
        index_dtype = np.int32 if self.num_samples < 2**31 else np.int64
        if shards is None:
            self._by_bucket = np.argsort(self.bucket_ids, kind="stable").astype(index_dtype)  # rows grouped by bucket
            self._segment_start = None
        else:
            shards = np.asarray(shards)
            if shards.shape != bucket_ids.shape or not np.issubdtype(shards.dtype, np.integer):
                raise ValueError(f"shards must be one int per sample, shape ({self.num_samples},), got "
                                 f"{shards.dtype} {shards.shape}; pass SampleIndex.shard")
            if shards.min() < 0 or shards.max() >= 2**32:
                raise ValueError(f"shards must be in [0, 2**32), got {shards.min()}..{shards.max()}")
            # Rows grouped by bucket, then by shard (stable: row order inside a shard). A segment is the rows of
            # one (bucket, shard); _segment_start (S+1,) holds their start positions in _by_bucket.
            key = (self.bucket_ids.astype(np.int64) << 32) | (shards.astype(np.int64) & 0xFFFFFFFF)
            self._by_bucket = np.argsort(key, kind="stable").astype(index_dtype)
            sorted_key = key[self._by_bucket]
            del key
            starts = np.flatnonzero(sorted_key[1:] != sorted_key[:-1]) + 1
            del sorted_key
            self._segment_start = np.concatenate([[0], starts, [self.num_samples]]).astype(np.int64)
            # (K+1,) first segment of each bucket (bucket starts are segment starts).
            self._bucket_segment = np.searchsorted(self._segment_start, self._sample_start)
        self._epoch_cache: dict[int, _Epoch] = {}

    @classmethod
    def from_buckets(cls, sample_buckets: Sequence[Bucket], *, batch_sizes: int | Mapping[Bucket, int],
                     seed: int, shards: Sequence[int] | np.ndarray | None = None,
                     shuffle_block_shards: int = 4) -> "SampleSchedule":
        """A schedule from one Bucket per sample (small lists: tests, demos)."""
        if not sample_buckets:
            raise ValueError("the schedule needs at least one sample; did `vidray prepare` keep any clips?")
        buckets = sorted({Bucket(*b) for b in sample_buckets})
        lookup = {b: i for i, b in enumerate(buckets)}
        return cls(np.array([lookup[Bucket(*b)] for b in sample_buckets]), buckets, batch_sizes=batch_sizes, seed=seed,
                   shards=None if shards is None else np.asarray(shards), shuffle_block_shards=shuffle_block_shards)

    # -- positions -------------------------------------------------------------------------------------------

    def start(self, epoch: int = 0) -> DataPosition:
        """The position before the first step of `epoch`."""
        return DataPosition(int(epoch), (0,) * len(self.buckets))

    def position_from_dict(self, epoch: int, consumed: Mapping[str, int]) -> DataPosition:
        """Inverse of `DataPosition.to_dict`. Raises ValueError naming a bucket the schedule does not have or a
        count beyond the bucket's micro-batches (the checkpoint belongs to other data or batch sizes)."""
        names = [str(b) for b in self.buckets]
        unknown = sorted(set(consumed) - set(names))
        if unknown:
            raise ValueError(f"data position names bucket(s) {unknown} that the shards do not hold ({names})")
        counts = tuple(int(consumed.get(name, 0)) for name in names)
        return self.check_position(DataPosition(int(epoch), counts))

    def check_position(self, position: DataPosition) -> DataPosition:
        """Return `position` normalised (an exhausted epoch becomes the next one's start). Raises ValueError."""
        c = np.asarray(position.consumed, dtype=np.int64)
        if c.shape != self.num_batches.shape or position.epoch < 0 or (c < 0).any() or (c > self.num_batches).any():
            raise ValueError(
                f"data position {position} does not fit this schedule (epoch >= 0; per-bucket batches "
                f"0..{self.num_batches.tolist()} for buckets {[str(b) for b in self.buckets]})"
            )
        if (c == self.num_batches).all():
            return self.start(position.epoch + 1)
        return position

    def steps_per_epoch(self, world_size: int, micro_batches: int | None = None) -> int:
        """Optimizer steps of a whole epoch with G = `micro_batches` micro-batches per step (None: G =
        `world_size`); the count depends on G only. Raises ValueError when G < world_size."""
        g = _check_micro_batches(micro_batches, world_size)
        return int((-(-self.num_batches // g)).sum())

    # -- the epoch's micro-batches ----------------------------------------------------------------------------

    def _epoch(self, epoch: int) -> _Epoch:
        cached = self._epoch_cache.get(epoch)
        if cached is not None:
            return cached
        rng = np.random.default_rng([self.seed % 2**63, int(epoch)])
        n, b, m = self.bucket_sizes, self.batch_sizes, self.num_batches
        total = int(self.slot_start[-1])
        slot_samples = np.empty(total, dtype=self._by_bucket.dtype)
        slot_weight = np.ones(total, dtype=bool)
        seq_key = np.empty(self.batches_per_epoch, dtype=np.float64)
        for k in range(len(n)):  # one iteration per bucket (tens), numpy inside
            if n[k] == 0:
                continue
            # 1. This bucket's samples in this epoch's order: a shard-local walk, or a full shuffle.
            if self._segment_start is None:
                members = self._by_bucket[self._sample_start[k]:self._sample_start[k + 1]].copy()
                rng.shuffle(members)  # in place: no gather over the whole table
            else:
                members = self._shard_walk(k, rng)
            # 2. Its micro-batches' slots; a short last batch repeats its own r real samples cyclically, weight 0
            # (nothing else to fetch or decode).
            s0, fill = int(self.slot_start[k]), int(m[k] * b[k] - n[k])
            slot_samples[s0:s0 + n[k]] = members
            if fill:
                last, r = int((m[k] - 1) * b[k]), int(n[k] - (m[k] - 1) * b[k])
                slot_samples[s0 + n[k]:s0 + n[k] + fill] = members[last + np.arange(fill) % r]
                slot_weight[s0 + n[k]:s0 + n[k] + fill] = False
            # 3. Sequence keys: sorted uniform order statistics (cumulated exponentials), so merging all buckets
            # by key is a uniformly random interleaving that keeps each bucket's batch order.
            gaps = rng.standard_exponential(int(m[k]) + 1)
            keys = np.cumsum(gaps)
            seq_key[self.batch_start[k]:self.batch_start[k + 1]] = keys[:-1] / keys[-1]
        result = _Epoch(slot_samples, slot_weight, seq_key)
        self._epoch_cache = {epoch: result}  # one epoch at a time: a run moves forward
        return result

    def _shard_walk(self, k: int, rng: np.random.Generator) -> np.ndarray:
        """(n_k,) sample rows of bucket k in this epoch's shard-local order (module docstring, step 1); O(n_k)
        memory, one stable sort of n_k uint64 keys."""
        seg_lo, seg_hi = int(self._bucket_segment[k]), int(self._bucket_segment[k + 1])
        starts = self._segment_start[seg_lo:seg_hi]  # (S_k,) positions in _by_bucket
        lengths = self._segment_start[seg_lo + 1:seg_hi + 1] - starts  # (S_k,) samples of each shard
        walk = rng.permutation(seg_hi - seg_lo)  # the shards in the order this epoch visits them
        walk_lengths = lengths[walk]
        # Gather the rows shard by shard in walk order: position i of shard j is starts[j] + i.
        walk_first = np.cumsum(walk_lengths) - walk_lengths  # (S_k,) first output position of each shard
        positions = np.repeat(starts[walk] - walk_first, walk_lengths) + np.arange(int(walk_lengths.sum()))
        members = self._by_bucket[positions]
        del positions
        # Shuffle inside blocks of `shuffle_block_shards` consecutive shards: a stable sort of (block, random).
        # The stable sort breaks equal keys by position: identical on every machine (no unstable-sort ties).
        block = np.repeat(np.arange(len(walk), dtype=np.uint64) // np.uint64(self.shuffle_block_shards),
                          walk_lengths)
        keys = (block << np.uint64(32)) | rng.integers(0, 2**32, size=len(members), dtype=np.uint64)
        del block
        return members[np.argsort(keys, kind="stable")]

    def batch_samples(self, epoch: int, batch_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(sample rows, weights) of micro-batches `batch_ids` (any shape S) of `epoch`: arrays (*S, B) when all
        share one batch size B. Raises ValueError when they do not."""
        e = self._epoch(epoch)
        batch_ids = np.asarray(batch_ids, dtype=np.int64)
        k = np.searchsorted(self.batch_start, batch_ids, side="right") - 1
        sizes = self.batch_sizes[k]
        if sizes.size and (sizes != sizes.flat[0]).any():
            raise ValueError("batch_samples: the micro-batches have different batch sizes")
        size = int(sizes.flat[0]) if sizes.size else 0
        first = self.slot_start[k] + (batch_ids - self.batch_start[k]) * sizes
        slots = first[..., None] + np.arange(size)
        return e.slot_samples[slots], e.slot_weight[slots].astype(np.float32)

    # -- dealing --------------------------------------------------------------------------------------------

    def next_step(self, position: DataPosition, world_size: int, micro_batches: int | None = None) -> StepDeal:
        """The step dealt at `position`: G = `micro_batches` micro-batches (None: G = `world_size`) for
        `world_size` ranks (O(buckets); see the module docstring). Raises ValueError for a world size < 1, G <
        world_size, or a position that does not fit the schedule."""
        micro_batches = _check_micro_batches(micro_batches, world_size)
        world_size = int(world_size)
        position = self.check_position(position)
        e = self._epoch(position.epoch)
        c = np.asarray(position.consumed, dtype=np.int64)
        open_ = np.flatnonzero(c < self.num_batches)
        heads = e.seq_pos[self.batch_start[open_] + c[open_]]
        k = int(open_[np.argmin(heads)])
        count = int(min(micro_batches, self.num_batches[k] - c[k]))
        first = int(self.batch_start[k] + c[k])
        slots = np.arange(micro_batches)
        real = slots < count
        batch_ids = first + np.where(real, slots, 0)
        rows, weights = self.batch_samples(position.epoch, batch_ids)
        weights = weights * real[:, None]
        consumed = list(position.consumed)
        consumed[k] += count
        after = self.check_position(DataPosition(position.epoch, tuple(consumed)))
        return StepDeal(position.epoch, self.buckets[k], int(self.batch_sizes[k]), world_size, batch_ids, real,
                        rows, weights.astype(np.float32), after, micro_batches)

    def plan(self, position: DataPosition, world_size: int, micro_batches: int | None = None) -> EpochDeal:
        """Every remaining step of `position`'s epoch with G = `micro_batches` (None: `world_size`) micro-batches
        per step, vectorised: the same steps, in the same order, as calling `next_step` repeatedly from
        `position`. Raises ValueError like `next_step`."""
        micro_batches = _check_micro_batches(micro_batches, world_size)
        position = self.check_position(position)
        e = self._epoch(position.epoch)
        c = np.asarray(position.consumed, dtype=np.int64)
        groups = -(-(self.num_batches - c) // micro_batches)  # (K,) steps left per bucket
        group_bucket = np.repeat(np.arange(len(c)), groups)
        within = np.arange(int(groups.sum()), dtype=np.int64) - np.repeat(np.cumsum(groups) - groups, groups)
        first_local = c[group_bucket] + within * micro_batches
        first = self.batch_start[:-1][group_bucket] + first_local
        order = np.argsort(e.seq_pos[first], kind="stable")
        step_bucket = group_bucket[order]
        step_first = first[order]
        step_count = np.minimum(micro_batches, self.num_batches[step_bucket] - first_local[order])
        return EpochDeal(position.epoch, int(world_size), step_bucket, step_first, step_count, micro_batches)


def _check_world(world_size: int) -> int:
    if int(world_size) < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return int(world_size)


def _check_micro_batches(micro_batches: int | None, world_size: int) -> int:
    """G for `world_size` ranks: `micro_batches`, or `world_size` when None. Raises ValueError for G < W."""
    world_size = _check_world(world_size)
    if micro_batches is None:
        return world_size
    if int(micro_batches) < world_size:
        raise ValueError(
            f"micro_batches per step ({micro_batches}) must be >= world_size ({world_size}): every rank needs at "
            "least one micro-batch; raise train.micro_batches_per_step or lower the worker count"
        )
    return int(micro_batches)


def batch_sizes_for_buckets(
    buckets: Sequence[Bucket],
    *,
    batch_size_per_worker: int,
    tokens_per_batch: int | None,
    latent_tokens: Callable[[Bucket], int],
) -> dict[Bucket, int]:
    """Samples per micro-batch of each bucket.

    `tokens_per_batch` None: `batch_size_per_worker` for every bucket. Otherwise
    `max(1, tokens_per_batch // latent_tokens(bucket))`, where `latent_tokens` is the latent positions of one clip
    (F_lat * H_lat * W_lat of the family's VAE strides); e.g. 1536 tokens, Bucket(9, 64, 64) -> 3x8x8 = 192 ->
    8 clips, Bucket(1, 64, 64) -> 64 -> 24 images. Raises ValueError for a budget < 1.
    """
    if tokens_per_batch is None:
        return {Bucket(*b): int(batch_size_per_worker) for b in buckets}
    if tokens_per_batch < 1:
        raise ValueError(f"data.tokens_per_batch must be >= 1 latent tokens, got {tokens_per_batch}")
    return {Bucket(*b): max(1, int(tokens_per_batch) // int(latent_tokens(Bucket(*b)))) for b in buckets}


def job_schedule(job, table, family) -> SampleSchedule:
    """The sample schedule a job trains on (the training loop and `vidray prepare --encode` both plan with it).

    job: a `vidray.config.JobConfig`; table: the shards' sample table (`vidray.data.index.SampleIndex`: bucket_id,
    buckets, shard); family: the job's `ModelFamily` (its `latent_shape` gives the latent tokens of a bucket).
    Per-bucket batch sizes come from `data.batch_size_per_worker` or `data.tokens_per_batch`
    (`batch_sizes_for_buckets`), the order from `train.seed` and `data.shuffle_block_shards`. Raises ValueError
    for a token budget < 1.
    """
    batch_sizes = batch_sizes_for_buckets(
        table.buckets,
        batch_size_per_worker=job.data.batch_size_per_worker,
        tokens_per_batch=job.data.tokens_per_batch,
        latent_tokens=lambda bucket: int(np.prod(family.latent_shape(bucket, 1)[2:])),
    )
    return SampleSchedule(table.bucket_id, table.buckets, batch_sizes=batch_sizes, seed=job.train.seed,
                          shards=table.shard, shuffle_block_shards=job.data.shuffle_block_shards)
