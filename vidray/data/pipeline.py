"""The per-rank loader: Ray Data streams each training worker its own micro-batches, in the schedule's order.

A training worker never holds the dataset. It holds the sample table (`vidray.data.index`, a few numpy columns)
and the schedule (`vidray.data.schedule`); from its data position it plans its own steps (`plan_rank_steps`: every
rank computes the same deal and keeps its row), and a `RankLoader` delivers them:

```
ray.data.from_items([{"i": 0, "n": 1}, {"i": 1, "n": 2}, {"i": 3, "n": 4}, ...])   blocks of this rank's
                                                            planned steps (`plan_blocks`)
  .map_batches(ClipLoader, concurrency=1, num_cpus=data.loader_cpus,    fetch + decode operator (one actor,
               label_selector=placement.decode)                        on the nodes vidray.placement allows)
  [.map_batches(EncodeStage, ...)]                          the encode stages (`vidray.data.encode`)
  .iter_batches(batch_size=None)                            in plan order (preserve_order), with backpressure
-> background thread -> queue of data.prefetch_batches micro-batches -> the training loop
```
A block carries up to `data.block_batches` consecutive micro-batches of one bucket (1, 2, 4, ... at the start of
each window): Ray Data's executor runs in the training process and spends milliseconds of its CPU per block, so
one block per micro-batch took ~40 % of a core beside a 50 ms CPU step (`benchmarks/train_overhead.py`).
Steps are dealt lazily (`iter_rank_steps`) and streamed in windows of `RankLoader(window_steps=2048)` steps, one
Ray Data dataset (and loader actor) per window, so start-up and memory do not grow with `train.max_steps`.

The tiers a clip goes through on its way to the trainer (`ClipLoader`):
- **cold**: the shard store (`data.shards_dir`: a local folder or an object store URI, `vidray.storage`);
- **warm**: the node's disk cache of shards fetched from an object store (`vidray.data.cache.ShardCache`, byte
  budget `data.cache_bytes`, one download per shard per node). A background thread of the loader fetches the
  shards of the next `data.prefetch_window_batches` micro-batches cold -> warm ahead of the decoder, within
  `cache_bytes / (2 x ranks on the node)`. Local folders are read in place (no warm copy);
- the loader keeps the shards it is walking in memory (the last `2 * data.shuffle_block_shards + 2`, Arrow tables
  of the columns it needs): the schedule walks shard-local blocks, so each shard is read about once per epoch;
- **hot**: decoded clips (uint8 frames) and captions by sample key, LRU under `data.hot_bytes`, reused across
  epochs; a micro-batch's misses are decoded on two threads (PyAV releases the GIL), which keeps the loader at the
  plain single-process PyAV loop's clips/s despite Ray Data's per-batch plumbing (`benchmarks/data_pipeline.py`
  (a)); the Ray resource request stays `data.loader_cpus`;
- **latents** (with the encode stages and a latent cache, `vidray.data.encode`): a clip whose latents the cache
  holds for the stage's VAE is not decoded at all. The loader reads its mp4 bytes only to hash them (the cache
  key), reads the cached latents and hands them to the encode stage with zeros for frames. It learns the VAE's
  identity from the cache's memo of it (`vidray.data.identities`: unchanged encoders start no task) or from a task
  (`encoder_identity_refs`; training's driver starts it while the workers start, else the loader with its first
  window), without waiting for it: clips are decoded until the identity arrives. The encode
  stages name their entries with the same tasks' identities and load an encoder only on a miss;
- the queue of `data.prefetch_batches` decoded micro-batches ahead of the trainer (Ray Data's streaming executor
  decodes ahead of the queue within its object-store budget).

Bad input: a shard whose checksum fails (or that the store keeps failing to deliver) and a clip that no longer
decodes are skipped and recorded (`TrainBatch.skipped`); the micro-batch keeps its shape (the slot repeats
another clip of the batch, or black frames, with loss weight 0), so every rank still trains equal batches.

Ray Data in a worker runs under `ExecutionOptions(resource_limits=ExecutionResources(cpu=data.loader_cpus),
preserve_order=True)`; on 2 cores an unsized Ray Data run next to the trainers deadlocks (../shared/NOTES.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from concurrent.futures import ThreadPoolExecutor
import queue
import threading
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from vidray.buckets import Bucket
from vidray.data.encode import (
    ENCODE_SPAN_KEYS,
    ENCODE_STAT_KEYS,
    EncodeStage,
    LatentCache,
    block_rows,
    concat_rows,
    node_info,
    pack_cached_latents,
)
from vidray.data.identities import identity_task, memo_key, model_files_signature, read_identity
from vidray.data.schedule import DataPosition, SampleSchedule
from vidray.logs import quiet_ray_data
from vidray.storage import open_storage

NO_ACTOR_RESTARTS = """The decode and encode operators' actors are not restarted by Ray Data (`max_restarts=0`): a dead
stage actor fails the rank's loader, and Ray Train restarts the worker group from the latest checkpoint, the same
exact-resume path as any other failure. Ray Data's default (restart for ever) made every such actor log an
error-level `core_worker.cc ... has constructor arguments in the object store and max_restarts > 0` line (Ray
issue 53727: Ray Data always passes the operator through the object store) in every run's console. Ray 2.60's
`map_batches` takes `max_restarts` only through its deprecated `**ray_remote_args` (its own comment names
`map_batches(..., max_restarts=0)`); its deprecation warning is silenced for these two calls alone."""

STAT_KEYS = ("hot_hits", "hot_misses", "warm_hits", "warm_misses", "bytes_fetched", "shard_reads",
             "decode_s", "fetch_s", "decodes_skipped")
"""Per-micro-batch counters a `ClipLoader` reports (deltas): hot-tier hits/misses (clips), warm-tier hits/misses
(shard opens from an object store: a miss is a download), bytes read from the cold store, shard files read into
the loader's memory, seconds decoding (and reading cached latents) and seconds fetching/reading shards, and clips
not decoded because their latents were found in the latent cache (hot misses that skipped the decoder)."""
DECODE_SPAN_KEYS = ("decode_start_unix", "decode_end_unix")
"""Wall-clock seconds (`time.time()` on the loader's node) between which a `ClipLoader` worked on a micro-batch
(fetching, reading cached latents, decoding): the trainer counts only the part inside its log window
(`vidray.metrics.TrainMetrics.add_stage`), however far ahead the loader ran."""


@dataclass(frozen=True)
class RankStep:
    """One planned micro-batch of one rank (a step has `num_micro` of them on this rank).

    step: optimizer step (1-based); epoch: the epoch it trains; bucket: its (F, H, W); rows: (B,) int64 rows of
    the sample table; weights: (B,) float32 loss weights (0 = padding or repeat); total_weight: sum of the step's
    weights over all its micro-batches on every rank (`StepDeal.total_weight`); next_position: the data position
    after the step; micro: this micro-batch's index among the rank's micro-batches of the step (0-based);
    num_micro: how many the rank trains at this step (`StepDeal.rank_slots`; 1 when G = W).
    """

    step: int
    epoch: int
    bucket: Bucket
    rows: np.ndarray
    weights: np.ndarray
    total_weight: float
    next_position: DataPosition
    micro: int = 0
    num_micro: int = 1


def plan_rank_steps(schedule: SampleSchedule, position: DataPosition, *, world_size: int, rank: int,
                    first_step: int, last_step: int, micro_batches: int | None = None) -> list[RankStep]:
    """The micro-batches of `rank` for steps `first_step..last_step`, dealt from `position` with G =
    `micro_batches` micro-batches per step (None: G = `world_size`) to `world_size` ranks
    (`SampleSchedule.next_step`, O(buckets) per step; the same deal on every rank): per step, the rank's
    `StepDeal.rank_slots` in order. Raises ValueError for a rank outside [0, world_size) or G < world_size."""
    return list(iter_rank_steps(schedule, position, world_size=world_size, rank=rank, first_step=first_step,
                                last_step=last_step, micro_batches=micro_batches))


def iter_rank_steps(schedule: SampleSchedule, position: DataPosition, *, world_size: int, rank: int,
                    first_step: int, last_step: int, micro_batches: int | None = None) -> Iterator[RankStep]:
    """`plan_rank_steps`, lazily: each step is dealt when it is asked for (what `RankLoader` streams for long
    runs: memory and start-up do not grow with `train.max_steps`)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    for step in range(first_step, last_step + 1):
        deal = schedule.next_step(position, world_size, micro_batches)
        rows, weights = deal.rank(rank)  # (n_r, B) each
        for micro in range(len(rows)):
            yield RankStep(step, deal.epoch, deal.bucket, rows[micro].astype(np.int64),
                           weights[micro].astype(np.float32), deal.total_weight, deal.next_position, micro, len(rows))
        position = deal.next_position


@dataclass
class TrainBatch:
    """One micro-batch of one rank, ready for the step.

    frames: uint8 (B, 3, F, H, W) RGB (`vidray.models.vae.uint8_to_video` gives the VAE input in [-1, 1]);
    captions: B strings; sample_ids: B strings; sample_keys: (B,) int64 (keys the per-sample noise); weights: (B,)
    float32, 0 for padding, repeats and skipped clips; plus the plan's step, epoch, bucket, total_weight,
    next_position, micro and num_micro (`RankStep`). data_wait_s: seconds the trainer waited for this batch; prefetch_lead: batches that were ready
    behind it when it was taken; stats: `STAT_KEYS` counters of this batch and its `DECODE_SPAN_KEYS`; skipped:
    [{"file" or "sample_id", "reason"}] first seen in this batch; loader_node: {"node_id", "labels"} of the node its
    decode operator ran on.

    With the encode stages (`RankLoader(encode=...)`, `vidray.data.encode`) frames is None and the batch carries
    latents (B, C_lat, F_lat, H_lat, W_lat) float32, prompt_embeds (B, L, D) float32 and prompt_attention_mask
    (B, L) bool instead, and for an image-to-video model (`model.i2v`) inpaint_latents (B, C_in, F_lat, H_lat,
    W_lat) float32, each clip's condition (`ModelFamily.condition`), and for a model with CLIP image
    embeddings (`model.i2v.image_encoder`) image_embeds (B, T, D_img) float32 (the same call's);
    stage_nodes: {"vae" | "text":
    {"node_id", "labels"}} of the nodes that encoded it, and stats also has the `ENCODE_STAT_KEYS` counters and
    `ENCODE_SPAN_KEYS` of the stages that ran.
    """

    step: int
    epoch: int
    bucket: Bucket
    frames: Any
    captions: list[str]
    sample_ids: list[str]
    sample_keys: np.ndarray
    weights: np.ndarray
    total_weight: float
    next_position: DataPosition
    data_wait_s: float = 0.0
    prefetch_lead: int = 0
    stats: dict[str, float] = field(default_factory=dict)
    skipped: list[dict[str, str]] = field(default_factory=list)
    micro: int = 0
    num_micro: int = 1
    loader_node: dict[str, Any] = field(default_factory=dict)
    latents: Any = None
    prompt_embeds: Any = None
    prompt_attention_mask: Any = None
    stage_nodes: dict[str, Any] = field(default_factory=dict)
    inpaint_latents: Any = None
    image_embeds: Any = None


class ClipLoader:
    """The Ray Data fetch + decode operator (a callable class: one actor per rank's loader).

    Args:
        shards_dir: the shard folder or URI (`vidray.storage`).
        shard_entries: `index.json`'s "shards" list ({file, bytes, sha256, ...}), indexed by the sample table's
            `shard` column.
        plan: {"offsets": (S+1,) int64, "shard": (T,) int32, "row": (T,) int32, "key": (T,) int64, "bucket": (S, 3)
            int32}: step i's clips are entries offsets[i]..offsets[i+1] (flat arrays, one per planned clip).
        cache_dir, cache_bytes: the node's warm cache (used for object stores only).
        hot_bytes: budget of the hot tier (decoded clips), 0 = off.
        prefetch_window: micro-batches ahead whose shards are fetched cold -> warm in the background.
        open_shards: shards kept in memory while walking them.
        local_ranks: training ranks on this node sharing the warm cache (each prefetches within
            cache_bytes / (2 x local_ranks)).
        hash_clips: compute each clip's sha256 (the latent cache's key); off when no encode stage follows.
        latent_cache: root of the latent cache the encode stage reads ("" = none), and vae_id: the identity of its
            VAE (`vidray.data.encode.vae_identity`): a str, or a one-item list holding the ObjectRef of the task
            computing it (never waited for: clips are decoded until it is ready). With both, a clip whose latents
            are cached is not decoded: its latents travel in "cached_latents" and its frames are zeros.
        image_to_video: the encode stage encodes an image-to-video model's condition too (`model.i2v`): a cached
            entry counts only with its condition latents.
        image_embeds: the encode stage also embeds the condition frames with the model's CLIP
            (`model.i2v.image_encoder`): a cached entry counts only with those image embeddings too.

    `__call__({"i": (R,) int64, "n": (R,) int64})` (a block of R rows, each the n planned steps i..i+n-1, all of
    one bucket: `plan_blocks`) returns one row per step, (S,) columns with S = sum(n): {"i", "frames" (S, B, F, H, W, 3) uint8 (each clip decoded straight into
    its slot), "captions" (S,) JSON lists of B str, "clip_sha" (S,) JSON lists of B sha256 hex of the clips' stored
    mp4 bytes ("" for black fill frames or with `hash_clips` off; the latent cache's content key,
    `vidray.data.encode`), with `latent_cache` "cached_latents" (S,) bytes (`vidray.data.encode.pack_cached_latents`
    of the slots read from the cache, b"" for none),
    "ok" (S, B) bool, "skipped" (S,) JSON str, "node" (S,) JSON str {"node_id", "labels"} of the node this
    operator runs on (`vidray.placement`), and one (S,) column per `STAT_KEYS` and `DECODE_SPAN_KEYS`}.
    """

    def __init__(self, shards_dir: str, shard_entries: Sequence[dict[str, Any]], plan: dict[str, np.ndarray], *,
                 cache_dir: str, cache_bytes: int, hot_bytes: int, prefetch_window: int, open_shards: int,
                 local_ranks: int = 1, hash_clips: bool = True, latent_cache: str = "", vae_id: Any = None,
                 image_to_video: bool = False, image_embeds: bool = False):
        from vidray.data.cache import ShardCache  # heavy: pydantic

        self.node = json.dumps(node_info())  # {} outside Ray (`LocalLoader`)
        self.storage = open_storage(shards_dir)
        self.entries = list(shard_entries)
        self.plan = plan
        self.cache = None if self.storage.is_local else ShardCache(cache_dir, cache_bytes)
        self.hot_bytes = int(hot_bytes)
        self.hash_clips = bool(hash_clips)  # the clips' sha256 keys the latent cache: only an encode stage needs it
        self.latent_cache = LatentCache(latent_cache) if latent_cache and self.hash_clips else None
        self.vae_id = vae_id if isinstance(vae_id, str) and vae_id else None
        self.image_to_video = bool(image_to_video)  # cached entries then hold the condition latents too
        self.image_embeds = bool(image_embeds)  # ... and the CLIP image embeddings (Wan 2.1 I2V)
        self._vae_id_ref = vae_id[0] if isinstance(vae_id, (list, tuple)) and vae_id else None
        self.hot: OrderedDict[int, tuple[np.ndarray, str, str]] = OrderedDict()  # key -> (frames, caption, sha256)
        self.hot_used = 0
        self.tables: OrderedDict[int, pa.Table] = OrderedDict()
        self.open_shards = max(1, int(open_shards))
        self.bad_shards: dict[int, str] = {}
        self.reported: set[str] = set()
        self.stats = dict.fromkeys(STAT_KEYS, 0.0)
        self.lock = threading.Lock()
        self.prefetch_window = int(prefetch_window)
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="vidray-decode")
        # This loader's share of the node's warm budget for shards ahead: half of it, split between the ranks of
        # the node (the other half holds the shards being read).
        self.prefetch_bytes = int(cache_bytes) // (2 * max(1, int(local_ranks)))
        self._wanted = -1  # the step index the decoder is at (the prefetcher looks ahead of it)
        self._cond = threading.Condition()
        if self.cache is not None and self.prefetch_window > 0:
            threading.Thread(target=self._prefetch_warm, name="vidray-warm-prefetch", daemon=True).start()

    # -- the warm prefetcher (object stores only) ------------------------------------------------------------

    def _shards_of(self, i: int) -> list[int]:
        o = self.plan["offsets"]
        return list(dict.fromkeys(self.plan["shard"][o[i]:o[i + 1]].tolist()))

    def _prefetch_warm(self) -> None:
        """Fetch the shards of steps [current, current + window] into the warm cache, in plan order. Every shard
        of the window counts once against `prefetch_bytes` (this loader's share of the node's budget: cached or
        not, it will be pinned soon), so prefetching never evicts what the next steps need; shards the decoder
        already holds in memory are skipped."""
        num_steps = len(self.plan["offsets"]) - 1
        failed: set[int] = set()  # not retried by the prefetcher
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._wanted >= 0)
                start = self._wanted
            ahead, counted = 0, set()
            for i in range(start, min(num_steps, start + 1 + self.prefetch_window)):
                for shard in self._shards_of(i):
                    if shard in counted or shard in self.tables or shard in self.bad_shards or shard in failed:
                        continue
                    counted.add(shard)
                    entry = self.entries[shard]
                    ahead += int(entry.get("bytes", 0))
                    if ahead > self.prefetch_bytes:
                        break
                    if self.cache.path(entry["sha256"]).is_file():
                        continue
                    try:
                        self._lease(entry)
                    except Exception:  # noqa: BLE001 - the decoder meets the same error and reports it
                        failed.add(shard)
                if ahead > self.prefetch_bytes:
                    break
            if start >= num_steps - 1:
                return
            with self._cond:
                if self._wanted == start:
                    self._cond.wait(timeout=1.0)

    def _lease(self, entry: dict[str, Any], columns: list[str] | None = None) -> pa.Table | None:
        """Lease `entry` from the warm cache (downloading it on a miss), counting the tier's hit or miss (a miss:
        this loader downloaded it) and the bytes fetched; with `columns`, read them while the shard is pinned."""
        t0 = time.perf_counter()
        with self.cache.lease_info(self.storage, entry) as (path, downloaded):
            table = pq.read_table(path, columns=columns) if columns else None
        with self.lock:
            self.stats["warm_misses" if downloaded else "warm_hits"] += 1
            if downloaded:
                self.stats["bytes_fetched"] += int(entry.get("bytes", 0))
            self.stats["fetch_s"] += time.perf_counter() - t0
        return table

    # -- reading ---------------------------------------------------------------------------------------------

    def _known_vae_id(self) -> str | None:
        """The encode stage's VAE identity, once known (never waits for the task computing it; a task that failed
        leaves it unknown: every clip is decoded, and the encode stage reports the model's error itself)."""
        if self.vae_id is None and self._vae_id_ref is not None:
            import ray  # heavy: ray

            ready, _ = ray.wait([self._vae_id_ref], timeout=0)
            if ready:
                self._vae_id_ref = None
                try:
                    self.vae_id = str(ray.get(ready[0]))
                except Exception:  # noqa: BLE001 - only an optimisation is lost
                    self.vae_id = None
        return self.vae_id

    def _cached_latents(self, rel: str) -> dict[str, np.ndarray] | None:
        """Cache entry `rel`: {"latents"[, "inpaint_latents"[, "image_embeds" (T, D_img)]]} (C, F_lat, H_lat, W_lat)
        float32 (numpy: this
        operator never imports torch), or None (absent, damaged, or without an entry an image-to-video model
        needs: the clip is decoded and the encode stage rewrites the entry)."""
        t0 = time.perf_counter()
        found = self.latent_cache.get(rel, as_numpy=True)
        with self.lock:
            self.stats["decode_s"] += time.perf_counter() - t0
        if found is None or "latents" not in found or (self.image_to_video and "inpaint_latents" not in found) or \
                (self.image_embeds and "image_embeds" not in found):
            return None
        return found

    def _table(self, shard: int) -> pa.Table:
        """The shard's (sample_id, caption, video_mp4) columns in memory (checksum verified when fetched)."""
        from vidray.data.shards import fetch_verified  # heavy: av, PIL

        table = self.tables.get(shard)
        if table is not None:
            self.tables.move_to_end(shard)
            return table
        entry = self.entries[shard]
        columns = ["sample_id", "caption", "video_mp4"]
        if self.cache is not None:
            table = self._lease(entry, columns)
        else:
            t0 = time.perf_counter()
            data = fetch_verified(self.storage, entry)
            table = pq.read_table(pa.BufferReader(data), columns=columns)
            with self.lock:
                self.stats["bytes_fetched"] += len(data)
                self.stats["fetch_s"] += time.perf_counter() - t0
        with self.lock:
            self.stats["shard_reads"] += 1
        self.tables[shard] = table
        while len(self.tables) > self.open_shards:
            self.tables.popitem(last=False)
        return table

    def _lookup(self, key: int, shard: int, row: int, skipped: list[dict[str, str]]):
        """The hot tier's (frames, caption, mp4 sha256) of a clip, else ("miss", sample_id, mp4 bytes, caption) read from its
        shard, or None when the shard cannot be read (recorded in `skipped`)."""
        hit = self.hot.get(key)
        if hit is not None:
            self.hot.move_to_end(key)
            with self.lock:
                self.stats["hot_hits"] += 1
            return hit
        with self.lock:
            self.stats["hot_misses"] += 1
        if shard in self.bad_shards:
            return None
        try:
            table = self._table(shard)
        except Exception as err:  # noqa: BLE001 - checksum failure, store errors after retries, bad Parquet
            reason = str(err) if err.__class__.__name__ == "ShardChecksumError" else \
                f"unreadable after retries: {type(err).__name__}: {err}"
            self.bad_shards[shard] = reason
            skipped.append({"file": self.entries[shard]["file"], "reason": reason})
            return None
        return ("miss", table.column("sample_id")[row].as_py(), table.column("video_mp4")[row].as_py(),
                table.column("caption")[row].as_py())

    def _decode(self, sample_id: str, data: bytes, out: np.ndarray, skipped: list[dict[str, str]]) -> bool:
        """Decode one clip's mp4 bytes into `out`, uint8 (F, H, W, 3) of its bucket (its slot of the batch).
        False when they do not decode to that shape (recorded once). Runs on the loader's decode threads (PyAV
        releases the GIL while decoding)."""
        from vidray.data.video import decode_mp4  # heavy: av, PIL

        t0 = time.perf_counter()
        try:
            decode_mp4(data, out=out)
            return True
        except Exception as err:  # noqa: BLE001 - MediaError (or a frame count or size off its bucket): skip
            with self.lock:
                if sample_id not in self.reported:
                    self.reported.add(sample_id)
                    skipped.append({"sample_id": sample_id, "reason": f"{type(err).__name__}: {err}"})
            return False
        finally:
            with self.lock:
                self.stats["decode_s"] += time.perf_counter() - t0

    def _clips(self, keys, shards, rows, frames: np.ndarray, skipped: list[dict[str, str]],
               cached: dict[int, Any]) -> list:
        """Fill `frames`, uint8 (B, F, H, W, 3), with a micro-batch's clips: hot hits copied, misses whose latents
        the latent cache holds put in `cached` ({slot: latents}, their frames zeroed), the other misses decoded
        into their slots two at a time. Returns per slot (caption, mp4 sha256 or "") or None (not delivered: its
        slot is left as it is)."""
        found: list = []
        first_slot: dict[int, int] = {}  # key -> the slot that decodes it (a clip repeated in the batch: once)
        for k, s, r in zip(keys, shards, rows):
            k = int(k)
            if k in first_slot:
                with self.lock:
                    self.stats["hot_hits"] += 1
                found.append(first_slot[k])
                continue
            first_slot[k] = len(found)
            found.append(self._lookup(k, int(s), int(r), skipped))
        for j, f in enumerate(found):
            if isinstance(f, tuple) and len(f) == 3:  # a hot hit: (frames, caption, sha256)
                frames[j] = f[0]
                found[j] = f[1:]
        misses = [j for j, f in enumerate(found) if isinstance(f, tuple) and len(f) == 4]  # ("miss", id, mp4, caption)
        sha = {j: hashlib.sha256(found[j][2]).hexdigest() if self.hash_clips else "" for j in misses}
        vae_id = self._known_vae_id() if self.latent_cache is not None else None
        if vae_id and misses:
            bucket = tuple(frames.shape[1:4])
            hits = self._pool.map(lambda j: self._cached_latents(LatentCache.latents_entry(vae_id, sha[j], bucket)),
                                  misses)
            for j, entry in zip(misses, list(hits)):
                if entry is not None:
                    cached[j] = entry
                    frames[j] = 0
                    found[j] = (found[j][3], sha[j])
            with self.lock:
                self.stats["decodes_skipped"] += sum(j in cached for j in misses)
            misses = [j for j in misses if j not in cached]
        decoded = self._pool.map(lambda j: self._decode(found[j][1], found[j][2], frames[j], skipped), misses)
        for j, ok in zip(misses, list(decoded)):
            caption = found[j][3]
            found[j] = (caption, sha[j]) if ok else None
            if ok and self.hot_bytes and frames[j].nbytes <= self.hot_bytes:
                key = int(keys[j])
                if key not in self.hot:
                    self.hot[key] = (frames[j].copy(), caption, sha[j])  # its own memory: the batch goes to Ray
                    self.hot_used += frames[j].nbytes
                while self.hot_used > self.hot_bytes:
                    _, (old, _, _) = self.hot.popitem(last=False)
                    self.hot_used -= old.nbytes
        for j, f in enumerate(found):
            if isinstance(f, int):  # a repeat: its first slot's clip
                if found[f] is not None:
                    frames[j] = frames[f]
                if f in cached:
                    cached[j] = cached[f]
                found[j] = found[f]
        return found

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One Ray Data block: rows {"i", "n"} (steps i..i+n-1 of the plan, one bucket) -> n output rows."""
        return concat_rows([self._step(i) for first, n in zip(batch["i"].tolist(), batch["n"].tolist())
                            for i in range(int(first), int(first) + int(n))])

    def close(self) -> None:
        """End the decode threads (an actor's end does it under Ray Data; `LocalLoader` calls it per window)."""
        self._pool.shutdown(wait=True)

    def _step(self, i: int) -> dict[str, np.ndarray]:
        """Planned step `i`: one output row (the class docstring's columns)."""
        started = time.time()  # wall clock: the span of this micro-batch's work (DECODE_SPAN_KEYS)
        with self._cond:
            self._wanted = i
            self._cond.notify_all()
        o = self.plan["offsets"]
        shards = self.plan["shard"][o[i]:o[i + 1]]
        rows = self.plan["row"][o[i]:o[i + 1]]
        keys = self.plan["key"][o[i]:o[i + 1]]
        bucket = Bucket(*(int(x) for x in self.plan["bucket"][i]))
        skipped: list[dict[str, str]] = []
        frames = np.empty((len(keys), *bucket, 3), np.uint8)  # (B, F, H, W, 3), filled in place
        cached: dict[int, Any] = {}  # slot -> latents read from the latent cache (its clip was not decoded)
        clips = self._clips(keys, shards, rows, frames, skipped, cached)
        ok = np.array([c is not None for c in clips])
        good = int(np.argmax(ok)) if ok.any() else -1
        for j in np.flatnonzero(~ok):  # a slot not delivered repeats a delivered clip (weight 0), else zeros
            frames[j] = frames[good] if good >= 0 else 0
            if good in cached:
                cached[int(j)] = cached[good]
        fill = clips[good] if good >= 0 else ("", "")  # its caption and key too: an encode stage then hits
        clips = [c if c is not None else fill for c in clips]
        with self.lock:
            stats, self.stats = self.stats, dict.fromkeys(STAT_KEYS, 0.0)
        out = {
            "i": np.array([i]),
            "frames": frames[None],
            "captions": np.array([json.dumps([c[0] for c in clips])]),
            "clip_sha": np.array([json.dumps([c[1] for c in clips])]),
            "ok": ok[None],
            "skipped": np.array([json.dumps(skipped)], dtype=object),
            "node": np.array([self.node], dtype=object),
        }
        if self.latent_cache is not None:
            out["cached_latents"] = np.array([pack_cached_latents(self.vae_id or "", cached)], dtype=object)
        out.update({k: np.array([v], dtype=np.float64) for k, v in stats.items()})
        out.update({k: np.array([v], dtype=np.float64) for k, v in zip(DECODE_SPAN_KEYS, (started, time.time()))})
        return out


BLOCK_BYTES = 32 * 2**20
"""Most bytes of decoded frames (uint8) in one Ray Data block of the loader (`plan_blocks`): a micro-batch larger
than this travels alone."""


def plan_blocks(buckets: np.ndarray, clips_per_step: np.ndarray, max_batches: int,
                max_bytes: int = BLOCK_BYTES) -> list[tuple[int, int]]:
    """Group a window's planned steps (micro-batches) into Ray Data blocks: [(first step, count), ...] in order.

    A block holds consecutive steps of one bucket, at most `max_batches` of them and, beyond its first, only while
    their frames (uint8 B x F x H x W x 3 per step) stay within `max_bytes`. Sizes start at 1 and double
    (1, 2, 4, ... `max_batches`), so the first step waits for one micro-batch, not a whole block.

    buckets: (S, 3) int [num_frames, height, width] per step; clips_per_step: (S,) int clips per micro-batch.
    Raises ValueError when max_batches < 1.
    """
    if max_batches < 1:
        raise ValueError(f"max_batches must be >= 1, got {max_batches}")
    num_steps = len(buckets)
    step_bytes = np.prod(np.asarray(buckets, np.int64), axis=1) * 3 * np.asarray(clips_per_step, np.int64)
    blocks: list[tuple[int, int]] = []
    first, size = 0, 1
    while first < num_steps:
        n = 1
        while (n < size and first + n < num_steps and (buckets[first + n] == buckets[first]).all()
               and int(step_bytes[first:first + n + 1].sum()) <= max_bytes):
            n += 1
        blocks.append((first, n))
        first += n
        size = min(2 * size, int(max_batches))
    return blocks


class RankLoader:
    """Iterator of this rank's `TrainBatch`es for the planned `steps`, streamed by Ray Data (module docstring).

    Args:
        shards_dir: folder or URI of the prepared shards; index: its `index.json` dict.
        table: the sample table (`SampleIndex`); steps: this rank's `RankStep`s (micro-batches: several per
            step when G > W) in order: a list (`plan_rank_steps`) or a lazy iterable (`iter_rank_steps`, for long
            runs). One `TrainBatch` is delivered per `RankStep`.
        data: the job's `DataConfig` (cache_dir, cache_bytes, hot_bytes, prefetch_batches,
            prefetch_window_batches, loader_cpus, shuffle_block_shards).
        sample_ids: (N,) str ids of the table's rows (`table.sample_id.astype(str)`), or None to derive them.
        local_ranks: training ranks on this node (they share the warm cache's budget).
        label_selector: Ray label selector of the nodes the decode operator may run on (`placement.decode`,
            resolved by `vidray.placement.resolve_placement`), or None: anywhere.
        encode: None (deliver frames and captions), or the encode stages to chain after the decode operator
            (`vidray.data.encode.EncodeStage`; deliver latents and prompt_embeds): {"model": ModelConfig dict,
            "seed", "max_sequence_length", "latent_cache": root or "", "vae": {"label_selector", "num_cpus",
            "num_gpus", "memory"}, "text": {same}} (`encode_spec`), optionally "identities" (the encoders'
            `encoder_identity_refs`, when the caller has them; else, with a latent cache, the loader starts those
            tasks itself). Once the VAE's identity is known, the decode operator skips clips whose latents are
            cached; the encode stages load an encoder only on a cache miss.
        window_steps: `RankStep`s (micro-batches) per Ray Data dataset. The steps are streamed in windows of this
            many (blocks of up to `data.block_batches` consecutive steps, `plan_blocks`, planned when the window
            starts), so a run of 100 000 steps never plans or materialises them all
            at once; each window starts a fresh loader actor (a few seconds, overlapped with the previous window's
            queue) whose hot tier starts empty.
    Ray must be initialised (a Ray Train worker, or a driver after `ray.init`). Errors in the operator (other
    than skipped shards and clips) are raised by `__next__`. Call `close()` (or exhaust it) to stop its thread.
    """

    def __init__(self, shards_dir: str, index: dict[str, Any], table: Any, steps: Iterable[RankStep], data: Any,
                 sample_ids: np.ndarray | None = None, local_ranks: int = 1, window_steps: int = 2048,
                 label_selector: dict[str, str] | None = None, encode: dict[str, Any] | None = None):
        self.sample_ids = table.sample_id.astype(str) if sample_ids is None else sample_ids
        self.sample_keys = table.sample_key
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, int(data.prefetch_batches)))
        self._stop = threading.Event()
        self._done = False
        self._args = (str(shards_dir), index, table, data, int(local_ranks))
        self._label_selector = dict(label_selector) if label_selector else None
        self._encode = encode
        self._steps = iter(steps)
        self._identities: dict[str, Any] = {}  # {stage: str or [ObjectRef] of its identity task}: set at the start
        self._window_steps = max(1, int(window_steps))
        self._thread = threading.Thread(target=self._run, name="vidray-rank-loader", daemon=True)
        self._thread.start()

    def _dataset(self, window: list[RankStep]):
        shards_dir, index, table, data, local_ranks = self._args
        return self._build(shards_dir, index, window_plan(window, table), data, local_ranks, self._label_selector,
                           self._encode, self._identities)

    @staticmethod
    def _build(shards_dir: str, index: dict[str, Any], plan: dict[str, np.ndarray], data: Any, local_ranks: int,
               label_selector: dict[str, str] | None = None, encode: dict[str, Any] | None = None,
               identities: dict[str, Any] | None = None):
        import ray.data  # heavy: ray, pyarrow, numpy
        from ray.data import DataContext  # heavy: ray, pyarrow, numpy
        from ray.data._internal.execution.interfaces import ExecutionResources  # heavy: ray, pyarrow, numpy

        ctx = DataContext.get_current()
        ctx.execution_options.preserve_order = True
        operators = encode_operators(encode) if encode else []
        ctx.execution_options.resource_limits = ExecutionResources(
            cpu=float(data.loader_cpus) + sum(op["num_cpus"] for op in operators),
            gpu=sum(op["num_gpus"] for op in operators))
        ctx.enable_progress_bars = False
        ctx.print_on_execution_start = False
        quiet_ray_data()  # its "Progress bars disabled" warning (vidray.logs)
        # Ray Data starts a thread per map task that polls the process's USS (psutil reads /proc/<pid>/smaps), for
        # its stats only; on cached latents that polling took more of an encode stage actor's samples (py-spy)
        # than the stage's own calls. Off (DataContext: None = map tasks record no memory stats).
        ctx.memory_usage_poll_interval_s = None
        blocks = plan_blocks(plan["bucket"], np.diff(plan["offsets"]), int(data.block_batches))
        items = ray.data.from_items([{"i": first, "n": n} for first, n in blocks], override_num_blocks=len(blocks))
        with warnings.catch_warnings():  # max_restarts has no named parameter in Ray 2.60 (see NO_ACTOR_RESTARTS)
            warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
            dataset = items.map_batches(
                ClipLoader,
                batch_size=1,  # one row of `items`: a block of n steps
                batch_format="numpy",
                compute=ray.data.ActorPoolStrategy(size=1),
                num_cpus=float(data.loader_cpus),
                **({"label_selector": label_selector} if label_selector else {}),
                zero_copy_batch=True,
                max_restarts=0,  # see NO_ACTOR_RESTARTS
                fn_constructor_args=(str(shards_dir), index["shards"], plan),
                fn_constructor_kwargs=clip_loader_kwargs(data, local_ranks, encode, identities),
            )
            for op in operators:  # the encode stages, each one actor on the nodes its placement allows
                dataset = dataset.map_batches(
                    EncodeStage,
                    batch_size=None,  # the decode operator's whole block
                    batch_format="numpy",
                    compute=ray.data.ActorPoolStrategy(size=1),
                    num_cpus=op["num_cpus"],
                    **({"num_gpus": op["num_gpus"]} if op["num_gpus"] else {}),
                    **({"memory": op["memory"]} if op.get("memory") else {}),
                    **({"label_selector": op["label_selector"]} if op["label_selector"] else {}),
                    zero_copy_batch=True,
                    max_restarts=0,  # see NO_ACTOR_RESTARTS
                    fn_constructor_args=(op["what"], encode["model"], int(encode["seed"])),
                    fn_constructor_kwargs=encode_stage_kwargs(op, encode, data, identities),
                )
        return dataset

    def _run(self) -> None:
        try:
            if self._encode and self._encode.get("latent_cache"):
                self._identities = self._encode.get("identities") or encoder_identity_refs(self._encode)
            for window in windows(self._steps, self._window_steps):
                dataset = self._dataset(window)
                batches = dataset.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=1)
                i = -1
                for block in batches:  # a block of consecutive micro-batches (`plan_blocks`): one row each
                    for row in block_rows(block):
                        if self._stop.is_set():
                            return
                        i += 1
                        if int(row["i"][0]) != i:
                            raise RuntimeError(f"the loader delivered batch {int(row['i'][0])} of its window "
                                               f"where {i} was due (Ray Data lost the order)")
                        self._put(("batch", (window[i], row)))
                if i != len(window) - 1:
                    raise RuntimeError(f"the loader ended after {i + 1} of {len(window)} planned batches")
            self._put(("end", None))
        except BaseException as err:  # noqa: BLE001 - handed to the consumer, raised by __next__
            self._put(("error", err))

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def __iter__(self) -> Iterator[TrainBatch]:
        return self

    def __next__(self) -> TrainBatch:
        if self._done:
            raise StopIteration
        t0 = time.perf_counter()
        kind, item = self._queue.get()
        wait = time.perf_counter() - t0
        lead = self._queue.qsize()
        if kind == "error":
            self.close()
            raise item
        if kind == "end":
            self._done = True
            raise StopIteration
        plan, batch = item
        return train_batch(plan, batch, self.sample_ids, self.sample_keys, data_wait_s=wait, prefetch_lead=lead)

    def close(self) -> None:
        """Stop the background thread (the Ray Data executor shuts down with its iterator)."""
        self._stop.set()
        self._done = True
        if self._thread is not None:
            try:
                while True:
                    self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=10)



class LocalLoader:
    """`RankLoader` in this process: the same plan, the same `ClipLoader` and `EncodeStage` operators called in
    order on each block (`plan_blocks`), the same `TrainBatch`es; no Ray, no background thread (a batch is made
    when the trainer asks for it, so `data_wait_s` is the time it took). What an in-process `Worker`
    (`vidray.train.context.LocalContext`) and the unit tests use. Same arguments as `RankLoader`; `label_selector`
    is ignored (one process, one node). The encoders are built once, on the first cache miss, and kept across
    windows; with a latent cache the decode operator knows the VAE's identity from the start (computed here, which
    builds the VAE once), so clips whose latents are cached are not decoded."""

    def __init__(self, shards_dir: str, index: dict[str, Any], table: Any, steps: Iterable[RankStep], data: Any,
                 sample_ids: np.ndarray | None = None, local_ranks: int = 1, window_steps: int = 2048,
                 label_selector: dict[str, str] | None = None, encode: dict[str, Any] | None = None):
        del label_selector  # one process: no placement
        self.sample_ids = table.sample_id.astype(str) if sample_ids is None else sample_ids
        self.sample_keys = table.sample_key
        self._args = (str(shards_dir), index, table, data, int(local_ranks))
        self._encode = encode
        self._steps = iter(steps)
        self._window_steps = max(1, int(window_steps))
        self._stages: list[Any] | None = None
        self._rows = self._generate()

    def _make_stages(self) -> tuple[list[Any], dict[str, str]]:
        """The encode operators of `encode` (`encode_operators`) as plain objects, and the identities the decode
        operator needs to skip cached clips ({"vae": id} with a latent cache, else {})."""
        encode, data = self._encode, self._args[3]
        if not encode:
            return [], {}
        stages = [EncodeStage(op["what"], encode["model"], int(encode["seed"]),
                              **encode_stage_kwargs(op, encode, data, None)) for op in encode_operators(encode)]
        vae = next((stage for stage in stages if stage.do_vae), None)
        identities = {"vae": vae.vae_id} if encode.get("latent_cache") and vae is not None else {}
        return stages, identities

    def _generate(self) -> Iterator[tuple[RankStep, dict[str, np.ndarray]]]:
        shards_dir, index, table, data, local_ranks = self._args
        stages, identities = self._make_stages()
        for window in windows(self._steps, self._window_steps):
            plan = window_plan(window, table)
            clip_loader = ClipLoader(shards_dir, index["shards"], plan,
                                     **clip_loader_kwargs(data, local_ranks, self._encode, identities))
            try:
                for first, n in plan_blocks(plan["bucket"], np.diff(plan["offsets"]), int(data.block_batches)):
                    block = clip_loader({"i": np.array([first]), "n": np.array([n])})
                    for stage in stages:
                        block = stage(block)
                    for row in block_rows(block):
                        yield window[int(row["i"][0])], row
            finally:
                clip_loader.close()

    def __iter__(self) -> Iterator[TrainBatch]:
        return self

    def __next__(self) -> TrainBatch:
        t0 = time.perf_counter()
        plan, row = next(self._rows)  # StopIteration at the end of the plan
        return train_batch(plan, row, self.sample_ids, self.sample_keys, data_wait_s=time.perf_counter() - t0)

    def close(self) -> None:
        """Stop making batches (the decode operator's threads end with its window)."""
        self._rows.close()


def windows(steps: Iterator[RankStep], window_steps: int) -> Iterator[list[RankStep]]:
    """`steps` in lists of `window_steps` (the last one shorter), taken lazily: one loader window each."""
    while window := list(itertools.islice(steps, window_steps)):
        yield window


def window_plan(window: list[RankStep], table: Any) -> dict[str, np.ndarray]:
    """The decode operator's plan of a window of steps (`ClipLoader`'s `plan` argument): flat arrays of the
    clips' shard, row and key, each step's offsets into them and its bucket."""
    rows = [s.rows for s in window]
    flat = np.concatenate(rows)
    return {
        "offsets": np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64),
        "shard": table.shard[flat].astype(np.int32),
        "row": table.row[flat].astype(np.int32),
        "key": table.sample_key[flat].astype(np.int64),
        "bucket": np.array([tuple(s.bucket) for s in window], dtype=np.int32),
    }


def clip_loader_kwargs(data: Any, local_ranks: int, encode: dict[str, Any] | None,
                       identities: dict[str, Any] | None) -> dict[str, Any]:
    """`ClipLoader`'s keyword arguments for a job's `data` section and encode spec (`encode_spec`, or None)."""
    operators = encode_operators(encode) if encode else []
    return {
        "cache_dir": data.cache_dir,
        "cache_bytes": int(data.cache_bytes),
        "hot_bytes": int(data.hot_bytes),
        "prefetch_window": int(data.prefetch_window_batches),
        "open_shards": 2 * int(data.shuffle_block_shards) + 2,
        "local_ranks": int(local_ranks),
        "hash_clips": bool(operators),
        "latent_cache": str(encode.get("latent_cache") or "") if encode else "",
        "vae_id": (identities or {}).get("vae"),
        "image_to_video": bool(encode and (encode["model"].get("i2v"))),
        "image_embeds": bool(encode and (encode["model"].get("i2v") or {}).get("image_encoder")),
    }


def encode_stage_kwargs(op: dict[str, Any], encode: dict[str, Any], data: Any,
                        identities: dict[str, Any] | None) -> dict[str, Any]:
    """`EncodeStage`'s keyword arguments for one of `encode_operators(encode)`."""
    return {
        "max_sequence_length": int(encode["max_sequence_length"]),
        "latent_cache": str(encode.get("latent_cache") or ""),
        "hot_bytes": int(data.hot_bytes),
        "num_gpus": op["num_gpus"],
        "torch_threads": max(1, int(round(op["num_cpus"]))),
        "identities": identities or {},
        "storage": dict(encode.get("storage") or {}),
    }


def train_batch(plan: RankStep, batch: dict[str, np.ndarray], sample_ids: np.ndarray, sample_keys: np.ndarray, *,
                data_wait_s: float, prefetch_lead: int = 0) -> TrainBatch:
    """The `TrainBatch` of one loader row (the decode operator's columns, after the encode stages) for its
    planned step `plan`; tensors share the row's memory (no copy)."""
    import torch  # heavy: torch

    ok = batch["ok"][0]
    frames = latents = inpaint_latents = image_embeds = prompt_embeds = prompt_attention_mask = None
    with warnings.catch_warnings():  # Ray's zero-copy arrays are read-only; the step never writes to them
        warnings.simplefilter("ignore", UserWarning)
        if "frames" in batch:
            frames = torch.from_numpy(batch["frames"][0]).permute(0, 4, 1, 2, 3)  # (B, 3, F, H, W), no copy
        if "latents" in batch:
            latents = torch.from_numpy(batch["latents"][0])  # (B, C, F_lat, H_lat, W_lat)
        if "inpaint_latents" in batch:
            inpaint_latents = torch.from_numpy(batch["inpaint_latents"][0])  # (B, C_in, F_lat, H_lat, W_lat)
        if "image_embeds" in batch:
            image_embeds = torch.from_numpy(batch["image_embeds"][0])  # (B, T, D_img)
        if "prompt_embeds" in batch:
            prompt_embeds = torch.from_numpy(batch["prompt_embeds"][0])  # (B, L, D)
            prompt_attention_mask = torch.from_numpy(batch["prompt_attention_mask"][0])  # (B, L)
    stage_nodes = {stage: json.loads(str(batch[f"{stage}_node"][0]))
                   for stage in ("vae", "text") if f"{stage}_node" in batch}
    return TrainBatch(
        step=plan.step,
        epoch=plan.epoch,
        bucket=plan.bucket,
        frames=frames,
        captions=json.loads(str(batch["captions"][0])),
        sample_ids=sample_ids[plan.rows].tolist(),
        sample_keys=sample_keys[plan.rows],
        weights=plan.weights * ok,
        total_weight=plan.total_weight,
        next_position=plan.next_position,
        data_wait_s=data_wait_s,
        prefetch_lead=prefetch_lead,
        stats={k: float(batch[k][0]) for k in (*STAT_KEYS, *DECODE_SPAN_KEYS, *ENCODE_STAT_KEYS,
                                               *ENCODE_SPAN_KEYS) if k in batch},
        skipped=json.loads(str(batch["skipped"][0])),
        micro=plan.micro,
        num_micro=plan.num_micro,
        loader_node=json.loads(str(batch["node"][0])),
        latents=latents,
        prompt_embeds=prompt_embeds,
        prompt_attention_mask=prompt_attention_mask,
        stage_nodes=stage_nodes,
        inpaint_latents=inpaint_latents,
        image_embeds=image_embeds,
    )


def encode_spec(job: Any, placement: dict[str, Any] | None = None, *, latent_cache: str = "") -> dict[str, Any]:
    """`RankLoader(encode=...)` of a job: its model section and seed, `model.max_sequence_length`, the latent cache
    root (`latent_cache`, "" = none) and the vae / text stages' selectors (`placement`: {stage: selector},
    resolved by `vidray.placement.resolve_placement`; else the job's own) and resources (`placement.vae|text`)."""
    placement = placement if placement is not None else {
        stage: getattr(job.placement, stage).label_selector for stage in ("vae", "text")}
    spec: dict[str, Any] = {"model": dataclasses.asdict(job.model), "seed": int(job.train.seed),
                            "max_sequence_length": int(job.model.max_sequence_length),
                            "latent_cache": str(latent_cache or "")}
    for stage in ("vae", "text"):
        cfg = getattr(job.placement, stage)
        spec[stage] = {"label_selector": dict(placement.get(stage) or {}), "num_cpus": float(cfg.num_cpus),
                       "num_gpus": float(cfg.num_gpus), "memory": int(cfg.memory)}
    # The encoders' storage dtype per stage (`memory.storage_dtype`; auto: bf16 on a GPU stage, fp32 on CPU): it
    # names their cache entries (`vidray.data.encode.stored_identity`). Only when not all fp32 (earlier specs).
    storage = {stage: (job.memory.storage_dtype if job.memory.storage_dtype != "auto" else
                       "bf16" if spec[stage]["num_gpus"] > 0 else "fp32") for stage in ("vae", "text")}
    if set(storage.values()) != {"fp32"}:
        spec["storage"] = storage
    return spec


_IDENTITY_REFS: dict[tuple[str, ...], list[Any]] = {}
"""`encoder_identity_refs`' memo: {(node id, job id, stage, memo key, selector): [ObjectRef] or str}."""


def encoder_identity_refs(encode: dict[str, Any]) -> dict[str, Any]:
    """{"vae": identity, "text": identity} of an encode spec's encoders, each the str remembered in the latent cache
    (`vidray.data.identities`: a run whose encoders are unchanged since one that computed them starts no task), or
    else a one-item list holding the ObjectRef of a Ray task computing it (`identity_task`, which remembers it) on
    the nodes its stage's `label_selector` allows (those hold the model files). The tasks ask for no CPU: they run
    once, for a few seconds (each loads its encoder alone), and must not wait behind the stage actors that hold
    the CPUs. With them the decode operator finds cached latents before it decodes, and the encode stages name
    their cache entries without loading an encoder until a miss (`vidray.data.encode.EncodeStage`).

    Also memoized in this process per Ray cluster and driver (node and job id), stage inputs (`memo_key`: model
    section, seed, a pretrained folder's file sizes and mtimes, library versions and encoder code) and selector:
    later runs of one driver (a notebook, a test session) reuse the refs."""
    import ray  # heavy: ray

    runtime = ray.get_runtime_context()
    files = model_files_signature(encode["model"])
    cache_root = str(encode.get("latent_cache") or "")
    refs: dict[str, Any] = {}
    for stage in ("vae", "text"):
        selector = encode[stage].get("label_selector") or {}
        storage = (encode.get("storage") or {}).get(stage, "fp32")
        key = memo_key(stage, encode["model"], int(encode["seed"]), files, storage)
        process_key = (runtime.get_node_id(), runtime.get_job_id(), key, json.dumps(selector, sort_keys=True))
        if process_key not in _IDENTITY_REFS:
            remembered = read_identity(cache_root, key) if cache_root else None
            if remembered is not None:
                _IDENTITY_REFS[process_key] = remembered
            else:
                task = ray.remote(num_cpus=0, max_retries=0)(identity_task)
                _IDENTITY_REFS[process_key] = [task.options(
                    name=f"{stage}_identity", **({"label_selector": selector} if selector else {})).remote(
                    stage, encode["model"], int(encode["seed"]), cache_root, key, storage)]
        refs[stage] = _IDENTITY_REFS[process_key]
    return refs


def encode_operators(encode: dict[str, Any]) -> list[dict[str, Any]]:
    """The encode operators of a spec, in order: one "vae+text" when both stages ask for the same selector and
    resources (one actor holding both stages' CPUs and GPUs: one process and one model load less), else "vae"
    then "text". Each {"what", "label_selector", "num_cpus", "num_gpus", "memory"}."""
    vae, text = encode["vae"], encode["text"]
    if vae == text:
        return [{"what": "vae+text", "label_selector": vae["label_selector"], "num_cpus": 2 * vae["num_cpus"],
                 "num_gpus": 2 * vae["num_gpus"], "memory": 2 * vae["memory"]}]
    return [{"what": "vae", **vae}, {"what": "text", **text}]
