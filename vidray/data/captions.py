"""Captions of prepared shards against a model's tokenizer: what the driver prints before a training run."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from vidray.data.shards import iter_samples
from vidray.models.text_encoder import TruncationStats, build_tokenizer, caption_truncation

if TYPE_CHECKING:
    from vidray.config import ModelConfig

__all__ = ["shards_caption_truncation"]


def shards_caption_truncation(shards_dir: str | Path, model: "ModelConfig") -> TruncationStats:
    """`caption_truncation` of every caption in the prepared shards of `shards_dir`, for `model`'s tokenizer and
    `model.max_sequence_length`. Reads only the Parquet `caption` column (no video bytes) and no model weights.

    Raises like `vidray.data.shards.read_index` (no index: run `vidray prepare`).
    """
    # Shards failing their checksum are left out here; training skips and reports them.
    captions = [row["caption"] for row in iter_samples(shards_dir, columns=["caption"], skipped=[])]
    return caption_truncation(build_tokenizer(model), captions, model.max_sequence_length, counted="clips' captions")
