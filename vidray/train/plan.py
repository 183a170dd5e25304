"""The memory planner: per-rank bytes of a training step, from shapes and dtypes alone (no Ray, no allocation), for
each way vidray can train a transformer; which fit a GPU; which to pick. `vidray plan` prints it, `vidray doctor`
and `vidray train` refuse a job predicted not to fit before any GPU is reserved (`check_fits`).

What one rank holds during a steady-state step (forward, backward, fused AdamW step; `vidray.train.loop`):

| term | bytes per rank | notes |
|---|---|---|
| parameters | 4 P (fp32 master weights, also under bf16 autocast) | fsdp: 4 P / n + the unsharded block(s) being computed |
| frozen base (LoRA) | P x 4 / 2 bytes in `memory.storage_dtype` fp32 / bf16; fp8: 1 byte a castable parameter (Linear / conv outside diffusers' layerwise-casting skip patterns), 2 for the rest; the adapters 4 bytes (fp32 masters) | fp8 under autocast also keeps a bf16 copy of each castable weight it computed with until the backward (measured: `benchmarks/_memory_planner.py`); with AC only the recomputed block's; bf16 keeps none |
| block swap N (LoRA, not fsdp) | device: the frozen base minus the last N blocks' bytes, plus 2 of them in flight | host: the N blocks' bytes, pinned (musubi-tuner's `blocks_to_swap`) |
| activation offload (AC) | device: no block inputs, the latent-sized loss tensors only outside the blocks; the recomputed block as before | host: every block's inputs + the token-wide tensors saved outside the blocks, once per rank (`vidray.train.step.ActivationOffload`, torch's `save_on_cpu`; torchtune's `enable_activation_offloading`) |
| FSDP CPU offload | device: the gathered blocks + one block's unsharded gradients; no optimizer state | host: the shard of the fp32 parameters, gradients and AdamW state (FSDP2 `CPUOffloadPolicy`) |
| gradients | 4 P_train | fsdp: 4 P_train / n + one unsharded block's; ddp adds its buckets, 4 P_train more |
| optimizer | 8 P_train (AdamW exp_avg + exp_avg_sq, fp32) | fsdp: / n |
| activations | sum over blocks of what autograd saves (`block_activation_bytes`) + the rest of the model | AC: the blocks' inputs + one block recomputed |
| context parallel cp (`parallel.context`) | the blocks' activations, checkpointed inputs and backward temporaries over n_video / cp tokens (+ text / cp where text goes through the blocks); outside the blocks the patch embedding, text projection and latent-sized loss tensors stay whole | parameters, gradients and optimizer state unchanged; traffic: `context_traffic_bytes` |
| encoders | frozen VAE + text encoder weights, when their stage shares the trainer's GPU, in the row's storage dtype | `placement.vae/text.num_gpus` in (0, 1) |
| host (checked per node) | the pinned host bytes above x the ranks on a node (min(GPUs, 8)) <= 70 % of the node's memory (`HOST_HEADROOM`: Ray's object store takes 30 % by default) | `vidray plan --host-memory`, `$VIDRAY_HOST_MEMORY`, else this machine's memory |

P: the transformer's parameters, counted exactly by building the diffusers class on the meta device; P_train: those
that get a gradient (all, minus the last MMDiT block's unused text-output path; LoRA: the adapters,
rank x (in + out) per targeted Linear). The peak is the largest of three moments, each simulated block by block:
the end of the forward (all activations, no gradients: `zero_grad(set_to_none=True)` runs before it), each block's
backward (activations of the blocks below it, gradients of those above, plus that block's backward temporaries) and
the optimizer step (parameters + gradients + optimizer state; the fused kernel adds nothing). Under bf16 autocast
the forward also saves a bf16 copy of every Linear weight it casts (2 bytes a weight, freed block by block in the
backward); with activation checkpointing and full fine-tuning, autocast's weight cache holds those copies until the
forward ends instead. One micro-batch per rank: `train.micro_batches_per_step` above the worker count adds the
gradients to the forward's moment (accumulation); that case is counted.

Per-block activations (`block_activation_bytes`) are a census of the tensors autograd saves, per token, derived
with `vidray.train.memory.saved_tensor_census` on diffusers 0.42.1 / torch 2.13 blocks and checked against it in
`tests/unit/test_plan.py`; attention is a fused kernel (flash / memory-efficient on GPU, the flash CPU kernel on
CPU): no (tokens x tokens) matrix is kept. The whole step is checked against `measure_training_step` (tensor
bytes, not RSS) for the tiny and medium presets: within 15 % in every strategy a CPU runs (fp32 / bf16 x plain,
AC, LoRA, LoRA + AC). FSDP is not measured on CPU in tests: its terms are the DDP ones divided by the world size
plus the unsharded block (`fully_shard` per block, `reshard_after_forward=True`: one block gathered and the next
prefetched, in the parameter dtype).

Each strategy is listed in each memory mode it runs (`strategy_modes`: fp32 rows keep fp32; bf16 rows store the
frozen weights in bf16, LoRA also in fp8 and fp8 + the fewest swapped blocks that fit, full FSDP also with CPU
offload, LoRA + AC also fp8 + activation offload with the fewest swapped blocks that fit, none included). The
pick: full fine-tuning before LoRA (a full fine-tune with CPU offload is still the run asked for), then
the modes by transfer per step (`MemoryMode.transfer_rank`): bf16 / fp32 storage (bf16 storage of a frozen base is
free under bf16 autocast, which computes in bf16 anyway) < fp8 storage (no transfer, a measured quality cost) <
context parallel (the smallest degree that fits, for a family whose card has `context_parallel`: all-to-alls within
the node every layer, and the data-parallel width divided by it) < block swap (host-to-device traffic every step) < activation offload (the saved activations to the host in the forward and
back in the backward, every step) < FSDP CPU offload (parameters, gradients and the optimizer step through
host memory), then the strategies, in order of communication per step (least first), the first that fits with
`HEADROOM` spare (and the node's host memory) is picked: ddp (one all-reduce of the gradients) < fsdp (all-gather of the parameters twice plus a
reduce-scatter: ~1.5x ddp's bytes) < fsdp+AC (the same traffic plus a second forward: ~33 % more compute) < lora (a
full-model forward and backward for a few MB of adapters: cheap, but it trains another thing) < lora+AC < fsdp+lora
(the base sharded too: its all-gathers again, for adapters only) < fsdp+lora+AC. bf16 comes before fp32 within
each (it is what GPU training uses; fp32 is listed for reference).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from vidray.cards import get_card
from vidray.config import LoraConfig
from vidray.buckets import Bucket
from vidray.errors import UserError
from vidray.models.presets import ShapePreset, meta_model, model_preset, planner_facts, preset_from_pretrained

__all__ = [
    "ActivationBytes",
    "HEADROOM",
    "HOST_HEADROOM",
    "MemoryEstimate",
    "MemoryMode",
    "ModelCounts",
    "PlanReport",
    "STRATEGIES",
    "Strategy",
    "block_activation_bytes",
    "check_cluster_fits",
    "check_fits",
    "cluster_gpu_memory_bytes",
    "context_degrees",
    "context_step_traffic_bytes",
    "context_traffic_bytes",
    "count_model",
    "estimate_memory",
    "format_bytes",
    "format_report",
    "frozen_bytes",
    "host_memory_bytes",
    "job_context",
    "job_mode",
    "local_tokens",
    "parse_bytes",
    "plan",
    "plan_job",
    "plan_measured",
    "planned_activation_bytes",
    "strategy_modes",
]

HEADROOM = 0.10
"""Fraction of the GPU's memory kept free: a strategy fits when its peak <= (1 - HEADROOM) x the GPU's bytes (the
caching allocator's fragmentation, CUDA context and NCCL buffers live there)."""

Precision = Literal["fp32", "bf16"]


@dataclass(frozen=True)
class Strategy:
    """One way to train: `kind` ddp (full fine-tune, replicated), fsdp (full fine-tune, sharded per block), lora
    (adapters only, base replicated and frozen) or fsdp+lora (adapters only, base and adapters sharded per block);
    `activation_checkpointing` per transformer block; `precision` fp32 or bf16 autocast (master weights fp32
    either way)."""

    kind: Literal["ddp", "fsdp", "lora", "fsdp+lora"]
    activation_checkpointing: bool
    precision: Precision

    @property
    def name(self) -> str:
        return f"{self.kind}{'+AC' if self.activation_checkpointing else ''} {self.precision}"


STRATEGIES: tuple[Strategy, ...] = tuple(
    Strategy(kind, ac, precision)
    for kind, ac in (("ddp", False), ("fsdp", False), ("fsdp", True), ("lora", False), ("lora", True),
                     ("fsdp+lora", False), ("fsdp+lora", True))
    for precision in ("bf16", "fp32")
)
"""Every strategy the planner reports, in the order it prefers them (see the module docstring)."""

StorageDtype = Literal["fp32", "bf16", "fp8"]

STORAGE_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1}
"""Bytes of one stored frozen weight, by `memory.storage_dtype` (fp8: float8_e4m3fn, the Linear / conv weights
only; norms, embeddings and biases-free layers diffusers' layerwise casting skips stay bf16: `frozen_bytes`)."""

HOST_HEADROOM = 0.30
"""Fraction of a node's host memory the planner leaves to others: Ray's object store takes 30 % of the RAM by
default (`object_store_memory`), and the OS, the data loaders and the page cache need the rest. A plan fits the
host when its pinned host bytes x the ranks on the node <= (1 - HOST_HEADROOM) x the node's memory."""


@dataclass(frozen=True)
class MemoryMode:
    """Where a strategy's frozen weights live and in which dtype (`vidray.config.MemoryConfig`): `storage` of the
    frozen weights (the base under LoRA, the encoders on the GPU; trainable weights keep fp32 masters),
    `block_swap` (the last N blocks of the frozen base in pinned host memory, streamed host-to-device one block
    ahead: the device holds the resident blocks + 2 in flight), `fsdp_cpu_offload` (FSDP2's CPUOffloadPolicy:
    the sharded parameters, gradients and optimizer state in host memory, the gathered block on the device),
    `activation_offload` (with AC: the checkpointed blocks' inputs and what the layers outside the blocks save, in
    pinned host memory: `vidray.train.step.ActivationOffload`); `ulysses` x `ring` (`parallel.context`: one
    sample's tokens split over that many consecutive ranks, `vidray.models.context_parallel`; each rank saves
    its share of the blocks' activations, and the all-to-alls / ring passes of `context_traffic_bytes` cross the
    node's links every layer)."""

    storage: StorageDtype = "fp32"
    block_swap: int = 0
    fsdp_cpu_offload: bool = False
    activation_offload: bool = False
    ulysses: int = 1
    ring: int = 1

    @property
    def context_degree(self) -> int:
        """Ranks one sample's tokens are split over: `ulysses` x `ring` (1: no context parallel)."""
        return self.ulysses * self.ring

    @property
    def name(self) -> str:
        parts = [f"{self.storage} frozen"]
        if self.block_swap:
            parts.append(f"swap {self.block_swap}")
        if self.fsdp_cpu_offload:
            parts.append("cpu offload")
        if self.activation_offload:
            parts.append("act offload")
        if self.context_degree > 1:
            parts.append(f"cp {self.context_degree}" + (f" (u{self.ulysses} x r{self.ring})" if self.ring > 1 else ""))
        return ", ".join(parts)

    @property
    def transfer_rank(self) -> int:
        """The mode's place in the pick order: 0 fp32 / bf16 storage (no transfer: bf16 is what bf16 autocast
        computes in anyway), 1 fp8 storage (no transfer, a quality cost), 2 context parallel (all-to-alls of q, k, v
        and the attention output within the node every layer, `context_traffic_bytes`; the data-parallel width
        divided by the degree), 3 block swap (host-to-device traffic every step), 4 activation offload (the saved
        activations copied to the host and back every step, with or without block swap), 5 FSDP CPU offload
        (parameters, gradients and the optimizer step through host memory). A mode combining several takes the
        largest."""
        if self.fsdp_cpu_offload:
            return 5
        if self.activation_offload:
            return 4
        if self.block_swap:
            return 3
        if self.context_degree > 1:
            return 2
        return 1 if self.storage == "fp8" else 0

    def keys(self) -> str:
        """The config keys that ask for this mode (`memory.*`, and `parallel.context.*` for a context degree)."""
        keys = [f"memory.storage_dtype={self.storage}"]
        if self.block_swap:
            keys.append(f"memory.block_swap={self.block_swap}")
        if self.fsdp_cpu_offload:
            keys.append("memory.fsdp_cpu_offload=true")
        if self.activation_offload:
            keys.append("memory.activation_offload=true")
        if self.ulysses > 1:
            keys.append(f"parallel.context.ulysses={self.ulysses}")
        if self.ring > 1:
            keys.append(f"parallel.context.ring={self.ring}")
        return " ".join(keys)


# 1. Parameter counts (exact, from the meta-device build).

def lora_targets(family: str) -> tuple[str, ...]:
    """LoRA target modules the activation formula models for `family` (its card's `planner.lora_targets`, peft
    `target_modules` suffixes): the attention projections of every stream. `model.lora.target_modules`' default
    (`to_q`, `to_k`, `to_v`, `to_out.0`) leaves EasyAnimate's text-stream projections frozen, which saves their
    inputs: the lora rows then plan a little high (~10 % of the block activations at rank 8 on the tiny block),
    never low. Adapter parameter counts use the job's own targets. Raises UserError for a family without planner
    facts."""
    return planner_facts(family).lora_targets


def _token_flow(family: str) -> str:
    """The card's `planner.token_flow` of `family`: which activation formula its blocks follow."""
    return planner_facts(family).token_flow


def text_in_blocks(family: str) -> bool:
    """Whether text tokens go through every block as a stream of their own (dual or single stream: EasyAnimate,
    CogVideoX), rather than as cross-attention keys and values shared by all blocks (Wan)."""
    return _token_flow(family) != "cross_attention"


def local_tokens(family: str, video_tokens: int, text_tokens: int, context_degree: int = 1) -> tuple[int, int]:
    """(video, text) tokens one rank of a context group of `context_degree` ranks runs through the blocks: the video
    tokens over the degree, and the text too for the families whose text goes through the blocks (`text_in_blocks`:
    EasyAnimate, CogVideoX, whose plans split both); Wan's text stays whole on every rank (cross-attention's keys and
    values). Rounded up: the most a rank holds (a degree that does not divide is refused where the split runs:
    `_check_context_degree`, `vidray.models.context_parallel`). Training and generation count activations with it.
    Raises ValueError for a degree < 1."""
    if context_degree < 1:
        raise ValueError(f"context_degree must be >= 1, got {context_degree}")
    local_video = -(-video_tokens // context_degree)
    return local_video, (-(-text_tokens // context_degree) if text_in_blocks(family) else text_tokens)


DEFAULT_LORA_RANK = LoraConfig().rank
"""`model.lora.rank`'s default: what the table's lora rows assume for a job without `model.lora`."""


@dataclass(frozen=True)
class ModelCounts:
    """Parameter counts of one transformer (numbers of parameters, not bytes)."""

    total: int
    trainable: int
    """Parameters that get a gradient in full fine-tuning (EasyAnimate: all but the last MMDiT block's text-output
    path, `attn1.to_add_out` and `txt_ff`, whose output the model drops)."""
    blocks: tuple[int, ...]
    """Parameters of each transformer block, in order."""
    block_matmul_weights: tuple[int, ...]
    """Linear weight parameters of each block (what bf16 autocast casts and saves)."""
    other_matmul_weights: int
    """Linear / conv weights outside the blocks."""
    lora_parameters: int
    """Adapter parameters for `lora_rank` on `lora_targets`: sum of rank x (in + out) over the targeted Linears."""
    lora_rank: int
    num_layers: int
    num_mmdit_layers: int
    dim: int
    """Hidden size (heads x head dim)."""
    ffn_dim: int
    heads: int
    head_dim: int
    block_castable: tuple[int, ...] = ()
    """Parameters of each block that fp8 storage casts (those of the Linear / conv layers diffusers' layerwise
    casting does not skip: `FP8_SKIP_PATTERNS`); the rest of the block stays bf16."""
    other_castable: int = 0
    """The same outside the blocks."""


FP8_SKIP_PATTERNS = ("pos_embed", "patch_embed", "norm", "^proj_in$", "^proj_out$", "lora_")
"""Module names fp8 storage leaves in bf16: diffusers' `DEFAULT_SKIP_MODULES_PATTERN` (layerwise casting) plus the
LoRA adapters (trainable, fp32)."""


def frozen_bytes(counts: ModelCounts, storage: StorageDtype, block: int | None = None) -> int:
    """Bytes of the frozen transformer (or of block `block`) stored in `storage`: 4 or 2 bytes a parameter for fp32
    and bf16; fp8: 1 byte a castable parameter (`ModelCounts.block_castable`), 2 for the rest."""
    total = counts.total if block is None else counts.blocks[block]
    if storage != "fp8":
        return STORAGE_BYTES[storage] * total
    castable = (sum(counts.block_castable) + counts.other_castable) if block is None else counts.block_castable[block]
    return castable + 2 * (total - castable)


def count_model(preset: ShapePreset, *, lora_rank: int = DEFAULT_LORA_RANK,
                lora_targets: tuple[str, ...] | None = None) -> ModelCounts:
    """Exact parameter counts of `preset`'s transformer, built on the meta device (no memory allocated).

    `lora_targets`: module-name suffixes the adapters go on (default `lora_targets(family)`). Raises UserError when
    a target matches no Linear (naming the Linear suffixes that exist) or `lora_rank` < 1.
    """
    import torch  # heavy: torch

    if lora_rank < 1:
        raise UserError(f"lora rank must be >= 1, got {lora_rank}")
    model = meta_model(preset)
    facts = planner_facts(preset.family)
    targets = tuple(lora_targets or facts.lora_targets)
    block_prefix = get_card(preset.family).blocks
    blocks = getattr(model, block_prefix)
    block_params = tuple(sum(p.numel() for p in b.parameters()) for b in blocks)
    block_mm = tuple(sum(m.weight.numel() for m in b.modules() if isinstance(m, torch.nn.Linear)) for b in blocks)
    all_mm = sum(m.weight.numel() for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d,
                                                                               torch.nn.Conv3d)))
    linears = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    lora = 0
    for target in targets:
        hits = [m for name, m in linears.items() if name == target or name.endswith("." + target)]
        if not hits:
            suffixes = sorted({".".join(n.split(".")[-2:]) if n.split(".")[-1].isdigit() else n.split(".")[-1]
                               for n in linears})
            raise UserError(f"LoRA target module {target!r} matches no Linear of {preset.name}; valid: "
                            f"{', '.join(suffixes)}")
        lora += sum(lora_rank * (m.in_features + m.out_features) for m in hits)
    total = sum(p.numel() for p in model.parameters())
    castable_types = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)

    def castable(root: torch.nn.Module, prefix: str) -> int:
        return sum(p.numel() for name, m in root.named_modules(prefix=prefix) if isinstance(m, castable_types)
                   and not any(re.search(pat, name) for pat in FP8_SKIP_PATTERNS) for p in m.parameters())

    block_cast = tuple(castable(b, f"{block_prefix}.{i}") for i, b in enumerate(blocks))
    all_cast = sum(p.numel() for name, m in model.named_modules() if isinstance(m, castable_types)
                   and not any(re.search(pat, name) for pat in FP8_SKIP_PATTERNS) for p in m.parameters())
    dead = 0
    dual = facts.token_flow == "dual_stream"
    if dual and getattr(blocks[-1], "txt_ff", None) is not None:  # the last block's text output is dropped
        last = blocks[-1]
        dead = sum(p.numel() for p in last.txt_ff.parameters()) + sum(p.numel() for p in
                                                                       last.attn1.to_add_out.parameters())
    cfg = model.config
    heads, head_dim = int(cfg.num_attention_heads), int(cfg.attention_head_dim)
    dim = heads * head_dim
    ffn_dim = int(cfg[facts.ffn_dim_key]) if facts.ffn_dim_key else 4 * dim  # diffusers FeedForward: mult 4
    mmdit = sum(1 for b in blocks if getattr(b, "txt_ff", None) is not None) if dual else 0
    return ModelCounts(total=total, trainable=total - dead, blocks=block_params, block_matmul_weights=block_mm,
                       other_matmul_weights=all_mm - sum(block_mm), lora_parameters=lora, lora_rank=lora_rank,
                       num_layers=len(blocks), num_mmdit_layers=mmdit, dim=dim, ffn_dim=ffn_dim, heads=heads,
                       head_dim=head_dim, block_castable=block_cast, other_castable=all_cast - sum(block_cast))


# 2. Tokens of a bucket.

def sequence_lengths(preset: ShapePreset, bucket: Bucket) -> tuple[int, int]:
    """(video tokens, latent elements per clip) of `bucket` for `preset`: latent frames (F - 1) / 4 + 1, latent
    height and width H / 8, W / 8 (both families' VAEs), then the DiT's patch (EasyAnimate 2x2 per frame, Wan
    (1, 2, 2)): tokens = F_lat x (H / 16) x (W / 16). Raises UserError when the bucket does not divide."""
    num_frames, height, width = bucket
    if (num_frames - 1) % 4 or height % 16 or width % 16:
        raise UserError(f"bucket {num_frames}x{height}x{width}: frames must be 4k+1 and height, width multiples "
                        f"of 16 (VAE 4x8x8, patch 2)")
    f_lat, h_lat, w_lat = (num_frames - 1) // 4 + 1, height // 8, width // 8
    return f_lat * (h_lat // 2) * (w_lat // 2), 16 * f_lat * h_lat * w_lat


# 3. Activations of one block, per token (the census).

def block_activation_bytes(family: str, *, mmdit: bool, precision: Precision, video_tokens: int, text_tokens: int,
                           dim: int, ffn_dim: int, heads: int, lora_rank: int = 0) -> int:
    """Bytes autograd saves for the backward of one transformer block, for one sample (multiply by the batch).

    Counted per token from the census of diffusers' blocks (`vidray.train.memory.saved_tensor_census`; the test
    re-derives it): D = dim, F = ffn_dim, a = 4 (fp32) or 2 (bf16, what autocast's matmuls return); the residual
    stream, the norms' inputs and outputs and the rotary embedding stay fp32 under autocast.
    - EasyAnimate MMDiT block, per token of video + text (each stream has its own projections and MLP):
      4 D fp32 (block input, norm1 output, the residual after attention, norm2 output) + 11 D x a in fp32 / 13 D x a
      in bf16 (modulated inputs and their casts, q/k before and after their LayerNorm, the MLP output, and over the
      joint sequence q, k, v, the attention output and its transposed copy) + 2 F x a (the MLP's GELU input and
      output) + 4 (5 heads + 4) bytes of norm statistics and attention log-sum-exp.
    - EasyAnimate block without the text stream's own layers (after `mmdit_layers`): the same with one D fewer
      per text token.
    - Wan block, per video token: 12 D fp32 + 10 D x a in fp32 / 12 D x a in bf16 (self-attention, cross-attention
      queries, the MLP input, the modulations) + 2 F x a + 4 (2 heads + 9) bytes of statistics; per text token the
      cross-attention keys and values: 5 D fp32 in fp32, 2 D fp32 + 3 D x a in bf16.
    - LoRA (`lora_rank` > 0: base weights frozen, adapters on the attention projections): a frozen Linear saves
      no input, and with the time embedding frozen the modulations (`norm * (1 + scale)`, `gate * out`) save
      nothing for it: EasyAnimate keeps 2 D fp32 + 8 D x a in fp32 / 10 D x a in bf16 + F x a per token, Wan
      6 D fp32 + 8 D x a / 12 D x a + F x a per video token and, per text token, 4 D fp32 in fp32, 1 D fp32 +
      3 D x a in bf16; the adapters add their rank-wide intermediates (EasyAnimate 4 r x a per token, Wan 6 r x a
      per video token and 2 per text token).
    - CogVideoX block (`CogVideoXBlock`: text and video tokens through the same norms, joint attention and MLP; one
      set of projections): the EasyAnimate single-stream count per token, for every token, video and text alike
      (the census of a 128-wide block with 3D RoPE: within 4 % in fp32 and bf16, full and LoRA; test_plan).
    The bf16 copies of the block's weights are not included (`estimate_memory` adds them). `family`'s card picks
    the formula by its `planner.token_flow`: `dual_stream` as EasyAnimate, `cross_attention` as Wan,
    `single_stream` as CogVideoX. Raises UserError for a family without planner facts.
    """
    a = 4 if precision == "fp32" else 2
    r = lora_rank
    stats_ea, stats_wan = 4 * (5 * heads + 4), 4 * (2 * heads + 9)
    flow = _token_flow(family)
    if flow == "single_stream":  # text and video tokens through the same layers: a dual-stream block without the
        # text stream's own layers, over the joint sequence
        video_tokens, text_tokens, mmdit, flow = video_tokens + text_tokens, 0, False, "dual_stream"
    if flow == "dual_stream":
        if r:
            per_video = 2 * dim * 4 + (8 if precision == "fp32" else 10) * dim * a + ffn_dim * a + 4 * r * a
        else:
            per_video = 4 * dim * 4 + (11 if precision == "fp32" else 13) * dim * a + 2 * ffn_dim * a
        per_video += stats_ea
        per_text = per_video - (0 if mmdit else dim * a)
        return video_tokens * per_video + text_tokens * per_text
    if flow == "cross_attention":
        if r:
            per_video = 6 * dim * 4 + (8 if precision == "fp32" else 12) * dim * a + ffn_dim * a + 6 * r * a
            per_text = (4 * dim * 4 if precision == "fp32" else dim * 4 + 3 * dim * a) + 2 * r * a
        else:
            per_video = 12 * dim * 4 + (10 if precision == "fp32" else 12) * dim * a + 2 * ffn_dim * a
            per_text = 5 * dim * 4 if precision == "fp32" else 2 * dim * 4 + 3 * dim * a
        return video_tokens * (per_video + stats_wan) + text_tokens * per_text
    raise AssertionError(flow)  # FamilyCard refuses any other token_flow


def _outside_blocks_bytes(family: str, precision: Precision, video_tokens: int, text_tokens: int, latent_elems: int,
                          dim: int, frozen: bool = False, context_degree: int = 1) -> int:
    """What the model saves outside its blocks, for one sample: the patch embedding and text projection outputs
    (fp32), the final norm, modulation and output projection over the video tokens (4 D x a), and the
    latent-sized inputs, prediction, target and loss gradient (6 x C F H W fp32). `frozen` (LoRA): the output
    projection's input is not saved (3 D x a). `context_degree` > 1 (context parallel): the final norm,
    modulation and output projection see this rank's share of the video tokens (the plan gathers `proj_out`'s
    output); the patch embedding and text projection run before the split and the loss on the gathered, full
    latent, so those stay whole."""
    a = 4 if precision == "fp32" else 2
    local_video = -(-video_tokens // context_degree)
    return (video_tokens * dim * 4 + local_video * (3 if frozen else 4) * dim * a + text_tokens * dim * 4
            + 6 * latent_elems * 4)


def _block_inputs_bytes(family: str, video_tokens: int, text_tokens: int, dim: int,
                        precision: Precision = "fp32") -> int:
    """What activation checkpointing keeps per block and sample: its inputs (the residual stream: fp32, except
    Wan's under bf16 autocast, where the patch embedding's output is bf16 and every block returns `.type_as` it:
    2 bytes; EasyAnimate and CogVideoX also the text stream, which every block updates; Wan's text embeddings are
    one tensor shared by all blocks)."""
    width = 2 if not text_in_blocks(family) and precision == "bf16" else 4
    return (video_tokens + (text_tokens if text_in_blocks(family) else 0)) * dim * width


def _backward_temporaries(precision: Precision, tokens: int, dim: int, ffn_dim: int) -> int:
    """Gradients in flight inside one block's backward, for one sample: the gradient of the MLP hidden layer
    (F x a, and its GELU gradient) and of a few D-wide tensors (the residual, the attention output, q/k/v:
    6 D x a) over the block's tokens."""
    a = 4 if precision == "fp32" else 2
    return tokens * (2 * ffn_dim * a + 6 * dim * a)


# 4. One strategy's estimate.

@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank bytes of one strategy (all in bytes). `peak_bytes` is the simulated peak (see the module
    docstring): at most, and usually less than, the sum of the columns, since gradients replace activations as
    the backward proceeds."""

    strategy: Strategy
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    """Activations at the end of the forward (with AC: the blocks' inputs), plus bf16 weight copies."""
    activations_peak_block: int
    """With AC, one block's recomputed activations (what its backward holds besides the inputs); 0 without."""
    ddp_buckets: int
    encoders: int
    peak_bytes: int
    fits: bool = False
    """Fits the GPU (`peak_bytes` within HEADROOM) and, when the node's host memory is known, the host."""
    mode: MemoryMode = MemoryMode()
    host_bytes: int = 0
    """Pinned host memory this rank needs for its offloaded weights (block swap: the swapped blocks; FSDP CPU
    offload: its shard of the parameters, gradients and optimizer state); 0 without offload."""
    fits_host: bool = True
    """`host_bytes` x the ranks on a node within (1 - HOST_HEADROOM) of the node's memory (True when unknown)."""

    @property
    def name(self) -> str:
        return f"{self.strategy.name}, {self.mode.name}"


def estimate_memory(preset: ShapePreset, counts: ModelCounts, strategy: Strategy, *, bucket: Bucket,
                    batch_size: int, text_tokens: int, num_gpus: int = 1, encoders_bytes: int = 0,
                    micro_batches_per_rank: int = 1, gpu_memory_bytes: int | None = None,
                    experts_held: int = 1, mode: MemoryMode = MemoryMode(), host_memory_bytes: int | None = None,
                    ranks_per_node: int = 1) -> MemoryEstimate:
    """Per-rank bytes of training `preset` with `strategy` on micro-batches of `batch_size` clips of `bucket`
    (`text_tokens` prompt tokens each), `num_gpus` ranks. `encoders_bytes`: frozen encoders on the same GPU.
    `micro_batches_per_rank` > 1: gradient accumulation (gradients live during the later forwards).
    `experts_held` transformers of `preset`'s shape on each rank (`model.experts`: 2): the parameters, optimizer
    state, gradients and DDP buckets count that many times; the activations once (each sample goes through one).
    `mode`: the frozen weights' storage dtype and offload (`MemoryMode`; the default, fp32 storage without offload,
    is what the trainer held before `memory:` existed): under LoRA the frozen base is stored in `mode.storage`
    (fp8 also keeps a bf16 copy of every castable weight it computes with until the backward, as fp32 storage under
    autocast does: measured, `benchmarks/_memory_planner.py`; with AC only the recomputed block's), block swap moves
    the last N blocks' bytes to pinned host memory (2 stay in flight on the device), FSDP CPU offload moves the
    sharded parameters, gradients and optimizer state to host memory (the gathered blocks and one block's
    gradients stay), and `mode.ulysses` x `mode.ring` (context parallel, degree cp) splits one sample's tokens over
    cp ranks: the blocks' saved activations, checkpointed inputs and backward temporaries count n_video / cp
    video tokens (and text / cp for the families whose text goes through the blocks, `text_in_blocks`; Wan's
    cross-attention keys and values are of the whole text on every rank), the layers outside the blocks as
    `_outside_blocks_bytes` says; parameters, gradients and optimizer state are unchanged (FSDP shards over all
    the ranks). `fits` is set against `gpu_memory_bytes` x (1 - HEADROOM) when given and, with
    `host_memory_bytes` (one node's), against `host_bytes` x `ranks_per_node` <= (1 - HOST_HEADROOM) x it.
    Raises UserError for a bad bucket, ValueError for `num_gpus` or `batch_size` < 1 or a mode the strategy cannot
    run (block swap without LoRA or with FSDP, FSDP CPU offload without FSDP, a context degree that does not divide
    `num_gpus`, the heads (Ulysses) or the tokens).
    """
    if num_gpus < 1 or batch_size < 1:
        raise ValueError(f"num_gpus and batch_size must be >= 1, got {num_gpus} and {batch_size}")
    n_video, latent_elems = sequence_lengths(preset, bucket)
    cp = mode.context_degree
    if cp > 1:
        _check_context_degree(preset, counts, mode, n_video, text_tokens, num_gpus)
    a_bf16 = strategy.precision == "bf16"
    lora = strategy.kind in ("lora", "fsdp+lora")
    fsdp = strategy.kind in ("fsdp", "fsdp+lora")
    if mode.block_swap and (not lora or fsdp):
        raise ValueError(f"block swap applies to the frozen base of lora (without fsdp), not {strategy.name}")
    if mode.fsdp_cpu_offload and not fsdp:
        raise ValueError(f"fsdp cpu offload needs an fsdp strategy, not {strategy.name}")
    if mode.activation_offload and not strategy.activation_checkpointing:
        raise ValueError(f"activation offload needs activation checkpointing, not {strategy.name}")
    shard = num_gpus if fsdp else 1
    p_total, p_train = counts.total, (counts.lora_parameters if lora else counts.trainable)
    block_share = [(b * p_train / max(counts.trainable, 1)) if not lora else
                   counts.lora_parameters / counts.num_layers for b in counts.blocks]  # trainable params per block
    other_train = max(p_train - sum(block_share), 0.0)

    # 1. Resident: parameters (fp32 master; fsdp: a shard + the gathered block and the prefetched next one),
    #    optimizer state, DDP's gradient buckets.
    gathered = 0
    if fsdp:
        gathered = 2 * max(counts.blocks) * (2 if a_bf16 else 4)
    # LoRA: the frozen base in its storage dtype (fp32 masters only for the adapters); block swap: the last N
    # blocks in pinned host memory, 2 of them in flight on the device.
    base = frozen_bytes(counts, mode.storage) if lora else 4 * p_total
    host_bytes = 0
    if mode.block_swap:
        n_swap = min(mode.block_swap, counts.num_layers)
        swapped = [frozen_bytes(counts, mode.storage, i) for i in range(counts.num_layers - n_swap, counts.num_layers)]
        host_bytes = sum(swapped)
        base -= host_bytes - sum(sorted(swapped)[-min(n_swap, 2):])
    parameters = math.ceil((base + (4 * counts.lora_parameters if lora else 0)) / shard) + gathered
    optimizer = math.ceil(8 * p_train / shard)
    ddp_buckets = 4 * p_train if (num_gpus > 1 and not fsdp) else 0
    # fsdp: one block's unsharded gradients before their reduce-scatter (fsdp+lora: its adapters')
    gradients = math.ceil(4 * p_train / shard) + (math.ceil(4 * max(block_share)) if fsdp else 0)
    if mode.fsdp_cpu_offload:  # the shards live in host memory; the device keeps the gathered blocks, one block's
        host_bytes = (parameters - gathered) + optimizer + (gradients - math.ceil(4 * max(block_share)))
        parameters, optimizer, gradients = gathered, 0, math.ceil(4 * max(block_share))
    resident = parameters + optimizer + ddp_buckets + encoders_bytes

    # 2. Activations per block (x batch), bf16 weight copies, the rest of the model.
    # Context parallel: each rank's blocks see its share of the tokens (Wan's text: whole, as cross-attention's
    # keys and values on every rank).
    joint = text_in_blocks(preset.family)
    local_video, local_text = local_tokens(preset.family, n_video, text_tokens, cp)
    mmdit = [i < counts.num_mmdit_layers for i in range(counts.num_layers)]
    saved = [batch_size * block_activation_bytes(preset.family, mmdit=m, precision=strategy.precision,
                                                 video_tokens=local_video, text_tokens=local_text, dim=counts.dim,
                                                 ffn_dim=counts.ffn_dim, heads=counts.heads,
                                                 lora_rank=counts.lora_rank if lora else 0) for m in mmdit]
    copies = [2 * w if (a_bf16 and not fsdp) else 0 for w in counts.block_matmul_weights]  # fsdp: params are bf16
    if lora and mode.storage != "fp32":  # bf16: autocast casts nothing; fp8: each castable weight's bf16 copy
        copies = ([2 * w for w in counts.block_castable] if mode.storage == "fp8" and not fsdp
                  else [0] * counts.num_layers)
    outside = batch_size * _outside_blocks_bytes(preset.family, strategy.precision, n_video, text_tokens,
                                                 latent_elems, counts.dim, frozen=lora, context_degree=cp)
    inputs = batch_size * _block_inputs_bytes(preset.family, local_video, local_text, counts.dim, strategy.precision)
    offloaded = 0  # activation offload: pinned host bytes of the saved activations (counted once per rank)
    if mode.activation_offload:  # the token-wide saved tensors outside the blocks and every block's inputs go to
        # the host; the latent-sized ones (the loss's inputs, outside the offloaded forward) stay
        latent_part = batch_size * 6 * latent_elems * 4
        offloaded = (outside - latent_part) + counts.num_layers * inputs
        outside = latent_part
    tokens = local_video + (local_text if joint else 0)
    transient = batch_size * _backward_temporaries(strategy.precision, tokens, counts.dim, counts.ffn_dim)
    accumulated = math.ceil(4 * p_train / shard) if micro_batches_per_rank > 1 else 0

    # 3. The three moments.
    if strategy.activation_checkpointing:
        kept = [0 if mode.activation_offload else inputs] * counts.num_layers
        cache = 2 * counts.other_matmul_weights + sum(copies) if (a_bf16 and not lora and not fsdp) else 0
        end_of_forward = resident + accumulated + outside + sum(kept) + cache
    else:
        kept = [s + c for s, c in zip(saved, copies)]
        end_of_forward = resident + accumulated + outside + sum(kept)
    peak_backward = 0
    grads_above = 4 * other_train / shard  # the output layers' gradients come first
    for i in reversed(range(counts.num_layers)):
        below = sum(kept[:i])
        own = (saved[i] + copies[i]) if strategy.activation_checkpointing else kept[i]
        here = resident + outside + below + own + transient + max(grads_above, accumulated)
        peak_backward = max(peak_backward, here)
        grads_above += 4 * block_share[i] / shard
    optimizer_step = resident + gradients
    if experts_held > 1:  # the other experts' weights, optimizer state, buckets and gradients, all held
        extra = (experts_held - 1) * (parameters + optimizer + ddp_buckets + gradients)
        parameters, optimizer, ddp_buckets, gradients = (experts_held * x for x in
                                                         (parameters, optimizer, ddp_buckets, gradients))
        end_of_forward, peak_backward, optimizer_step = (x + extra for x in
                                                         (end_of_forward, peak_backward, optimizer_step))
    peak = int(max(end_of_forward, peak_backward, optimizer_step))
    activations = sum(kept) + outside
    host_bytes = host_bytes * experts_held + offloaded  # one sample goes through one expert
    fits_host = host_memory_bytes is None or host_bytes * ranks_per_node <= (1 - HOST_HEADROOM) * host_memory_bytes
    estimate = MemoryEstimate(
        strategy=strategy, parameters=parameters, gradients=gradients, optimizer=optimizer, activations=activations,
        activations_peak_block=(max(saved) + max(copies)) if strategy.activation_checkpointing else 0,
        ddp_buckets=ddp_buckets, encoders=encoders_bytes, peak_bytes=peak, mode=mode, host_bytes=host_bytes,
        fits_host=fits_host)
    if gpu_memory_bytes is not None:
        estimate = replace(estimate, fits=peak <= (1 - HEADROOM) * gpu_memory_bytes and fits_host)
    return estimate


# 4b. Context parallel: the degrees a plan may try, the traffic they cost, and the activation bytes per rank.

def _check_context_degree(preset: ShapePreset, counts: ModelCounts, mode: MemoryMode, video_tokens: int,
                          text_tokens: int, num_gpus: int) -> None:
    """Raise ValueError, one line, when `mode`'s context degree cannot split `preset`'s sample over `num_gpus` ranks:
    the family's card has no `context_parallel`, the degree does not divide the ranks, `ulysses` does not divide
    the heads, or the video tokens (and the text, for the families whose text goes through the blocks) do not
    divide by the degree (diffusers' `EquipartitionSharder` splits equal chunks; its uneven modes have no backward)."""
    cp = mode.context_degree
    if not get_card(preset.family).context_parallel:
        raise ValueError(f"context degree {cp}: model family {preset.family} has no context-parallel plan (its card's "
                         "context_parallel is false)")
    if num_gpus % cp:
        raise ValueError(f"context degree {cp} does not divide the {num_gpus} GPU(s)")
    if counts.heads % mode.ulysses:
        raise ValueError(f"ulysses degree {mode.ulysses} does not divide the {counts.heads} attention heads")
    if video_tokens % cp or (text_in_blocks(preset.family) and text_tokens % cp):
        raise ValueError(f"context degree {cp} does not divide the {video_tokens} video tokens"
                         + (f" and {text_tokens} text tokens" if text_in_blocks(preset.family) else ""))


def context_degrees(preset: ShapePreset, counts: ModelCounts, *, bucket: Bucket, text_tokens: int, num_gpus: int,
                    ranks_per_node: int) -> tuple[int, ...]:
    """The Ulysses degrees > 1 `plan` tries for `preset` at `bucket`, smallest first: the divisors of
    min(`num_gpus`, `ranks_per_node`) (a context group stays within a node: its all-to-all runs every layer) that
    divide the attention heads and the video tokens (and the text tokens, for the families whose text goes through
    the blocks). Empty when the family's card has no `context_parallel` (AnimateDiff, and any family without a
    split plan). Raises UserError for a bad bucket."""
    if not get_card(preset.family).context_parallel:
        return ()
    n_video, _ = sequence_lengths(preset, bucket)
    width = min(num_gpus, ranks_per_node)
    joint = text_in_blocks(preset.family)
    return tuple(d for d in range(2, width + 1) if not width % d and not counts.heads % d and not n_video % d
                 and not (joint and text_tokens % d))


def _attention_width(preset: ShapePreset) -> int:
    """heads x head dim of `preset`'s transformer (its config's `num_attention_heads` x `attention_head_dim`)."""
    return int(preset.config["num_attention_heads"]) * int(preset.config["attention_head_dim"])


def context_traffic_bytes(preset: ShapePreset, bucket: Bucket, *, ulysses: int = 1, ring: int = 1,
                          precision: Precision = "bf16", activation_checkpointing: bool = False, text_tokens: int = 0,
                          batch_size: int = 1) -> int:
    """Bytes one rank sends per transformer block and training step for context parallel (what it receives is the
    same), for `batch_size` clips of `bucket`. S = the attention's sequence (the video tokens; plus `text_tokens` for
    the families whose text goes through the blocks: EasyAnimate, CogVideoX), D = heads x head dim, a = 2 (bf16
    autocast: q, k, v are bf16) or 4 (fp32) bytes, cp = `ulysses` x `ring`:
    - Ulysses: each all-to-all exchanges a rank's local (S / cp) x D tensor, keeping 1 / ulysses of it:
      (ulysses - 1) / ulysses x S / cp x D x a, i.e. (cp - 1) / cp^2 x S x D x a with ring 1 (DeepSpeed-Ulysses,
      Jacobs et al. 2023, §3.1; diffusers' `TemplatedUlyssesAttention` calls `funcol.all_to_all_single`). 4 in the
      forward (q, k, v in, the attention output back), 4 in the backward (their gradients), 4 more with activation
      checkpointing (the block's forward runs again).
    - Ring (over the ulysses-gathered heads, D / ulysses wide): the forward passes every rank's keys and values to
      the others, 2 (ring - 1) / ring x S x D / ulysses x a (diffusers' `TemplatedRingAttention`, rotate_method
      allgather); the backward about twice that (keys and values again, and their gradients; Liu et al. 2023, Ring
      Attention, §3); activation checkpointing adds one forward's.
    Wan's cross-attention sends nothing (every rank holds the whole text). Raises UserError for a bad bucket,
    ValueError for degrees < 1."""
    if ulysses < 1 or ring < 1 or batch_size < 1:
        raise ValueError(f"ulysses, ring and batch_size must be >= 1, got {ulysses}, {ring} and {batch_size}")
    n_video, _ = sequence_lengths(preset, bucket)
    tokens = n_video + (text_tokens if text_in_blocks(preset.family) else 0)
    a = 4 if precision == "fp32" else 2
    cp, width = ulysses * ring, _attention_width(preset)
    all_to_all = (ulysses - 1) / ulysses * tokens / cp * width * a
    ulysses_bytes = (12 if activation_checkpointing else 8) * all_to_all
    ring_forward = 2 * (ring - 1) / ring * tokens * width / ulysses * a
    ring_bytes = ring_forward * (1 + 2 + (1 if activation_checkpointing else 0))
    return int(batch_size * (ulysses_bytes + ring_bytes))


def context_step_traffic_bytes(preset: ShapePreset, bucket: Bucket, *, ulysses: int = 1, ring: int = 1,
                               precision: Precision = "bf16", activation_checkpointing: bool = False,
                               text_tokens: int = 0, batch_size: int = 1) -> int:
    """Bytes one rank sends per training step for context parallel: `context_traffic_bytes` x the blocks
    (`preset.config["num_layers"]`) + the all-gather of the output projection's result back to the whole latent
    ((cp - 1) / cp of it, C x F x H x W x a; its backward takes this rank's chunk of the gradient and sends nothing).
    Raises as `context_traffic_bytes`."""
    per_layer = context_traffic_bytes(preset, bucket, ulysses=ulysses, ring=ring, precision=precision,
                                      activation_checkpointing=activation_checkpointing, text_tokens=text_tokens,
                                      batch_size=batch_size)
    _, latent_elems = sequence_lengths(preset, bucket)
    cp, a = ulysses * ring, 4 if precision == "fp32" else 2
    gather = (cp - 1) / cp * latent_elems * a * batch_size
    return int(per_layer * int(preset.config["num_layers"]) + gather)


@dataclass(frozen=True)
class ActivationBytes:
    """Per-rank bytes autograd holds for the backward at the end of one forward (`planned_activation_bytes`)."""

    blocks: int
    """The transformer blocks: what each saves (`block_activation_bytes` over this rank's tokens), or with
    activation checkpointing each block's input."""
    outside: int
    """The token-wide tensors the layers outside the blocks save (`_outside_blocks_bytes` less the latent part)."""
    latent: int
    """The latent-sized tensors around the loss, whole on every rank: 6 fp32 tensors of C x F x H x W (the inputs,
    prediction, target and loss gradient, as `estimate_memory` counts them; a forward alone holds fewer)."""
    context_degree: int = 1

    @property
    def total(self) -> int:
        return self.blocks + self.outside + self.latent


def planned_activation_bytes(job_or_preset: Any, bucket: Bucket, context_degree: int = 1, *,
                             ring: int = 1, precision: Precision | None = None,
                             activation_checkpointing: bool | None = None, text_tokens: int | None = None,
                             batch_size: int = 1, lora_rank: int | None = None) -> ActivationBytes:
    """The planner's activation term for one rank, as `estimate_memory` counts it (without the bf16 weight copies,
    the backward's temporaries, parameters, gradients and optimizer state), for comparing with a measurement:
    `vidray.train.memory.TensorBytesTracker`'s `current_bytes` after a forward of the transformer and its loss minus
    before it (parameters and inputs tracked first), on each rank of a context group. `job_or_preset`: a loaded job
    (its model's shape `job_preset`, `model.max_sequence_length` text tokens, `train.mixed_precision`,
    `train.activation_checkpointing` and `model.lora` unless given) or a `ShapePreset` (fp32, no AC, no LoRA and
    the preset's `text_seq_len` unless given). `context_degree` = ulysses x `ring` ranks share the sample.
    Compare `.total` with the measurement: at degree 1 a 6-block Wan in fp32 holds within 1 % of it (3 % with AC;
    `tests/unit/test_plan.py`); at degree d each rank of the group should hold about `.total` of its degree.
    Raises UserError for a bad bucket, ValueError for a degree that does not divide the heads or the tokens."""
    if context_degree < 1 or ring < 1 or context_degree % ring:
        raise ValueError(f"context_degree must be a multiple of ring, both >= 1, got {context_degree} and {ring}")
    if isinstance(job_or_preset, ShapePreset):
        preset = job_or_preset
        precision = precision or "fp32"
        ac = bool(activation_checkpointing)
        text = preset.text_seq_len if text_tokens is None else text_tokens
        rank = lora_rank or 0
    else:
        job = job_or_preset
        preset = job_preset(job)
        strategy = job_strategy(job)
        precision = precision or strategy.precision
        ac = strategy.activation_checkpointing if activation_checkpointing is None else activation_checkpointing
        text = job.model.max_sequence_length if text_tokens is None else text_tokens
        rank = (job.model.lora.rank if job.model.lora else 0) if lora_rank is None else lora_rank
    counts = count_model(preset, lora_rank=rank or DEFAULT_LORA_RANK)
    mode = MemoryMode(ulysses=context_degree // ring, ring=ring)
    n_video, latent_elems = sequence_lengths(preset, bucket)
    if context_degree > 1:
        _check_context_degree(preset, counts, mode, n_video, text, context_degree)
    local_video, local_text = local_tokens(preset.family, n_video, text, context_degree)
    if ac:
        blocks = counts.num_layers * _block_inputs_bytes(preset.family, local_video, local_text, counts.dim, precision)
    else:
        blocks = sum(block_activation_bytes(preset.family, mmdit=i < counts.num_mmdit_layers, precision=precision,
                                            video_tokens=local_video, text_tokens=local_text, dim=counts.dim,
                                            ffn_dim=counts.ffn_dim, heads=counts.heads, lora_rank=rank)
                     for i in range(counts.num_layers))
    latent = 6 * latent_elems * 4
    outside = _outside_blocks_bytes(preset.family, precision, n_video, text, latent_elems, counts.dim,
                                    frozen=rank > 0, context_degree=context_degree) - latent
    return ActivationBytes(blocks=batch_size * blocks, outside=batch_size * outside, latent=batch_size * latent,
                           context_degree=context_degree)


# 5. A job's plan.

@dataclass(frozen=True)
class PlanReport:
    """What `plan` found: the model, the largest bucket, every strategy's estimate, and the pick."""

    preset: ShapePreset
    counts: ModelCounts
    bucket: Bucket
    batch_size: int
    text_tokens: int
    num_gpus: int
    gpu_memory_bytes: int
    estimates: tuple[MemoryEstimate, ...]
    chosen: MemoryEstimate | None
    """The first estimate in `STRATEGIES` order that fits; None when none does."""
    requested: MemoryEstimate | None = None
    """The estimate of the job's own strategy, when the job names one (`check_fits`)."""
    host_memory_bytes: int | None = None
    """One node's host memory the modes' pinned host bytes were checked against (None: not checked)."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    measured: bool = False
    """Planned by `plan_measured` (a step measured on the meta device), not by the DiT formulas."""
    lora_job: bool = False
    """The job sets `model.lora`: only the LoRA rows are candidates."""

    def nearest(self) -> MemoryEstimate | None:
        """When nothing fits: the candidate row (host memory permitting) with the smallest peak per GPU."""
        rows = [e for e in self.estimates if e.fits_host and (not self.lora_job or "lora" in e.strategy.kind)]
        return min(rows, key=lambda e: e.peak_bytes) if rows else None


def none_fits(report: PlanReport) -> str:
    """What to change when nothing fits `report`: the row that needs the least, the GPU it would fit, and the
    other ways out (one clause, for a one-line refusal)."""
    near = report.nearest()
    if near is None:
        return "no strategy fits the node's host memory: use nodes with more memory, or fewer ranks per node"
    need = near.peak_bytes / (1 - HEADROOM)
    return (f"none fits: the least is {near.name} at {format_bytes(near.peak_bytes)} per GPU, which fits GPUs of "
            f"{format_bytes(need)} or more ({_how(near)}); else lower the largest bucket (frames, height x width) or "
            f"the batch size")


def strategy_modes(strategy: Strategy) -> tuple[MemoryMode, ...]:
    """The memory modes the planner lists for `strategy` (block swap's count is found by `plan`: -1 here stands for
    "the fewest blocks that fit"). fp32 strategies: fp32 storage only (the reference rows). bf16: the frozen
    weights in bf16 (free under bf16 autocast); LoRA also fp8 and fp8 + block swap, and with AC fp8 + activation
    offload (+ the fewest swapped blocks that fit, none included); fsdp+lora: the base sharded in fp32 (what FSDP2
    holds: the storage dtype applies to a replicated base only), with AC also activation offload; FSDP full
    fine-tuning also FSDP2 CPU offload, and with AC activation offload (with or without the CPU offload)."""
    if strategy.precision == "fp32":
        return (MemoryMode("fp32"),)
    ac = strategy.activation_checkpointing
    if strategy.kind == "lora":
        offload = (MemoryMode("fp8", block_swap=-1, activation_offload=True),) if ac else ()
        return MemoryMode("bf16"), MemoryMode("fp8"), MemoryMode("fp8", block_swap=-1), *offload
    if strategy.kind == "fsdp+lora":  # FSDP2 shards the base as fp32 (vidray.models.storage stores a replicated one)
        offload = (MemoryMode("fp32", activation_offload=True),) if ac else ()
        return MemoryMode("fp32"), *offload
    if strategy.kind == "fsdp":
        offload = ((MemoryMode("bf16", activation_offload=True),
                    MemoryMode("bf16", fsdp_cpu_offload=True, activation_offload=True)) if ac else ())
        return MemoryMode("bf16"), MemoryMode("bf16", fsdp_cpu_offload=True), *offload
    return (MemoryMode("bf16"),)


def plan(preset: ShapePreset, *, bucket: Bucket, batch_size: int, text_tokens: int, num_gpus: int,
         gpu_memory_bytes: int, lora_rank: int = DEFAULT_LORA_RANK, lora_targets: tuple[str, ...] | None = None,
         encoders_bytes: int | dict[str, int] = 0, micro_batches_per_rank: int = 1, experts_held: int = 1,
         expert_groups: bool = False, lora_job: bool = False, host_memory_bytes: int | None = None,
         ranks_per_node: int | None = None, context: tuple[int, int] = (1, 1)) -> PlanReport:
    """Estimate every strategy in `STRATEGIES`, in each of its memory modes (`strategy_modes`), for `preset` on
    `num_gpus` GPUs of `gpu_memory_bytes` each, and pick the cheapest that fits with `HEADROOM`: full fine-tuning
    before LoRA (a full fine-tune with CPU offload is still the run asked for), then the modes in
    `MemoryMode.transfer_rank` order (no transfer < fp8 < context parallel < block swap < activation offload <
    FSDP CPU offload), the strategies in `STRATEGIES` order within a mode. `encoders_bytes`: the encoders sharing the GPU, or their bytes by storage
    dtype (`{"fp32": .., "bf16": .., "fp8": ..}`). `host_memory_bytes`: one node's host memory (None: not checked),
    shared by `ranks_per_node` ranks (default min(num_gpus, 8)). `experts_held` 2 (`model.experts` layout shared): each rank holds two
    experts of the preset's shape, and only ddp and lora (DDP, full or adapters) are listed; `expert_groups`
    (layout groups): each rank holds one expert, `num_gpus` being one expert's group, and every strategy is listed.
    `lora_job` (the job sets `model.lora`): the pick is the first LoRA strategy that fits (the others are listed
    for reference). `context` (ulysses, ring): the job's context-parallel degrees (`parallel.context`), applied to
    every row; at (1, 1), for a family whose card has `context_parallel` (and not `expert_groups`), each row of a
    mode without transfer (fp32 / bf16 / fp8 storage) that does not fit is followed by the same with the smallest
    Ulysses degree of `context_degrees` that fits (or the largest tried), ranked after fp8 and before block swap
    and the offloads (`MemoryMode.transfer_rank`); its traffic (`context_step_traffic_bytes`) is a note.
    Raises UserError for a bad bucket, rank or LoRA target, or a context degree that cannot split the sample."""
    counts = count_model(preset, lora_rank=lora_rank, lora_targets=lora_targets)
    per_node = ranks_per_node or min(num_gpus, 8)
    ulysses, ring = context
    if ulysses * ring > 1:
        try:
            _check_context_degree(preset, counts, MemoryMode(ulysses=ulysses, ring=ring),
                                  sequence_lengths(preset, bucket)[0], text_tokens, num_gpus)
        except ValueError as err:
            raise UserError(f"parallel.context: {err}: pick degrees that divide them") from None
        degrees: tuple[int, ...] = ()
    else:
        degrees = () if expert_groups else context_degrees(preset, counts, bucket=bucket, text_tokens=text_tokens,
                                                           num_gpus=num_gpus, ranks_per_node=per_node)

    def estimate(s: Strategy, mode: MemoryMode) -> MemoryEstimate:
        encoders = encoders_bytes[mode.storage] if isinstance(encoders_bytes, dict) else encoders_bytes
        return estimate_memory(preset, counts, s, bucket=bucket, batch_size=batch_size, text_tokens=text_tokens,
                               num_gpus=num_gpus, encoders_bytes=encoders,
                               micro_batches_per_rank=micro_batches_per_rank, gpu_memory_bytes=gpu_memory_bytes,
                               experts_held=experts_held, mode=mode, host_memory_bytes=host_memory_bytes,
                               ranks_per_node=per_node)

    rows: list[MemoryEstimate] = []
    for s in STRATEGIES:
        if (s.kind.startswith("fsdp") and num_gpus < 2) or (experts_held > 1 and s.kind not in ("ddp", "lora")):
            continue
        last = None  # the previous row of this strategy without a searched context degree
        for mode in strategy_modes(s):
            mode = replace(mode, ulysses=ulysses, ring=ring)
            if mode.block_swap < 0 and last is not None and last.fits:  # fp8 fits without swapping: no swap row
                continue
            if mode.activation_offload and last is not None and last.fits:  # fits without copying activations
                continue
            if mode.block_swap < 0:  # the fewest swapped blocks that fit (all but one when none does)
                # 3 or more: with 2 blocks in flight, fewer save nothing (activation offload: none tried first)
                counts_tried = ([0] if mode.activation_offload else []) + list(range(3, counts.num_layers))
                swaps = [estimate(s, replace(mode, block_swap=n)) for n in counts_tried]
                if swaps:
                    last = next((e for e in swaps if e.fits), swaps[-1])
                    rows.append(last)
                continue
            last = estimate(s, mode)
            rows.append(last)
            if degrees and not last.fits and mode.transfer_rank <= 1:  # split the sample: the fewest ranks that fit
                split = [estimate(s, replace(mode, ulysses=d)) for d in degrees]
                rows.append(next((e for e in split if e.fits), split[-1]))
    estimates = tuple(rows)
    order = {s: i for i, s in enumerate(STRATEGIES)}
    # A full fine-tune stays one while any mode fits it (LoRA trains another thing); then the modes by transfer.
    ranked = sorted(estimates, key=lambda e: ("lora" in e.strategy.kind, e.mode.transfer_rank, order[e.strategy]))
    chosen = next((e for e in ranked if e.fits and (not lora_job or "lora" in e.strategy.kind)), None)
    notes = []
    if lora_job:
        notes.append("model.lora is set: picked among the lora strategies (the full fine-tunes are for reference)")
    if experts_held > 1:
        notes.append(f"model.experts: every worker holds {experts_held} experts of {_parameters(counts.total)} "
                     "parameters (their weights, gradients and optimizer state), trained with ddp (full or lora)")
    elif expert_groups:
        notes.append(f"model.experts layout groups: each worker holds one expert of {_parameters(counts.total)} "
                     f"parameters, planned on its group of {num_gpus} GPU(s) (ddp, or fsdp within the group; lora "
                     "per expert)")
    elif preset.num_experts > 1:
        notes.append(f"{preset.name} has {preset.num_experts} experts of {_parameters(counts.total)} parameters; "
                     f"planned for one on the GPU (one trains per process)")
    if num_gpus < 2:
        notes.append("fsdp needs 2 or more GPUs: not listed")
    cp_rows = [e for e in estimates if e.mode.context_degree > 1]
    if cp_rows:  # the traffic of the picked degree (else of the smallest listed), beside the gradients' exchange
        shown = chosen if chosen is not None and chosen.mode.context_degree > 1 else min(
            cp_rows, key=lambda e: (e.mode.context_degree, not e.fits, not e.strategy.activation_checkpointing))
        notes.append(_context_note(preset, counts, shown, bucket, text_tokens, batch_size))
    if host_memory_bytes is not None and any(not e.fits_host for e in estimates):
        notes.append(f"host: {per_node} rank(s) per node share {format_bytes(host_memory_bytes)}, "
                     f"{100 * HOST_HEADROOM:.0f}% kept free; a mode whose pinned host memory exceeds that is refused")
    return PlanReport(preset=preset, counts=counts, bucket=bucket, batch_size=batch_size, text_tokens=text_tokens,
                      num_gpus=num_gpus, gpu_memory_bytes=gpu_memory_bytes, estimates=estimates, chosen=chosen,
                      notes=tuple(notes), host_memory_bytes=host_memory_bytes, lora_job=lora_job)


def _context_note(preset: ShapePreset, counts: ModelCounts, e: MemoryEstimate, bucket: Bucket, text_tokens: int,
                  batch_size: int) -> str:
    """The note on a context-parallel row's traffic per rank and step, beside its gradients' exchange."""
    m, s = e.mode, e.strategy
    kwargs = dict(ulysses=m.ulysses, ring=m.ring, precision=s.precision,
                  activation_checkpointing=s.activation_checkpointing, text_tokens=text_tokens, batch_size=batch_size)
    per_layer = context_traffic_bytes(preset, bucket, **kwargs)
    step = context_step_traffic_bytes(preset, bucket, **kwargs)
    fsdp = s.kind.startswith("fsdp")
    trained = counts.lora_parameters if "lora" in s.kind else counts.trainable
    gradients = 4 * trained * (1.5 if fsdp else 1.0)
    kind = ("ulysses all-to-alls" if m.ring == 1 else
            "ring passes" if m.ulysses == 1 else "all-to-alls and ring passes")
    return (f"context parallel cp {m.context_degree} ({s.name}): {kind} send {format_bytes(step)} per rank per step "
            f"({format_bytes(per_layer)} per block x {counts.num_layers} + the output gather), within the node; the "
            f"gradients' exchange is {format_bytes(gradients)} per step ({'fsdp ~1.5x ' if fsdp else ''}4 bytes x "
            f"{_parameters(trained)} trained); the data-parallel width is the GPUs / {m.context_degree}")


def _parameters(count: int) -> str:
    """A parameter count for a note: '14.3 B', '12.1 M', or '44,448' below a million."""
    if count >= 1e9:
        return f"{count / 1e9:.1f} B"
    return f"{count / 1e6:.1f} M" if count >= 1e6 else f"{count:,}"


def job_preset(job: Any) -> ShapePreset:
    """The transformer shape of `job`: `model.pretrained_path`'s transformer/config.json when `model.init` is
    pretrained, else the family's preset `model.preset` names (`vidray.models.presets.model_preset`) with the
    config of the transformer the family builds for `job.model` (its image-to-video channels, Wan 2.1's image
    embeddings, CogVideoX 1.5's `patch_size_t`). Raises UserError / UserFileNotFound."""
    if job.model.init == "pretrained":
        return preset_from_pretrained(job.model.pretrained_path)
    shape = model_preset(job.model.family, job.model.preset, job.model.text_encoder)
    # The transformer the family builds for this model config (an image-to-video one takes its condition channels,
    # Wan 2.1's its CLIP image embeddings too): built on the meta device, its config is the shape planned.
    import torch  # heavy: torch

    from vidray.models import get_family  # heavy: torch, numpy

    with torch.device("meta"):
        transformer = get_family(job.model.family).load_diffusion_models(job.model, seed=job.train.seed).transformer
    config = {k: v for k, v in dict(transformer.config).items() if not k.startswith("_")}
    return ShapePreset(**{**shape.__dict__, "config": config})


def _job_in_channels(job: Any) -> int:
    """The transformer's input channels for `job` (an image-to-video one's condition channels included): from
    `model.pretrained_path`'s config when that folder exists, else as the family builds its random model for the
    same `model:` section (the channel rule depends on the family and `model.i2v`, not on the size), so a config
    whose pretrained folder is a placeholder still plans with `--preset`."""
    if job.model.init == "pretrained" and not (Path(job.model.pretrained_path) / "transformer").is_dir():
        model = dataclasses.replace(job.model, init="random", pretrained_path=None, preset="tiny")
        job = dataclasses.replace(job, model=model)
    return job_preset(job).config["in_channels"]


def largest_bucket(job: Any, preset: ShapePreset) -> tuple[Bucket, int]:
    """The bucket of `job.data.buckets` whose micro-batch has the most tokens, and its batch size
    (`data.tokens_per_batch`'s rule when set, else `data.batch_size_per_worker`)."""
    best = None
    for bucket in job.data.buckets:
        bucket = Bucket(*bucket)
        tokens, _ = sequence_lengths(preset, bucket)
        if job.data.tokens_per_batch:
            batch = max(1, job.data.tokens_per_batch // tokens)
        else:
            batch = job.data.batch_size_per_worker
        if best is None or tokens * batch > best[0]:
            best = (tokens * batch, bucket, batch)
    return best[1], best[2]


def _encoders_on_gpu(job: Any, preset: ShapePreset, storage: StorageDtype | None = None) -> int:
    """Bytes of the frozen encoders whose stage takes a fraction of a GPU (Ray packs it beside a trainer), stored
    in `storage` (None or fp32: as they run without `memory.storage_dtype`: the text encoder in its checkpoint's
    dtype, the VAE fp32; bf16: 2 bytes a parameter; fp8: 1, nearly all of both being Linear / conv weights)."""
    total = 0
    if 0 < job.placement.text.num_gpus < 1:
        total += preset.text_encoder_params * (preset.text_encoder_bytes_per_param if storage in (None, "fp32")
                                               else min(STORAGE_BYTES[storage], preset.text_encoder_bytes_per_param))
    if 0 < job.placement.vae.num_gpus < 1:
        total += preset.vae_params * STORAGE_BYTES[storage or "fp32"]
    return total


def job_context(job: Any) -> tuple[int, int]:
    """(ulysses, ring) of `job`'s `parallel.context` ((1, 1) when the config has none)."""
    context = getattr(getattr(job, "parallel", None), "context", None)
    return (context.ulysses, context.ring) if context is not None else (1, 1)


def job_mode(job: Any) -> MemoryMode:
    """The memory mode `job` asks for (`memory:`, and `parallel.context`'s degrees): `storage_dtype` auto is bf16
    with `scaling.use_gpu` (the device vidray plans), fp32 without; a LoRA base sharded by FSDP2 (fsdp / hsdp) is
    fp32."""
    ulysses, ring = job_context(job)
    memory = getattr(job, "memory", None)
    if memory is None:
        return MemoryMode("bf16" if job.scaling.use_gpu else "fp32", ulysses=ulysses, ring=ring)
    storage = memory.storage_dtype if memory.storage_dtype != "auto" else ("bf16" if job.scaling.use_gpu else "fp32")
    if job.model.lora is not None and job.scaling.strategy != "ddp":
        storage = "fp32"  # FSDP2 shards the frozen base as fp32 (config refuses bf16 / fp8 there)
    return MemoryMode(storage, block_swap=memory.block_swap, fsdp_cpu_offload=memory.fsdp_cpu_offload,
                      activation_offload=getattr(memory, "activation_offload", False), ulysses=ulysses, ring=ring)


HOST_MEMORY_ENV = "VIDRAY_HOST_MEMORY"
"""Environment variable giving one node's host memory (e.g. `256GiB`) for the host check of offload modes."""


def host_memory_bytes() -> int:
    """One node's host memory: `$VIDRAY_HOST_MEMORY` when set, else this machine's physical memory
    (`os.sysconf`: SC_PHYS_PAGES x SC_PAGE_SIZE)."""
    if os.environ.get(HOST_MEMORY_ENV):
        return parse_bytes(os.environ[HOST_MEMORY_ENV])
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def plan_job(job: Any, *, gpu_memory_bytes: int, num_gpus: int, preset: ShapePreset | None = None,
             bucket: Bucket | None = None, host_memory: int | None = None) -> PlanReport:
    """`plan` for a loaded job config: its model (or `preset`), its largest bucket (or `bucket`, with batch size 1
    when given), `model.max_sequence_length` text tokens (or the preset's when `preset` is given), the job's
    encoder placement and gradient accumulation, and `model.lora`'s rank and targets where the config has them.
    `host_memory`: one node's host memory the offload modes are checked against (None: not checked).
    A family whose card has no planner facts (AnimateDiff's UNet) is planned by `plan_measured`."""
    if get_card(job.model.family).planner is None:
        return plan_measured(job, gpu_memory_bytes=gpu_memory_bytes, num_gpus=num_gpus, bucket=bucket)
    if preset is None:
        preset = job_preset(job)
    elif job.model.i2v is not None and preset.family == job.model.family:
        # A preset is a text-to-video layout: an image-to-video job's transformer takes its condition channels too
        # (Wan 36, EasyAnimate InP 33, CogVideoX I2V 32), as the family builds it.
        in_channels = _job_in_channels(job)
        preset = ShapePreset(**{**preset.__dict__, "config": {**preset.config, "in_channels": in_channels}})
    if bucket is None:
        bucket, batch = largest_bucket(job, preset)
    else:
        batch = 1
    text_tokens = preset.text_seq_len if preset.name not in ("tiny", "medium") and job.model.init != "pretrained" \
        else job.model.max_sequence_length
    lora = job.model.lora
    rank = lora.rank if lora else DEFAULT_LORA_RANK
    targets = tuple(lora.target_modules) if lora else None
    held = _experts_held(job)
    groups = getattr(job.model, "experts", None) is not None and held == 1
    if groups:  # each expert on its half of the GPUs
        num_gpus = max(num_gpus // 2, 1)
    context = job_context(job)
    data_parallel = max(num_gpus // (context[0] * context[1]), 1)  # a context group trains one micro-batch
    micro = (math.ceil(job.micro_batches_per_step / data_parallel) if hasattr(job, "micro_batches_per_step")
             else 1)
    return plan(preset, bucket=bucket, batch_size=batch, text_tokens=text_tokens, num_gpus=num_gpus,
                gpu_memory_bytes=gpu_memory_bytes, lora_rank=rank, lora_targets=targets,
                encoders_bytes={s: _encoders_on_gpu(job, preset, s) for s in STORAGE_BYTES},
                micro_batches_per_rank=micro, experts_held=held, expert_groups=groups, lora_job=lora is not None,
                host_memory_bytes=host_memory, ranks_per_node=min(num_gpus * (2 if groups else 1), 8),
                context=context)


MEASURED_STRATEGIES: tuple[Strategy, ...] = tuple(Strategy("ddp", ac, precision) for ac in (False, True)
                                                  for precision in ("bf16", "fp32"))
"""What `plan_measured` plans for a family without the DiT formulas: DDP (the family's trainable parameters:
AnimateDiff's motion modules), with or without `full` activation checkpointing, bf16 or fp32."""


def plan_measured(job: Any, *, gpu_memory_bytes: int, num_gpus: int, bucket: Bucket | None = None) -> PlanReport:
    """The plan of a job whose family has no per-block formulas (AnimateDiff's UNet): its transformer, as the family
    builds it, on the meta device, one forward and backward of its largest bucket (or `bucket`, batch 1) measured
    there (`vidray.train.memory.measure_meta_step`: parameters, gradients of the trained parameters, activations),
    with and without `enable_gradient_checkpointing`; then, per rank, AdamW's state (8 bytes a trained parameter),
    DDP's buckets (4, with 2 or more GPUs) and the encoders sharing the GPU are added. bf16 autocast is planned as
    the fp32 measurement plus a bf16 copy of every Linear / conv weight (2 bytes each): its activations are narrower,
    so this is an upper bound (1.7x the measured bf16 step of the tiny UNet on CPU; fp32 plans ~7 % high:
    `tests/unit/test_plan.py`). The encoders are not planned (0). Raises UserError for a bucket the family refuses."""
    import torch  # heavy: torch

    from vidray.models import get_family  # heavy: torch, numpy
    from vidray.train.memory import measure_meta_step  # heavy: torch, numpy

    family = get_family(job.model.family)
    if bucket is None:
        bucket, batch = max(((Bucket(*b), job.data.batch_size_per_worker) for b in job.data.buckets),
                            key=lambda bb: math.prod(bb[0]) * bb[1])
    else:
        bucket, batch = Bucket(*bucket), 1
    text_tokens = job.model.max_sequence_length
    with torch.device("meta"):
        transformer = family.load_diffusion_models(job.model, seed=job.train.seed).transformer
    for name in family.no_grad_parameter_names(transformer):  # trained parameters that get no gradient
        transformer.get_parameter(name).requires_grad_(False)
    transformer.train()
    try:
        shape = family.latent_shape(bucket, batch)
    except ValueError as err:
        raise UserError(f"bucket {bucket.num_frames}x{bucket.height}x{bucket.width}: {err}") from None
    width = family.prompt_embeds_dim(transformer)

    def loss() -> torch.Tensor:
        latents = torch.randn(shape, device="meta")
        pred = family.predict(transformer, latents, torch.full((batch,), 500.0, device="meta"),
                              torch.randn(batch, text_tokens, width, device="meta"),
                              torch.ones(batch, text_tokens, dtype=torch.bool, device="meta"))
        return torch.nn.functional.mse_loss(pred.float(), torch.randn_like(pred, dtype=torch.float32))

    measured: dict[bool, tuple[int, int]] = {False: measure_meta_step(transformer, loss)}
    transformer.zero_grad(set_to_none=True)
    transformer.enable_gradient_checkpointing()  # train.activation_checkpointing: full
    measured[True] = measure_meta_step(transformer, loss)
    total = sum(p.numel() for p in transformer.parameters())
    trained = sum(p.numel() for p in transformer.parameters() if p.requires_grad)
    cast = sum(m.weight.numel() for m in transformer.modules()
               if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d, torch.nn.Conv3d)))
    encoders = 0
    estimates = []
    for strategy in MEASURED_STRATEGIES:
        parameter_bytes, step_peak = measured[strategy.activation_checkpointing]
        copies = 2 * cast if strategy.precision == "bf16" else 0
        optimizer, buckets, gradients = 8 * trained, (4 * trained if num_gpus > 1 else 0), 4 * trained
        activations = max(step_peak - parameter_bytes - gradients, 0) + copies
        peak = max(step_peak + copies, parameter_bytes + gradients) + optimizer + buckets + encoders
        estimates.append(MemoryEstimate(strategy=strategy, parameters=parameter_bytes, gradients=gradients,
                                        optimizer=optimizer, activations=activations, activations_peak_block=0,
                                        ddp_buckets=buckets, encoders=encoders, peak_bytes=peak,
                                        fits=peak <= (1 - HEADROOM) * gpu_memory_bytes))
    preset = ShapePreset(name=f"{job.model.family} ({job.model.init}: {job.model.pretrained_path or job.model.preset})",
                         family=job.model.family, config={})
    counts = ModelCounts(total=total, trainable=trained, blocks=(), block_matmul_weights=(),
                         other_matmul_weights=cast, lora_parameters=0, lora_rank=0, num_layers=0,
                         num_mmdit_layers=0, dim=0, ffn_dim=0, heads=0, head_dim=0)
    chosen = next((e for e in estimates if e.fits), None)
    notes = (f"{job.model.family}: measured on the meta device (one forward and backward of the bucket); planned "
             "with ddp only (fsdp and lora are not trained for this family)",)
    return PlanReport(preset=preset, counts=counts, bucket=bucket, batch_size=batch, text_tokens=text_tokens,
                      num_gpus=num_gpus, gpu_memory_bytes=gpu_memory_bytes, estimates=tuple(estimates),
                      chosen=chosen, notes=notes, measured=True)


def _experts_held(job: Any) -> int:
    """Transformers each worker holds: 2 with `model.experts` layout shared, else 1 (layout groups: one expert per
    worker, `vidray.train.expert_groups`)."""
    experts = getattr(job.model, "experts", None)
    return 2 if experts is not None and getattr(experts, "layout", "shared") == "shared" else 1


def job_strategy(job: Any) -> Strategy:
    """The strategy `job` asks for: `scaling.strategy` (ddp when the config has no such key yet), `model.lora`
    (lora when set), `train.activation_checkpointing` (off when absent or `none`), `train.mixed_precision`."""
    kind = getattr(job.scaling, "strategy", "ddp")  # scaling.strategy: FSDP
    if kind == "hsdp":
        kind = "fsdp"
    if job.model.lora:
        kind = "fsdp+lora" if kind == "fsdp" else "lora"
    ac = job.train.activation_checkpointing != "none"
    precision: Precision = "bf16" if job.train.mixed_precision in ("bf16", "fp16") else "fp32"
    return Strategy(kind, ac, precision)


def check_fits(job: Any, gpu_memory_bytes: int, num_gpus: int, *, host_memory: int | None = None,
               preset: ShapePreset | None = None) -> PlanReport:
    """Plan `job` on `num_gpus` GPUs of `gpu_memory_bytes` and refuse it when its own strategy, in its own memory
    mode (`memory:`), is predicted not to fit the GPU, or (with `host_memory`, one node's bytes) its pinned host
    memory the node: raises UserError, one line, naming the predicted peak, the GPU and the strategy and mode that
    would fit with their config keys (or that none does, and the largest bucket to lower). Returns the report
    when it fits. `preset`: plan this shape instead of the job's model (`vidray plan --preset`)."""
    report = plan_job(job, gpu_memory_bytes=gpu_memory_bytes, num_gpus=num_gpus, host_memory=host_memory,
                      preset=preset)
    wanted = job_strategy(job)
    if report.measured:  # every strategy such a family trains with is in the report
        requested = next((e for e in report.estimates if e.strategy == wanted), None)
        if requested is None:
            raise UserError(f"the planner has no {wanted.name} for model.family {job.model.family} (it plans "
                            f"{', '.join(e.strategy.name for e in report.estimates)}): set scaling.strategy=ddp "
                            "without model.lora")
        report = replace(report, requested=requested)
        if requested.fits:
            return report
        budget = (1 - HEADROOM) * gpu_memory_bytes
        fix = (f"{report.chosen.strategy.name} fits ({format_bytes(report.chosen.peak_bytes)}): "
               f"{_how(report.chosen)}" if report.chosen is not None else
               "no strategy fits: lower the largest bucket or data.batch_size_per_worker, or use larger GPUs")
        raise UserError(f"predicted out of memory: {wanted.name} needs {format_bytes(requested.peak_bytes)} per GPU "
                        f"for bucket {report.bucket.num_frames}x{report.bucket.height}x{report.bucket.width} "
                        f"x{report.batch_size}, over {format_bytes(budget)} ({100 - 100 * HEADROOM:.0f}% of "
                        f"{format_bytes(gpu_memory_bytes)}); {fix} (`vidray plan` prints the table)")
    if wanted.kind.startswith("fsdp") and report.num_gpus < 2:  # one rank holds everything: planned as unsharded
        wanted = replace(wanted, kind="lora" if wanted.kind == "fsdp+lora" else "ddp")
    counts = report.counts
    mode = job_mode(job)
    if wanted.precision == "fp32" and mode.storage != "fp32":
        mode = replace(mode, storage="fp32")  # fp32 compute: the frozen weights are planned as fp32 (no autocast)
    try:
        requested = estimate_memory(report.preset, counts, wanted, bucket=report.bucket, batch_size=report.batch_size,
                                    text_tokens=report.text_tokens, num_gpus=report.num_gpus,
                                    encoders_bytes=_encoders_on_gpu(job, report.preset, mode.storage),
                                    gpu_memory_bytes=gpu_memory_bytes, experts_held=_experts_held(job), mode=mode,
                                    host_memory_bytes=host_memory,
                                    ranks_per_node=min(job.scaling.max_workers if hasattr(job.scaling, "max_workers")
                                                       else num_gpus, 8))
    except ValueError as err:
        raise UserError(f"memory: {err}: {mode.keys()} does not apply to {wanted.name}") from None
    report = replace(report, requested=requested)
    if requested.fits:
        return report
    budget = (1 - HEADROOM) * gpu_memory_bytes
    bucket = f"{report.bucket.num_frames}x{report.bucket.height}x{report.bucket.width} x{report.batch_size}"
    if requested.peak_bytes <= budget:  # the GPU fits; the node's host memory does not
        where = (f"{wanted.name}, {mode.name} needs {format_bytes(requested.host_bytes)} of pinned host memory per "
                 f"rank, over {100 - 100 * HOST_HEADROOM:.0f}% of the node's {format_bytes(host_memory)}")
    else:
        where = (f"{wanted.name}, {mode.name} needs {format_bytes(requested.peak_bytes)} per GPU for bucket {bucket}, "
                 f"over {format_bytes(budget)} ({100 - 100 * HEADROOM:.0f}% of {format_bytes(gpu_memory_bytes)})")
    if report.chosen is not None:
        fix = f"{report.chosen.name} fits ({format_bytes(report.chosen.peak_bytes)}): {_how(report.chosen)}"
    else:
        fix = none_fits(report)
    raise UserError(f"predicted out of memory: {where}; {fix} (`vidray plan` prints the table)")


def _how(estimate: MemoryEstimate) -> str:
    """The config keys that ask for `estimate`'s strategy and memory mode."""
    strategy = estimate.strategy
    keys = {"ddp": "scaling.strategy=ddp", "fsdp": "scaling.strategy=fsdp", "lora": "set model.lora",
            "fsdp+lora": "scaling.strategy=fsdp and set model.lora"}[strategy.kind]
    ac = " train.activation_checkpointing=full" if strategy.activation_checkpointing else ""
    return (f"{keys}{ac} train.mixed_precision={'bf16' if strategy.precision == 'bf16' else 'no'} "
            f"{estimate.mode.keys()}")


# 6. Units and the table.

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'80GiB', '80GB', '141 GB', '81920MiB', '1e9' -> bytes (GB = 10**9, GiB = 2**30). Raises UserError for
    anything else, naming the forms accepted."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS or float(match.group(1)) <= 0:
        raise UserError(f"bad memory size {text!r}: give a positive number with a unit, e.g. 80GiB, 80GB, 141GB "
                        f"or 81920MiB")
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: float) -> str:
    """Bytes in GiB with one decimal (MiB under 1 GiB)."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def format_report(report: PlanReport) -> str:
    """The plan as a fixed-width table (GiB per rank), the pick and the notes."""
    c = report.counts
    b = report.bucket
    if report.measured:
        head = [f"model {report.preset.name}: {c.total:,} parameters, {c.trainable:,} trained",
                f"largest bucket {b.num_frames}x{b.height}x{b.width} x{report.batch_size} per GPU, "
                f"{report.text_tokens} text tokens; {report.num_gpus} GPU(s) of "
                f"{format_bytes(report.gpu_memory_bytes)}, {100 * HEADROOM:.0f}% headroom"]
    else:
        head = [f"model {report.preset.name}: {c.total:,} parameters ({c.num_layers} blocks x {c.dim}), LoRA rank "
                f"{c.lora_rank}: {c.lora_parameters:,} adapter parameters",
                f"largest bucket {b.num_frames}x{b.height}x{b.width} x{report.batch_size} per GPU: "
                f"{sequence_lengths(report.preset, b)[0]:,} video + {report.text_tokens} text tokens; "
                f"{report.num_gpus} GPU(s) of {format_bytes(report.gpu_memory_bytes)}, {100 * HEADROOM:.0f}% headroom"]
    lines = [
        *head,
        "",
        f"{'strategy':<18}{'memory mode':<34}{'params':>8}{'grads':>8}{'optim':>8}{'activ':>8}{'AC blk':>8}"
        f"{'buckets':>8}{'encoders':>9}{'peak':>8}{'host':>8}  fits",
    ]

    unit, scale = ("GiB", 2**30) if max(e.peak_bytes for e in report.estimates) >= 2**30 else ("MiB", 2**20)

    def gib(x: float) -> str:
        return f"{x / scale:.1f}"

    for e in report.estimates:
        mark = "yes" if e.fits else ("no (host)" if not e.fits_host else "no")
        if report.chosen is e:
            mark += "  <- picked"
        lines.append(f"{e.strategy.name:<18}{e.mode.name:<34}{gib(e.parameters):>8}{gib(e.gradients):>8}"
                     f"{gib(e.optimizer):>8}{gib(e.activations):>8}{gib(e.activations_peak_block):>8}"
                     f"{gib(e.ddp_buckets):>8}{gib(e.encoders):>9}{gib(e.peak_bytes):>8}{gib(e.host_bytes):>8}  {mark}")
    lines.append("")
    lines.append(f"{unit} per rank; peak = simulated peak of a step (gradients replace activations during the backward, "
                 "so it is below the sum); host = pinned host memory per rank (block swap, FSDP CPU offload, "
                 "activation offload)")
    if report.chosen is not None:
        c = report.chosen
        lines.append(f"picked: {c.name}: {format_bytes(c.peak_bytes)} per GPU, {format_bytes(c.host_bytes)} pinned "
                     f"host memory per rank ({_how(c)})")
    else:
        lines.append(f"picked: {none_fits(report)}")
    lines.extend(f"note: {n}" for n in report.notes)
    return "\n".join(lines)


# 7. On a cluster: the GPUs' memory, and the check `vidray doctor` and `vidray train` run.

GPU_MEMORY_ENV = "VIDRAY_GPU_MEMORY"
"""Environment variable giving one GPU's memory (e.g. `80GiB`) when the cluster's accelerator type does not say it."""

ACCELERATOR_MEMORY_BYTES = {
    "A100-40G": 40 * 2**30, "A100-80G": 80 * 2**30, "H100": 80 * 2**30, "H200": 141 * 10**9, "H20": 96 * 2**30,
    "B200": 180 * 10**9, "L40S": 48 * 2**30, "L4": 24 * 2**30, "A10G": 24 * 2**30, "V100": 16 * 2**30,
    "T4": 16 * 2**30, "AMD-Instinct-MI300X-OAM": 192 * 2**30,
}
"""Memory of one GPU by Ray accelerator type (the `accelerator_type:<type>` resource Ray gives GPU nodes; vendor
datasheets). A plain `A100` is ambiguous (40 or 80 GB) and left out: set VIDRAY_GPU_MEMORY."""


def cluster_gpu_memory_bytes(resources: dict[str, float]) -> int | None:
    """One GPU's memory on a cluster: `$VIDRAY_GPU_MEMORY` when set, else the smallest known memory among the
    `accelerator_type:*` resources in `resources` (`ray.cluster_resources()`), else None (unknown)."""
    if os.environ.get(GPU_MEMORY_ENV):
        return parse_bytes(os.environ[GPU_MEMORY_ENV])
    known = [ACCELERATOR_MEMORY_BYTES[k.split(":", 1)[1]] for k in resources
             if k.startswith("accelerator_type:") and k.split(":", 1)[1] in ACCELERATOR_MEMORY_BYTES]
    return min(known) if known else None


def check_cluster_fits(job: Any, resources: dict[str, float], *, gpu_memory_bytes: int | None = None) -> str | None:
    """`check_fits` for a job on a cluster with `resources` (`ray.cluster_resources()`): nothing (None) when the
    cluster has no GPU or the job does not use one (CPU runs are not planned); raises UserError when the job's
    strategy is predicted not to fit; else a one-line summary. When the GPUs' memory is unknown, the summary says
    so and how to give it (VIDRAY_GPU_MEMORY) instead of refusing. `gpu_memory_bytes`: one GPU's memory when the
    caller knows it (the local GPU's `torch.cuda.get_device_properties(0).total_memory`). The pinned host memory of
    an offload mode is checked against `$VIDRAY_HOST_MEMORY` (one node's) when set; Ray's resources do not give one
    node's physical memory, so without it the host is not checked here."""
    if not resources.get("GPU", 0) or not job.scaling.use_gpu:
        return None
    gpu_memory = gpu_memory_bytes or cluster_gpu_memory_bytes(resources)
    if gpu_memory is None:
        return (f"the GPUs' memory is unknown (no accelerator_type the planner knows): set {GPU_MEMORY_ENV}=80GiB "
                f"(one GPU's memory) to check the job fits before GPUs are reserved")

    host = parse_bytes(os.environ[HOST_MEMORY_ENV]) if os.environ.get(HOST_MEMORY_ENV) else None
    report = check_fits(job, gpu_memory, job.scaling.min_workers, host_memory=host)
    e = report.requested
    return (f"{e.strategy.name} predicted {format_bytes(e.peak_bytes)} per GPU of {format_bytes(gpu_memory)} "
            f"(`vidray plan` for the table)")
