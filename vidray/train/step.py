"""One flow-matching training step's maths: pure torch, no Ray, runs on CPU in unit tests."""

from __future__ import annotations

import contextlib
import hashlib
import math
import struct
from typing import Sequence

import torch
import torch.distributed as dist

from vidray.config import FlowConfig
from vidray.diffusion.flow_matching import flow_matching_loss, sample_sigmas
from vidray.errors import UserError
from vidray.models.conditioning import ImageCondition


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """`memory.activation_offload`: while active (`with offload:`), every tensor autograd saves for the backward is
    copied to host memory (pinned when `pin_memory`, so the copies can be asynchronous) and copied back to its device
    when the backward unpacks it: torch's `torch.autograd.graph.save_on_cpu`, plus two counters (`packed_tensors`,
    `packed_bytes`, since the last `reset`) and one exception, as in torchtune's `OffloadActivations`: a parameter
    is kept as it is (it lives on the device for the whole step; copying it would only add traffic).

    Under non-reentrant activation checkpointing (`train.activation_checkpointing`: diffusers'
    `enable_gradient_checkpointing` and `checkpoint_wrapper` both use `torch.utils.checkpoint` with
    `use_reentrant=False`), torch 2.13's checkpoint saves each block's inputs outside its own saved-tensor hooks
    (`_CheckpointFrame.save_inputs` -> `_make_saved_tensor`), so these hooks pack them; the tensors saved inside a
    checkpointed block go to the checkpoint's own (innermost) hooks, which keep nothing and recompute them in the
    backward, on the device. So the forward's saved tensors (the blocks' inputs, what the layers outside the blocks
    save) live in host memory, and one block's recomputed activations are on the device at a time. Cost: one
    device-to-host copy of each saved tensor in the forward, one host-to-device copy in the backward. On CPU the
    tensors are already in host memory: they are counted, not copied. Reusable: enter it once per forward."""

    def __init__(self, pin_memory: bool = False):
        self.packed_tensors = 0
        self.packed_bytes = 0

        def pack(tensor: torch.Tensor) -> tuple[torch.device | None, torch.Tensor]:
            if isinstance(tensor, torch.nn.Parameter):
                return None, tensor
            self.packed_tensors += 1
            self.packed_bytes += tensor.numel() * tensor.element_size()
            if tensor.device.type == "cpu":
                return None, tensor
            host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout,
                               pin_memory=pin_memory and not tensor.is_sparse)
            host.copy_(tensor, non_blocking=pin_memory)
            return tensor.device, host

        def unpack(packed: tuple[torch.device | None, torch.Tensor]) -> torch.Tensor:
            device, tensor = packed
            return tensor if device is None else tensor.to(device, non_blocking=pin_memory)

        super().__init__(pack, unpack)

    def reset(self) -> None:
        """Zero the counters."""
        self.packed_tensors = self.packed_bytes = 0


def step_generator(seed: int, step: int, rank: int) -> torch.Generator:
    """CPU generator for a whole batch's noise and sigmas at (`step`, `rank`): a pure function of its arguments.
    Training draws per sample instead (`sample_generator`), so that the noise does not depend on the rank."""
    return torch.Generator(device="cpu").manual_seed((seed * 1_000_003 + step) * 1_009 + rank)


def sample_generator(seed: int, step: int, sample_key: int) -> torch.Generator:
    """CPU generator for the noise and sigma of one sample at optimizer `step`, keyed by (seed, step, sample_key)
    and never by the rank: a run resized to another worker count draws the same noise for the same sample at the
    same step. `sample_key`: the sample table's int64 key (`vidray.data.index.sample_key`). The seed is a 63-bit
    blake2b hash of the three numbers, so nearby triples give unrelated streams."""
    digest = hashlib.blake2b(struct.pack("<qqq", int(seed), int(step), int(sample_key)), digest_size=8).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def flow_matching_step_loss(
    family,
    transformer: torch.nn.Module,
    latents: torch.Tensor,
    prompt_embeds: torch.Tensor,
    prompt_attention_mask: torch.Tensor,
    flow: FlowConfig,
    generator: torch.Generator | Sequence[torch.Generator],
    *,
    loss_weights: torch.Tensor | None = None,
    inpaint_latents: torch.Tensor | None = None,
    condition_dropout: float = 0.0,
    image_embeds: torch.Tensor | None = None,
    sigma_range: tuple[float, float] | None = None,
    return_timesteps: bool = False,
    activation_offload: ActivationOffload | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Rectified-flow loss of one batch (Esser et al. 2024, eq. 1-3; formulas in vidray.diffusion.flow_matching).

    Args:
        family: the model family: its `objective`'s `noisy_latents` and `training_target` define the loss (flow
            matching for EasyAnimate), its `predict` adapts the call to the transformer.
        latents: (B, C_lat, F_lat, H_lat, W_lat) normalized VAE latents.
        prompt_embeds: (B, L, D); prompt_attention_mask: (B, L) bool.
        generator: one CPU generator for the whole batch's noise and sigmas (`step_generator`), or B generators,
            one per sample (`sample_generator`: each draws its sample's noise, then its sigma).
        loss_weights: (B,) per-sample weights (0 for the padding of `vidray.data.schedule`), or None.
        inpaint_latents: an image-to-video model's condition of each sample (B, C_in, F_lat, H_lat, W_lat), from
            `family.condition` of its clip (the encode stage's; None: a text-to-video model). Each sample keeps it
            with probability 1 - condition_dropout, else gets the empty condition (`family.condition` without an
            image: the text-to-video input), drawn by `condition_keep` from the sample's own generator after its
            noise and sigma (`ImageCondition.where`).
        condition_dropout: `model.i2v.condition_dropout`, in [0, 1).
        image_embeds: the image embeddings (B, T, D_img) of a model that takes them (Wan 2.1 I2V's CLIP, from the
            same `family.condition` call), or None. A sample that loses its condition loses these too (the empty
            condition's zeros), by the same draw.
        sigma_range: (lo, hi): draw each sigma conditioned on lo <= sigma <= hi (`sample_sigmas`): one expert's
            side of the timestep boundary when each expert trains in its own worker group (`model.experts`
            layout groups, `vidray.models.experts.expert_sigma_range`); None: the whole range.
        return_timesteps: also return the (B,) float32 timesteps the transformer was called with.
        activation_offload: run the transformer's forward under these hooks (`memory.activation_offload`): what
            autograd saves there lives in host memory until the backward; None: on the device.
    Returns:
        scalar fp32 loss: without weights, mse(model_pred, target) (flow matching: target = noise - latents); with weights,
        sum_i w_i * mse_i, mse_i being sample i's mean squared error (the caller normalises the sum). With
        `return_timesteps`, (loss, timesteps).
    """
    batch_size = latents.shape[0]
    if isinstance(generator, torch.Generator):
        noise = torch.randn(latents.shape, generator=generator, dtype=latents.dtype).to(latents.device)
        sigmas = sample_sigmas(batch_size, flow, generator=generator, sigma_range=sigma_range).to(latents.device)
    else:
        if len(generator) != batch_size:
            raise ValueError(f"got {len(generator)} generators for a batch of {batch_size} samples")
        noise = torch.stack([torch.randn(latents.shape[1:], generator=g, dtype=latents.dtype) for g in generator])
        noise = noise.to(latents.device)
        sigmas = torch.cat([sample_sigmas(1, flow, generator=g, sigma_range=sigma_range)
                            for g in generator]).to(latents.device)  # (B,)
    condition = {}
    if inpaint_latents is not None:
        keep = condition_keep(generator, batch_size, condition_dropout).to(latents.device)  # (B,) bool
        empty = family.condition(transformer, latent_shape=tuple(latents.shape), device=latents.device)
        if empty is None:
            raise ValueError("inpaint_latents come with an image-to-video model; this transformer is text-to-video")
        condition = ImageCondition(inpaint_latents, image_embeds).where(keep, empty).predict_kwargs()
    elif image_embeds is not None:
        raise ValueError("image_embeds come with an image-to-video model's inpaint_latents")
    noisy_latents = family.objective.noisy_latents(latents, noise, sigmas)  # flow matching, or the family's own
    timesteps = family.objective.model_timesteps(sigmas, flow.num_train_timesteps)
    with activation_offload if activation_offload is not None else contextlib.nullcontext():
        model_pred = family.predict(transformer, noisy_latents, timesteps, prompt_embeds, prompt_attention_mask,
                                    **condition)
    target = family.objective.training_target(latents, noise, sigmas)
    if loss_weights is None:
        loss = flow_matching_loss(model_pred, target)
    else:
        per_sample = (model_pred.float() - target.float()).pow(2).flatten(1).mean(dim=1)  # (B,)
        loss = (per_sample * loss_weights.to(per_sample.device, torch.float32)).sum()
    return (loss, timesteps) if return_timesteps else loss


def condition_keep(generator: torch.Generator | Sequence[torch.Generator], batch_size: int,
                   condition_dropout: float) -> torch.Tensor:
    """(B,) bool on CPU: which samples keep their image condition, `u >= condition_dropout` for u ~ U[0, 1): drawn
    from each sample's own generator (`sample_generator`, after its noise and sigma), so a sample's dropout is the
    same whatever the batch it is in and the worker count; or B draws of one batch generator (`step_generator`).
    EasyAnimate trains its InP models for text-to-video too this way (an all-generate mask for a share of samples).
    Raises ValueError for a condition_dropout outside [0, 1)."""
    if not 0 <= condition_dropout < 1:
        raise ValueError(f"condition_dropout must be in [0, 1) (model.i2v.condition_dropout), got {condition_dropout}")
    if isinstance(generator, torch.Generator):
        draws = torch.rand(batch_size, generator=generator)
    else:
        draws = torch.cat([torch.rand(1, generator=g) for g in generator])
    return draws >= condition_dropout


class NonFiniteTrainingError(UserError):
    """The loss, gradient norm or weights became NaN or Inf at `step` (with learning rate `lr`).

    Deterministic: the same step fails again after a restart, so vidray never lets Ray Train retry it and never
    writes a checkpoint after it (good checkpoints are not rotated away by `checkpoint.num_to_keep`).
    """

    def __init__(self, message: str, step: int | None = None, lr: float | None = None):
        super().__init__(message)
        self.step, self.lr = step, lr

    def __reduce__(self):
        return (type(self), (str(self), self.step, self.lr))


def check_finite_window(
    first_step: int, losses: Sequence[float], grad_norms: Sequence[float], lrs: Sequence[float], *,
    check_grad_norms: bool = True,
) -> None:
    """Raise NonFiniteTrainingError naming the first step of a window whose loss or gradient norm is NaN/Inf.

    Args:
        first_step: the step of `losses[0]` (1-based).
        losses: per-step losses (mean over ranks), host floats.
        grad_norms: per-step global gradient L2 norms before clipping (0.0 where not measured).
        lrs: per-step learning rates the optimizer used.
        check_grad_norms: False under fp16 loss scaling, where an Inf/NaN gradient norm is a step the grad scaler
            skipped (lowering its scale), not a divergence; the loss is checked either way.
    """
    for i, (loss, grad_norm, lr) in enumerate(zip(losses, grad_norms, lrs, strict=True)):
        if not (math.isfinite(loss) and (math.isfinite(grad_norm) or not check_grad_norms)):
            step = first_step + i
            what = f"loss {loss}" if not math.isfinite(loss) else f"gradient norm {grad_norm}"
            raise NonFiniteTrainingError(
                f"training diverged: {what} at step {step} (lr {lr:.3g}); no checkpoint was written after it. "
                "Lower optim.lr, raise optim.warmup_steps or set train.grad_clip_norm, then resume from the "
                "last checkpoint",
                step, lr,
            )


def non_finite_parameters(module: torch.nn.Module) -> list[str]:
    """Names of parameters holding a NaN or Inf (one host sync for the whole module; call at checkpoint time).
    Frozen weights stored in fp8 (`memory.storage_dtype`, which torch's `isfinite` does not take) or swapped to
    host memory (`memory.block_swap`) are left out: they never change during training."""
    every = list(module.named_parameters())
    device = next((p.device for _, p in every if p.requires_grad), None)
    named = [(name, p) for name, p in every if p.requires_grad or (
        p.dtype != torch.float8_e4m3fn and (device is None or p.device == device))]
    if not named:
        return []
    # A sharded (FSDP, DTensor) parameter is checked on this rank's shard, then the flags are agreed over ranks
    # (a collective: every rank calls this at the same step), so all ranks stop together.
    local = [p.detach().to_local() if hasattr(p, "to_local") else p.detach() for _, p in named]
    finite = torch.stack([torch.isfinite(t).all() for t in local]).to(torch.int32)
    if len(local) and any(hasattr(p, "to_local") for _, p in named):
        if dist.is_initialized():
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    finite = finite.bool().cpu().tolist()
    return [name for (name, _), ok in zip(named, finite, strict=True) if not ok]
