"""THE denoising loop, used by `vidray generate`, evaluation and serving alike.

`denoise_step` is one sampler step over a batch whose samples may sit at different noise levels (per-sample
sigmas and timesteps); `sample_latents` loops it over one request's schedule, and `DenoiseState` + `step_states`
let a server run a continuous batch (iteration-level batching, Orca, Yu et al. OSDI 2022): requests of one latent
shape join and leave the running batch between steps, and each gets the latents it would get alone (to float
tolerance: a batched matmul may round differently from a single one).

The schedule and the step come from the model family's objective (`family.objective`: `inference_sigmas`,
`model_timesteps`, `sampler_step`): for flow matching (EasyAnimate), Euler integration of the rectified-flow ODE
d(latents)/d(sigma) = model_pred from sigma = 1 to 0 on the shifted sigmas of diffusers'
FlowMatchEulerDiscreteScheduler; a DDIM family steps with `vidray.diffusion.ddim.ddim_step`. Classifier-free
guidance as in EasyAnimatePipeline: one batched call on [uncond, cond], then
`model_pred = uncond + guidance_scale * (cond - uncond)`.

Image-to-video models get their condition (`family.condition`, a `vidray.models.conditioning.ImageCondition`),
`inpaint_latents` (B, C_in, F, H, W), in every `predict` call; with guidance both branches get the same condition
(only the prompt differs), as EasyAnimateInpaintPipeline concatenates `[inpaint_latents] * 2`. `generate_video`
encodes it from `image` (and `last_image`), or gets the empty condition (text-to-video) without one. A model that
also takes image embeddings (Wan 2.1 I2V's CLIP) gets `image_embeds` (B, T, D_img) beside it the same way (both
guidance branches the same, as `WanImageToVideoPipeline` passes one `image_embeds` to both calls), from the same
`family.condition` call.

Several processes (`parallel=`, a `vidray.inference.parallel.GenerationParallel`): under CFG parallel each rank of
the "cfg" pair calls the transformer on one guidance branch and the two predictions are all-gathered before the
guidance formula, so every rank steps the same latents (see `vidray.inference.parallel`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from vidray.config import FlowConfig
from vidray.buckets import Bucket
from vidray.errors import UserError
from vidray.models.conditioning import ImageCondition
from vidray.models.offload import compute_dtype, execution_device
from vidray.models.registry import Components, ModelFamily
from vidray.models.vae import video_to_frames

if TYPE_CHECKING:
    from vidray.inference.parallel import GenerationParallel

__all__ = ["DenoiseState", "NonFiniteLatentsError", "check_finite_latents", "denoise_step", "generate_video",
           "initial_noise", "sample_latents", "step_states"]


class NonFiniteLatentsError(UserError):
    """The denoised latents hold NaN or inf, so the decoded video would be meaningless (e.g. all black): raised
    instead of returning it. Usually a guidance_scale far too large for the model."""


def check_finite_latents(latents: torch.Tensor, guidance_scale: float | torch.Tensor) -> None:
    """Raise NonFiniteLatentsError when `latents` (any shape) hold NaN or inf, naming the guidance_scale used.

    A user's trial: guidance_scale 1e300 "completed" an all-black video, through `vidray generate` and serving.
    """
    if not bool(torch.isfinite(latents).all()):
        scale = float(guidance_scale.max()) if isinstance(guidance_scale, torch.Tensor) else float(guidance_scale)
        raise NonFiniteLatentsError(
            f"the denoised latents hold NaN or inf (guidance_scale {scale:g}): the video would be meaningless, so "
            "none is made; use a guidance_scale the model was tuned for (EasyAnimate's default is 6; 1 = none)"
        )


@torch.inference_mode()
def denoise_step(
    family: ModelFamily,
    transformer: torch.nn.Module,
    latents: torch.Tensor,
    sigmas: torch.Tensor,
    sigmas_next: torch.Tensor,
    prompt_embeds: torch.Tensor,
    prompt_attention_mask: torch.Tensor,
    *,
    num_train_timesteps: int,
    guidance_scale: float | torch.Tensor = 1.0,
    negative_prompt_embeds: torch.Tensor | None = None,
    negative_prompt_attention_mask: torch.Tensor | None = None,
    inpaint_latents: torch.Tensor | None = None,
    image_embeds: torch.Tensor | None = None,
    parallel: GenerationParallel | None = None,
) -> torch.Tensor:
    """One sampler step (`family.objective.sampler_step`: Euler for flow matching) for a batch of samples, each at
    its own noise level: latents (B, C, F, H, W) at `sigmas` (B,) -> latents at `sigmas_next` (B,), float32 on the
    transformer's execution device (`vidray.models.offload.execution_device`). The transformer's input is cast to
    its compute dtype (`compute_dtype`: bf16 on a GPU, fp32 on CPU by default) and its prediction back to float32
    for the step, as diffusers' flow-matching pipelines keep float32 latents beside a bf16 transformer (WanPipeline).

    timesteps = `family.objective.model_timesteps(sigmas)` (B,) go to `family.predict` in their own dtype (float32
    for flow matching, as in training; the family casts them as its pipeline does: EasyAnimate to the latents' dtype,
    Wan not at all), with prompt_embeds (B, L, D) and
    prompt_attention_mask (B, L). Classifier-free guidance runs when negative_prompt_embeds/mask are given: one
    transformer call on [uncond, cond] (2B), then `uncond + guidance_scale * (cond - uncond)` with guidance_scale a
    float or a (B,) tensor (per sample). `inpaint_latents` (B, C_in, F, H, W): an image-to-video model's condition
    of each sample, passed to `family.predict` (repeated for both guidance branches); None for a text-to-video
    model. `image_embeds` (B, T, D_img): the image embeddings of a model that takes them (Wan 2.1 I2V), passed
    the same way: both as `family.condition(...).predict_kwargs()` gives them. `parallel`: this rank's place among
    several processes stepping the same batch (None: this process alone); with guidance and `parallel.cfg` 2 the
    transformer runs one branch here, cfg rank 0 the unconditional (negative_prompt_embeds) and 1 the conditional,
    each on B samples with its own timesteps, condition and image embeddings, and the two predictions are
    all-gathered (`GenerationParallel.gather_cfg`) before the guidance formula: every rank returns the same
    latents. Raises ValueError for shapes that do not line up.
    """
    batch_size = latents.shape[0]
    sigmas = torch.as_tensor(sigmas, dtype=torch.float32).reshape(-1)
    sigmas_next = torch.as_tensor(sigmas_next, dtype=torch.float32).reshape(-1)
    if sigmas.shape != (batch_size,) or sigmas_next.shape != (batch_size,):
        raise ValueError(f"sigmas and sigmas_next must have shape ({batch_size},), got {tuple(sigmas.shape)} "
                         f"and {tuple(sigmas_next.shape)}")
    if prompt_embeds.ndim != 3 or prompt_embeds.shape[0] != batch_size:
        raise ValueError(f"prompt_embeds must be ({batch_size}, L, D) for latents {tuple(latents.shape)}, "
                         f"got {tuple(prompt_embeds.shape)}")
    do_cfg = negative_prompt_embeds is not None
    if do_cfg and (negative_prompt_attention_mask is None or negative_prompt_embeds.shape != prompt_embeds.shape):
        raise ValueError("classifier-free guidance needs negative_prompt_embeds of prompt_embeds' shape "
                         f"{tuple(prompt_embeds.shape)} and their negative_prompt_attention_mask")
    device, dtype = execution_device(transformer), compute_dtype(transformer)
    latents = latents.to(device=device, dtype=torch.float32)
    cfg_split = do_cfg and parallel is not None and parallel.cfg == 2  # this rank runs one branch
    both = do_cfg and not cfg_split  # this call runs [uncond, cond]: every input twice

    def twice(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x]) if both else x

    if both:
        prompt_embeds = torch.cat([negative_prompt_embeds, prompt_embeds])
        prompt_attention_mask = torch.cat([negative_prompt_attention_mask, prompt_attention_mask])
    elif cfg_split and parallel.cfg_rank == 0:  # the unconditional branch
        prompt_embeds, prompt_attention_mask = negative_prompt_embeds, negative_prompt_attention_mask
    model_input = twice(latents).to(dtype)
    t = twice(family.objective.model_timesteps(sigmas, num_train_timesteps).to(device=device))
    condition = {}
    if inpaint_latents is not None:
        if inpaint_latents.shape[0] != batch_size:
            raise ValueError(f"inpaint_latents must have {batch_size} samples, got {tuple(inpaint_latents.shape)}")
        condition["inpaint_latents"] = twice(inpaint_latents.to(device=device, dtype=dtype))
    if image_embeds is not None:
        if image_embeds.shape[0] != batch_size:
            raise ValueError(f"image_embeds must have {batch_size} samples, got {tuple(image_embeds.shape)}")
        condition["image_embeds"] = twice(image_embeds.to(device=device, dtype=dtype))
    model_pred = family.predict(transformer, model_input, t, prompt_embeds.to(device=device, dtype=dtype),
                                prompt_attention_mask.to(device=device), **condition)
    if cfg_split:  # (B, ...) of this rank's branch -> both branches', gathered in the compute dtype
        pred_uncond, pred_cond = (pred.float() for pred in parallel.gather_cfg(model_pred))
    else:
        model_pred = model_pred.float()
    if do_cfg:
        if both:
            pred_uncond, pred_cond = model_pred.chunk(2)
        scale = torch.as_tensor(guidance_scale, dtype=pred_cond.dtype, device=device)
        if scale.ndim == 1:
            scale = scale.reshape(-1, *([1] * (pred_cond.ndim - 1)))
        model_pred = pred_uncond + scale * (pred_cond - pred_uncond)
    return family.objective.sampler_step(latents, model_pred, sigmas.to(device), sigmas_next.to(device))


def initial_noise(latent_shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Pure noise (sigma = 1) of `latent_shape`, float32 on CPU, from `torch.Generator("cpu").manual_seed(seed)`:
    what `generate_video` draws for a batch, so a served request with seed s gets `vidray generate --seed s`'s
    video."""
    generator = torch.Generator("cpu").manual_seed(int(seed))
    return torch.randn(latent_shape, generator=generator, dtype=torch.float32)


@dataclass
class DenoiseState:
    """One request in a continuous batch: its latents (1, C, F, H, W), its own schedule `sigmas`
    (num_inference_steps + 1,) from `family.objective.inference_sigmas`, the next step index, its conditioning
    (prompt_embeds (1, L, D), prompt_attention_mask (1, L); negatives of the same shapes when guidance_scale > 1; an
    image-to-video model's `inpaint_latents` (1, C_in, F, H, W), and its `image_embeds` (1, T, D_img) when the model
    takes them).
    `end_step`: the step it is done at, when a stage takes only the steps before it (one expert of two,
    `vidray.models.experts.expert_steps`); None: the schedule's end."""

    latents: torch.Tensor
    sigmas: torch.Tensor
    prompt_embeds: torch.Tensor
    prompt_attention_mask: torch.Tensor
    guidance_scale: float = 1.0
    negative_prompt_embeds: torch.Tensor | None = None
    negative_prompt_attention_mask: torch.Tensor | None = None
    step: int = 0
    inpaint_latents: torch.Tensor | None = None
    image_embeds: torch.Tensor | None = None
    end_step: int | None = None

    @property
    def num_inference_steps(self) -> int:
        return int(self.sigmas.shape[0]) - 1

    @property
    def steps_left(self) -> int:
        """Steps before it is done (to `end_step`, else the schedule's end)."""
        return (self.num_inference_steps if self.end_step is None else self.end_step) - self.step

    @property
    def done(self) -> bool:
        return self.steps_left <= 0

    def batch_key(self) -> tuple:
        """States with equal keys can share a `step_states` call: latent shape, prompt shape, guidance on/off,
        image condition on/off, image embeddings' shape (None without)."""
        return (tuple(self.latents.shape[1:]), tuple(self.prompt_embeds.shape[1:]),
                self.negative_prompt_embeds is not None, self.inpaint_latents is not None,
                None if self.image_embeds is None else tuple(self.image_embeds.shape[1:]))


@torch.inference_mode()
def step_states(family: ModelFamily, transformer: torch.nn.Module, states: list[DenoiseState], *,
                num_train_timesteps: int, parallel: GenerationParallel | None = None) -> None:
    """Advance every state in `states` (all with one `batch_key`, none done) by one step of its own schedule, in
    one `denoise_step` call on the stacked batch (`parallel`: its, for a replica spanning several ranks that all
    hold the same states). Updates `latents` and `step` in place. Raises ValueError for mixed keys or a finished
    state."""
    if not states:
        return
    keys = {state.batch_key() for state in states}
    if len(keys) != 1:
        raise ValueError(f"states of different batch keys cannot step together: {sorted(map(str, keys))}")
    if any(state.done for state in states):
        raise ValueError("a finished DenoiseState cannot step again")
    do_cfg = states[0].negative_prompt_embeds is not None
    latents = torch.cat([state.latents for state in states])
    sigmas = torch.stack([state.sigmas[state.step] for state in states])
    sigmas_next = torch.stack([state.sigmas[state.step + 1] for state in states])
    latents = denoise_step(
        family, transformer, latents, sigmas, sigmas_next,
        torch.cat([state.prompt_embeds for state in states]),
        torch.cat([state.prompt_attention_mask for state in states]),
        num_train_timesteps=num_train_timesteps,
        guidance_scale=torch.tensor([state.guidance_scale for state in states], dtype=torch.float32),
        negative_prompt_embeds=torch.cat([state.negative_prompt_embeds for state in states]) if do_cfg else None,
        negative_prompt_attention_mask=(torch.cat([state.negative_prompt_attention_mask for state in states])
                                        if do_cfg else None),
        inpaint_latents=(torch.cat([state.inpaint_latents for state in states])
                         if states[0].inpaint_latents is not None else None),
        image_embeds=(torch.cat([state.image_embeds for state in states])
                      if states[0].image_embeds is not None else None),
        parallel=parallel,
    )
    for state, new in zip(states, latents.split(1)):
        state.latents = new
        state.step += 1


@torch.inference_mode()
def sample_latents(
    family: ModelFamily,
    transformer: torch.nn.Module,
    prompt_embeds: torch.Tensor,
    prompt_attention_mask: torch.Tensor,
    *,
    latent_shape: tuple[int, ...],
    num_inference_steps: int,
    shift: float,
    num_train_timesteps: int,
    guidance_scale: float = 1.0,
    negative_prompt_embeds: torch.Tensor | None = None,
    negative_prompt_attention_mask: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    callback: Callable[[int, float, torch.Tensor], None] | None = None,
    latents: torch.Tensor | None = None,
    inpaint_latents: torch.Tensor | None = None,
    image_embeds: torch.Tensor | None = None,
    parallel: GenerationParallel | None = None,
) -> torch.Tensor:
    """Denoise pure noise into latents (B, C, F, H, W) (normalized, ready for `family.decode_latents`).

    prompt_embeds (B, L, D), prompt_attention_mask (B, L); latent_shape (B, C, F_lat, H_lat, W_lat) from
    `family.latent_shape`. The initial noise is `torch.randn(latent_shape, generator=generator)` drawn on the
    generator's device (CPU by default, as diffusers' `randn_tensor` does), unless `latents` gives it.
    guidance_scale > 1 needs negative_prompt_embeds/mask of the same shapes (e.g. the empty prompt).
    `callback(i, sigma, latents)` runs after step i (0-based), sigma being the step's starting noise level.
    `inpaint_latents` (B, C_in, F_lat, H_lat, W_lat): an image-to-video model's condition, in every step
    (`denoise_step`); None for a text-to-video model. `image_embeds` (B, T, D_img): likewise, for a model that
    takes them (`ImageCondition.predict_kwargs()` gives both). `parallel`: `denoise_step`'s (every rank of it passes
    the same arguments and generator seed, and gets the same latents).
    The transformer runs in eval mode (its previous mode is restored) under torch.inference_mode.
    Raises NonFiniteLatentsError when the result holds NaN or inf (`check_finite_latents`).
    """
    # 1. Check inputs
    batch_size = latent_shape[0]
    if prompt_embeds.ndim != 3 or prompt_embeds.shape[0] != batch_size:
        raise ValueError(f"prompt_embeds must be ({batch_size}, L, D) for latent_shape {latent_shape}, "
                         f"got {tuple(prompt_embeds.shape)}")
    do_cfg = guidance_scale > 1.0
    if do_cfg:
        if negative_prompt_embeds is None or negative_prompt_attention_mask is None:
            raise ValueError(
                f"guidance_scale {guidance_scale} > 1 needs negative_prompt_embeds and negative_prompt_attention_mask "
                f"(encode the empty prompt ''), or use guidance_scale=1.0"
            )
        if negative_prompt_embeds.shape != prompt_embeds.shape:
            raise ValueError(f"negative_prompt_embeds {tuple(negative_prompt_embeds.shape)} must match "
                             f"prompt_embeds {tuple(prompt_embeds.shape)}")
    device = execution_device(transformer)

    # 2. Prepare the schedule: (num_inference_steps + 1,) sigmas on the host, 1 -> 0
    sigmas = family.objective.inference_sigmas(num_inference_steps, shift=shift,
                                               num_train_timesteps=num_train_timesteps)

    # 3. Prepare initial noise (sigma = 1)
    if latents is None:
        rng_device = generator.device if generator is not None else torch.device("cpu")
        latents = torch.randn(latent_shape, generator=generator, device=rng_device, dtype=torch.float32)
    elif tuple(latents.shape) != tuple(latent_shape):
        raise ValueError(f"latents {tuple(latents.shape)} must have latent_shape {tuple(latent_shape)}")
    latents = latents.to(device=device, dtype=torch.float32)

    # 4. Denoising loop: one `denoise_step` per schedule step, every sample at the same sigma
    was_training = transformer.training
    transformer.eval()
    try:
        for i in range(num_inference_steps):
            latents = denoise_step(
                family, transformer, latents,
                sigmas[i].expand(batch_size), sigmas[i + 1].expand(batch_size),
                prompt_embeds, prompt_attention_mask,
                num_train_timesteps=num_train_timesteps,
                guidance_scale=guidance_scale,
                negative_prompt_embeds=negative_prompt_embeds if do_cfg else None,
                negative_prompt_attention_mask=negative_prompt_attention_mask if do_cfg else None,
                inpaint_latents=inpaint_latents,
                image_embeds=image_embeds,
                parallel=parallel,
            )
            if callback is not None:
                callback(i, float(sigmas[i]), latents)
    finally:
        transformer.train(was_training)
    check_finite_latents(latents, guidance_scale)
    return latents


def _image_condition(family: ModelFamily, components: Components, bucket: Bucket, latent_shape: tuple[int, ...],
                     image: Any, last_image: Any, device: torch.device, seed: int) -> ImageCondition | None:
    """`generate_video`'s condition (`family.condition`): the image's repeated over the B prompts, the empty one for
    an image-to-video model without image, None for a text-to-video model. The family gets a CPU generator of its
    own seeded with `seed` (apart from the initial noise's), which one that samples the image's posterior
    (CogVideoX, as its stock pipeline does from its generator) draws from. Raises UserError for a last image
    without a first one, or an image given to a text-to-video model."""
    if image is None and last_image is not None:
        raise UserError("a last image needs a first image: give --image too")
    condition = family.condition(components.transformer, latent_shape=latent_shape, encoders=components,
                                 image=image, last_image=last_image, bucket=bucket,
                                 generator=torch.Generator("cpu").manual_seed(int(seed)), device=device)
    if condition is None and image is not None:
        raise UserError("this model is text-to-video and takes no image: drop --image, or give a model trained "
                        "with model.i2v")
    return condition


@torch.inference_mode()
def generate_video(
    family: ModelFamily,
    components: Components,
    prompts: list[str],
    bucket: Bucket,
    *,
    flow: FlowConfig,
    num_inference_steps: int = 8,
    guidance_scale: float = 1.0,
    max_sequence_length: int = 32,
    seed: int = 0,
    negative_prompt: str = "",
    callback: Callable[[int, float, torch.Tensor], None] | None = None,
    image: Any = None,
    last_image: Any = None,
    parallel: GenerationParallel | None = None,
) -> np.ndarray | None:
    """prompts (B strings) -> uint8 frames (B, F, H, W, 3) at `bucket` (num_frames, height, width).

    Encode prompts -> `sample_latents` (noise from a CPU generator seeded with `seed`, so the same seed gives
    the same video on any device) -> `family.decode_latents` -> uint8 frames. With guidance_scale > 1 the
    unconditional branch uses `negative_prompt` (default ''). `callback(i, sigma, latents)`: `sample_latents`'s,
    after each denoising step. `image` (and `last_image`): the first (and last) frame of every video, for an
    image-to-video model (PIL, uint8 (H, W, 3) or (3, H, W) in [0, 1]), resized to the bucket and encoded by
    `family.condition` (the latent condition, and image embeddings for a model that takes them); such a model
    without `image` generates from text alone (the empty condition). `parallel`: this rank's place among several
    processes generating the same video (`vidray.inference.parallel`; every rank passes the same arguments and
    encodes the prompts itself): only the writer (rank 0) decodes, the others return None. Raises UserError for an
    image given to a text-to-video model.
    """
    # 1. Check inputs and shapes
    if isinstance(prompts, str) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of strings, got {prompts!r}")
    latent_shape = family.latent_shape(bucket, len(prompts))
    device = execution_device(components.transformer)
    condition = _image_condition(family, components, bucket, latent_shape, image, last_image, device, seed)

    # 2. Encode prompts (and the negative prompt for guidance)
    prompt_embeds, prompt_attention_mask = family.encode_prompt(
        components.text_encoder, components.tokenizer, prompts, max_sequence_length=max_sequence_length, device=device
    )
    negative_prompt_embeds = negative_prompt_attention_mask = None
    if guidance_scale > 1.0:
        negative_prompt_embeds, negative_prompt_attention_mask = family.encode_prompt(
            components.text_encoder,
            components.tokenizer,
            [negative_prompt] * len(prompts),
            max_sequence_length=max_sequence_length,
            device=device,
        )

    # 3. Denoise
    generator = torch.Generator("cpu").manual_seed(seed)
    latents = sample_latents(
        family,
        components.transformer,
        prompt_embeds,
        prompt_attention_mask,
        latent_shape=latent_shape,
        num_inference_steps=num_inference_steps,
        shift=flow.shift,
        num_train_timesteps=flow.num_train_timesteps,
        guidance_scale=guidance_scale,
        negative_prompt_embeds=negative_prompt_embeds,
        negative_prompt_attention_mask=negative_prompt_attention_mask,
        generator=generator,
        callback=callback,
        parallel=parallel,
        **(condition.predict_kwargs() if condition is not None else {}),
    )

    # 4. Decode to uint8 frames (on one rank of several)
    if parallel is not None and not parallel.is_writer:
        return None
    video = family.decode_latents(components.vae, latents)  # (B, 3, F, H, W) in [-1, 1]
    return video_to_frames(video)  # (B, F, H, W, 3) uint8
