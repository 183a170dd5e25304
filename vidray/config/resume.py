"""Resume rules: which keys of a saved job config a resumed run may change (`RESUME_RULES`), and the difference
between a checkpoint's config and the resumed one (`diff_for_resume`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from vidray.config.job import JobConfig


# Resume rules: every leaf key of a JobConfig is either fixed for the run or changeable on resume.
RESUME_FIXED = "fixed"
RESUME_CHANGEABLE = "changeable"
RESUME_RULES: dict[str, str] = {
    # Where the run lives and what it starts from: a run may be moved, renamed or branched.
    "name": RESUME_CHANGEABLE,
    "storage.path": RESUME_CHANGEABLE,
    "checkpoint.resume_from": RESUME_CHANGEABLE,
    "checkpoint.resume": RESUME_CHANGEABLE,
    "checkpoint.upload": RESUME_CHANGEABLE,
    # The model: the checkpoint's weights only fit the architecture, text encoder and prompt length they were
    # trained with (a changed text encoder fails as a tensor-shape error inside the workers).
    "model.family": RESUME_FIXED,
    "model.preset": RESUME_FIXED,
    "model.init": RESUME_FIXED,
    "model.pretrained_path": RESUME_FIXED,
    "model.text_encoder": RESUME_FIXED,
    "model.max_sequence_length": RESUME_FIXED,
    "model.vae_path": RESUME_FIXED,  # the latents the DiT learns come from this VAE
    "model.lora": RESUME_FIXED,  # the adapters' shapes and scale; a LoRA checkpoint holds only adapter weights
    "model.i2v": RESUME_FIXED,  # the transformer's input channels (inpaint latents) and what the data gives it
    "model.experts": RESUME_FIXED,  # one transformer or two, where they switch, which workers hold which and where
    # Where weights live: the checkpoint holds fp32 trainable weights in every mode, so a resumed run may change
    # how the frozen ones are stored or offloaded (the loss moves a little with the storage dtype).
    "memory.storage_dtype": RESUME_CHANGEABLE,
    "memory.block_swap": RESUME_CHANGEABLE,
    "memory.activation_offload": RESUME_CHANGEABLE,
    "memory.fsdp_cpu_offload": RESUME_CHANGEABLE,
    "memory.offload": RESUME_CHANGEABLE,
    # The data: shard identity is checked by the index's content hash, so folder and prepare-only keys may
    # change; buckets, fps and the batch sizes define the epoch's micro-batches, which the saved data position
    # counts (per bucket), so they must stay as they were.
    "data.source": RESUME_CHANGEABLE,
    "data.shards_dir": RESUME_CHANGEABLE,
    "data.cache_dir": RESUME_CHANGEABLE,  # a cache: where and how big does not change what is trained
    "data.cache_bytes": RESUME_CHANGEABLE,
    "data.samples_per_shard": RESUME_CHANGEABLE,
    "data.split_scenes": RESUME_CHANGEABLE,  # prepare-only (scene splitting); the shards' hash is checked
    "data.scene_threshold": RESUME_CHANGEABLE,
    "data.min_scene_s": RESUME_CHANGEABLE,
    "data.max_clips_per_scene": RESUME_CHANGEABLE,
    "data.max_clips_per_source": RESUME_CHANGEABLE,
    "data.min_source_side_px": RESUME_CHANGEABLE,  # prepare-only: which sources are too small to keep
    "data.max_upscale": RESUME_CHANGEABLE,
    "data.max_rate_change": RESUME_CHANGEABLE,  # prepare-only: which short sources are kept
    "data.group_by_caption": RESUME_CHANGEABLE,  # prepare-only: how samples are grouped into shards
    "data.hot_bytes": RESUME_CHANGEABLE,  # loader budgets and prefetch depth: how fast, not what is trained
    "data.prefetch_batches": RESUME_CHANGEABLE,
    "data.prefetch_window_batches": RESUME_CHANGEABLE,
    "data.block_batches": RESUME_CHANGEABLE,
    "data.loader_cpus": RESUME_CHANGEABLE,
    "data.latent_cache": RESUME_CHANGEABLE,  # keyed by content and encoder weights: any cache gives the same latents
    "data.shuffle_block_shards": RESUME_FIXED,  # defines each epoch's sample order, which the position counts
    "data.buckets": RESUME_FIXED,
    "data.fps": RESUME_FIXED,
    "data.batch_size_per_worker": RESUME_FIXED,
    "data.tokens_per_batch": RESUME_FIXED,
    # The objective: another sigma distribution, shift or timestep scale is a different run.
    "flow.sigma_sampling": RESUME_FIXED,
    "flow.logit_mean": RESUME_FIXED,
    "flow.logit_std": RESUME_FIXED,
    "flow.shift": RESUME_FIXED,
    "flow.num_train_timesteps": RESUME_FIXED,
    # The optimizer's hyperparameters are re-applied to the restored AdamW state; the lr schedule is rebuilt
    # from the new optim section at the resumed step.
    "optim.lr": RESUME_CHANGEABLE,
    "optim.betas": RESUME_CHANGEABLE,
    "optim.weight_decay": RESUME_CHANGEABLE,
    "optim.eps": RESUME_CHANGEABLE,
    "optim.warmup_steps": RESUME_CHANGEABLE,
    # Run length, cadences and fault tolerance.
    "train.max_steps": RESUME_CHANGEABLE,
    "train.grad_clip_norm": RESUME_CHANGEABLE,
    "train.log_every_steps": RESUME_CHANGEABLE,
    "train.max_failures": RESUME_CHANGEABLE,
    "train.metrics_port": RESUME_CHANGEABLE,
    "train.ray_metrics": RESUME_CHANGEABLE,
    "train.seed": RESUME_FIXED,  # the noise, sigmas and sample schedule of every step derive from it
    "train.mixed_precision": RESUME_FIXED,  # the numerics of every step; a change is a different run
    "train.activation_checkpointing": RESUME_CHANGEABLE,  # the same gradients, another memory/compute trade
    "train.grad_accumulation_steps": RESUME_CHANGEABLE,  # the global batch: as train.micro_batches_per_step
    # Compression changes the all-reduced gradients from then on; PowerSGD's error feedback is restored only when
    # the checkpoint was written with the same rank and worker count (else it starts afresh, with a line).
    "train.grad_compression": RESUME_CHANGEABLE,
    "train.powersgd_rank": RESUME_CHANGEABLE,
    "train.bucket_cap_mb": RESUME_CHANGEABLE,
    # An EMA added on resume starts from the resumed weights; a changed decay applies from then on.
    "train.ema.decay": RESUME_CHANGEABLE,
    "train.ema.update_every_steps": RESUME_CHANGEABLE,
    "train.ema": RESUME_CHANGEABLE,
    # Validation only reads checkpoints: any of it may change on resume.
    **{f"train.validation.{key}": RESUME_CHANGEABLE for key in (
        "every_steps", "prompts", "images", "num_inference_steps", "guidance_scale", "seed", "bucket", "num_cpus")},
    "export.weights": RESUME_CHANGEABLE,
    "train.objective": RESUME_FIXED,  # a VAE run's checkpoint holds a VAE, a DiT run's a transformer
    # `vidray train-vae`'s section: the VAE run copies it into its own train/optim/data keys, which the rules
    # above govern; in a DiT run it is unused.
    **{f"vae_training.{key}": RESUME_CHANGEABLE for key in (
        "max_steps", "lr", "warmup_steps", "batch_size_per_worker", "l1_weight", "mse_weight", "kl_weight")},
    "checkpoint.every_steps": RESUME_CHANGEABLE,
    "checkpoint.num_to_keep": RESUME_CHANGEABLE,
    # Resources: the schedule's position does not depend on the worker count; another count deals the rest of
    # the epoch to its ranks, each sample still exactly once (vidray.data.schedule).
    "scaling.num_workers": RESUME_CHANGEABLE,  # an int or [min, max]: either may change to the other
    "scaling.resize_check_s": RESUME_CHANGEABLE,
    # Sharded (DCP) checkpoints reshard on load to any strategy, group size and worker count; a full (DDP)
    # checkpoint loads into an FSDP run and a sharded one into a DDP run (`vidray.train.checkpoint`).
    "scaling.strategy": RESUME_CHANGEABLE,
    "scaling.reshard_after_forward": RESUME_CHANGEABLE,
    "scaling.shard_group_size": RESUME_CHANGEABLE,
    # The global batch: the position counts micro-batches, whatever their grouping into steps, so another G
    # continues the epoch with each sample still exactly once (a different effective batch from then on).
    "train.micro_batches_per_step": RESUME_CHANGEABLE,
    "scaling.use_gpu": RESUME_CHANGEABLE,
    # A context group trains one micro-batch as one worker would (the same loss and gradients), and the schedule's
    # position does not depend on the data-parallel width: a resumed run may split samples more, less or not at all.
    "parallel.context.ulysses": RESUME_CHANGEABLE,
    "parallel.context.ring": RESUME_CHANGEABLE,
    "parallel.context.cross_node": RESUME_CHANGEABLE,
    "scaling.cpus_per_worker": RESUME_CHANGEABLE,
    # Where stages run: training is the same on any node.
    "placement.dit.label_selector": RESUME_CHANGEABLE,
    "placement.decode.label_selector": RESUME_CHANGEABLE,
    "placement.vae.label_selector": RESUME_CHANGEABLE,
    "placement.vae.num_cpus": RESUME_CHANGEABLE,
    "placement.vae.num_gpus": RESUME_CHANGEABLE,
    "placement.vae.memory": RESUME_CHANGEABLE,
    "placement.text.label_selector": RESUME_CHANGEABLE,
    "placement.text.num_cpus": RESUME_CHANGEABLE,
    "placement.text.num_gpus": RESUME_CHANGEABLE,
    "placement.text.memory": RESUME_CHANGEABLE,
}
"""Resume rule of every leaf key (dotted) of `JobConfig`: `fixed` keys must equal the checkpoint's saved config
(a change is refused on the driver), `changeable` keys take the new value. `tests/unit/test_config_resume.py`
checks that every field is listed. Keys missing from a saved config (older vidray) compare as equal."""


DICT_LEAVES = ("label_selector", "lora", "i2v", "experts")
"""Config fields whose value is a dict compared as one leaf, not a section: label selectors (label keys contain
dots), `model.lora`, `model.i2v` and `model.experts` (nullable sections: null -> set is one change, fixed for the
run)."""


def flatten_config(raw: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"optim": {"lr": 1e-3}} -> {"optim.lr": 1e-3}: leaf keys of a nested config dict, dotted (a
    `DICT_LEAVES` field stays one leaf with its dict value)."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and key not in DICT_LEAVES:
            out.update(flatten_config(value, dotted + "."))
        else:
            out[dotted] = value
    return out


@dataclasses.dataclass(frozen=True)
class ResumeDiff:
    """Keys whose value differs between a checkpoint's saved config and the job resuming from it.

    fixed, changeable: {dotted key: (checkpoint value, job value)}.
    """

    fixed: dict[str, tuple[Any, Any]]
    changeable: dict[str, tuple[Any, Any]]

    def summary(self) -> str:
        """One line, e.g. `optim.lr: 0.001 -> 1e-05, train.max_steps: 10 -> 20` (empty when nothing changed)."""
        return ", ".join(f"{key}: {_shown(old)} -> {_shown(new)}" for key, (old, new) in self.changeable.items())

    def fixed_summary(self) -> str:
        """`summary` of the fixed keys, joined by "; " (what a refused resume names). A section that is one fixed
        key (`model.experts`, `model.lora`, ...) and is set on both sides is shown by the entries that differ
        (`model.experts.layout: 'groups' -> 'shared'`), not as two whole sections."""
        return "; ".join(f"{k}: {_shown(old)} -> {_shown(new)}" for key, (old, new) in self.fixed.items()
                         for k, (old, new) in _changed_entries(key, old, new))


def _changed_entries(key: str, old: Any, new: Any) -> list[tuple[str, tuple[Any, Any]]]:
    """[(dotted key, (old, new))] of what differs between two values of `key`: the differing entries of two dicts
    (recursively), else the pair itself."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return [(key, (old, new))]
    entries = [entry for k in sorted(set(old) | set(new), key=str) if not _same(old.get(k), new.get(k))
               for entry in _changed_entries(f"{key}.{k}", old.get(k), new.get(k))]
    return entries or [(key, (old, new))]


def _shown(value: Any) -> str:
    """A config value as YAML writes it where Python differs (null, true, false), else its repr."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def _same(old: Any, new: Any) -> bool:
    if isinstance(old, (list, tuple)) and isinstance(new, (list, tuple)):
        return len(old) == len(new) and all(_same(a, b) for a, b in zip(old, new, strict=True))
    if isinstance(old, (int, float)) and isinstance(new, (int, float)) and not isinstance(old, bool):
        return float(old) == float(new)
    return old == new


def diff_for_resume(saved: dict[str, Any], job: JobConfig) -> ResumeDiff:
    """Compare a checkpoint's saved config (`JobConfig.to_dict()` as written) with `job`, key by key.

    Keys absent from `saved` (written by an older vidray) are taken as unchanged; a `model.experts` saved before
    `layout` existed is read as what that vidray trained: `layout: shared`, no expert selectors. Raises KeyError for
    a key of `job` that `RESUME_RULES` does not classify (a bug: every field must be classified).
    """
    old_flat = flatten_config(saved or {})
    old_experts = old_flat.get("model.experts")
    if isinstance(old_experts, dict) and "layout" not in old_experts:
        old_flat["model.experts"] = {**old_experts, "layout": "shared", "high": {"label_selector": {}},
                                     "low": {"label_selector": {}}}
    new_flat = flatten_config(job.to_dict())
    fixed: dict[str, tuple[Any, Any]] = {}
    changeable: dict[str, tuple[Any, Any]] = {}
    for key, new in new_flat.items():
        rule = RESUME_RULES[key]
        if key not in old_flat or _same(old_flat[key], new):
            continue
        (fixed if rule == RESUME_FIXED else changeable)[key] = (old_flat[key], new)
    return ResumeDiff(fixed, changeable)
