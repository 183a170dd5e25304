"""`vidray.diffusion.ddim` against the diffusers schedulers it mirrors: `DDIMScheduler` (AnimateDiff: epsilon) and
`CogVideoXDDIMScheduler` (CogVideoX: v-prediction, SNR shift, zero terminal SNR, trailing timesteps)."""

from __future__ import annotations

import pytest
import torch
from diffusers import CogVideoXDDIMScheduler, DDIMScheduler

from vidray.buckets import Bucket
from vidray.diffusion import ddim

CONFIGS = {
    # AnimateDiff's scheduler (AnimateDiffPipeline docs: DDIMScheduler, linear betas, linspace, steps_offset 1)
    "animatediff-epsilon": (DDIMScheduler, dict(beta_schedule="linear", beta_start=0.00085, beta_end=0.012,
                                                clip_sample=False, timestep_spacing="linspace", steps_offset=1,
                                                prediction_type="epsilon")),
    "sd-epsilon-leading": (DDIMScheduler, dict(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                                               clip_sample=False, steps_offset=1,
                                               set_alpha_to_one=False, prediction_type="epsilon")),
    # CogVideoX-2b's scheduler_config.json (snr_shift_scale 3.0, zero terminal SNR, trailing, v_prediction)
    "cogvideox-v": (CogVideoXDDIMScheduler, dict(beta_schedule="scaled_linear", snr_shift_scale=3.0,
                                                 rescale_betas_zero_snr=True, timestep_spacing="trailing",
                                                 prediction_type="v_prediction", set_alpha_to_one=True,
                                                 clip_sample=False)),
}


def _ours(kind, cfg):
    return ddim.ddim_schedule(beta_start=cfg.get("beta_start", 0.00085), beta_end=cfg.get("beta_end", 0.012),
                              beta_schedule=cfg["beta_schedule"],
                              snr_shift_scale=cfg.get("snr_shift_scale") if kind is CogVideoXDDIMScheduler else None,
                              rescale_betas_zero_snr=cfg.get("rescale_betas_zero_snr", False),
                              set_alpha_to_one=cfg.get("set_alpha_to_one", True))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_schedule_noise_and_targets_match_diffusers(name):
    kind, cfg = CONFIGS[name]
    theirs, ours = kind(**cfg), _ours(kind, cfg)
    assert torch.allclose(ours.alphas_cumprod, theirs.alphas_cumprod.double(), rtol=1e-6, atol=1e-9)
    g = torch.Generator().manual_seed(0)
    latents, noise = torch.randn(3, 4, 2, 8, 8, generator=g), torch.randn(3, 4, 2, 8, 8, generator=g)
    t = torch.tensor([0, 417, 999])
    assert torch.allclose(ddim.add_noise(latents, noise, t, ours), theirs.add_noise(latents, noise, t), atol=1e-5)
    target = ddim.training_target(latents, noise, t, ours, cfg["prediction_type"])
    expected = noise if cfg["prediction_type"] == "epsilon" else theirs.get_velocity(latents, noise, t)
    assert torch.allclose(target, expected, atol=1e-5)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("steps", [1, 7, 50])
def test_a_whole_ddim_sampling_loop_matches_the_scheduler(name, steps):
    """The same toy model (a fixed function of the sample and timestep) through every step of both loops."""
    kind, cfg = CONFIGS[name]
    theirs, ours = kind(**cfg), _ours(kind, cfg)
    theirs.set_timesteps(steps)
    timesteps = ddim.inference_timesteps(steps, spacing=cfg.get("timestep_spacing", "leading"),
                                         steps_offset=cfg.get("steps_offset", 0))
    assert torch.equal(timesteps, theirs.timesteps)
    model = lambda x, t: 0.3 * x + torch.sin(x) * (t / 1000.0)  # noqa: E731
    x_ours = x_theirs = torch.randn(2, 4, 2, 8, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    stride = 1000 // steps
    for t in timesteps.tolist():
        x_theirs = theirs.step(model(x_theirs, t), t, x_theirs).prev_sample
        prev = torch.full((2,), t - stride)  # diffusers' prev_timestep = t - num_train_timesteps // steps
        x_ours = ddim.ddim_step(model(x_ours, t), x_ours, torch.full((2,), t), prev, ours, cfg["prediction_type"])
    assert torch.allclose(x_ours, x_theirs, rtol=1e-5, atol=1e-6), (x_ours - x_theirs).abs().max()


def test_one_batch_may_hold_samples_at_different_timesteps():
    """Step-level batching: a batch stepped together equals its samples stepped alone."""
    schedule = ddim.ddim_schedule(snr_shift_scale=3.0, rescale_betas_zero_snr=True)
    x = torch.randn(2, 4, 2, 8, 8, generator=torch.Generator().manual_seed(2))
    pred = torch.randn_like(x)
    t, prev = torch.tensor([999, 400]), torch.tensor([979, -1])
    together = ddim.ddim_step(pred, x, t, prev, schedule, "v_prediction")
    for i in range(2):
        alone = ddim.ddim_step(pred[i:i + 1], x[i:i + 1], t[i:i + 1], prev[i:i + 1], schedule, "v_prediction")
        assert torch.allclose(together[i:i + 1], alone, atol=1e-6)


def test_bad_settings_name_the_valid_choices():
    with pytest.raises(ValueError, match="beta_schedule must be 'linear' or 'scaled_linear'"):
        ddim.ddim_schedule(beta_schedule="cosine")
    with pytest.raises(ValueError, match=r"num_inference_steps must be in 1..1000, got 0"):
        ddim.inference_timesteps(0)
    with pytest.raises(ValueError, match="spacing must be"):
        ddim.inference_timesteps(4, spacing="middle")
    with pytest.raises(ValueError, match="prediction_type must be 'epsilon' or 'v_prediction', got 'sample'"):
        ddim.training_target(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), ddim.ddim_schedule(), "sample")


class _VPredictionFamily:
    """The tiny EasyAnimate stack under CogVideoX's objective, for the seam test below: the family's `objective` is
    a `vidray.diffusion.objectives.DDIM` (noise levels are timesteps / num_train_timesteps; the level below 0 is the
    clean end)."""

    SCHEDULE = ddim.ddim_schedule(snr_shift_scale=3.0, rescale_betas_zero_snr=True)

    @staticmethod
    def make():
        from vidray.diffusion.objectives import DDIM
        from vidray.models.easyanimate import EasyAnimateFamily

        class Family(EasyAnimateFamily):
            objective = DDIM(_VPredictionFamily.SCHEDULE, "v_prediction", spacing="trailing")

        return Family()


@pytest.mark.parametrize("steps", [4, 10])
def test_the_one_sampler_loop_runs_a_ddim_family_as_the_diffusers_scheduler_does(steps):
    """issue 29 part 5: `vidray.inference.sampler.sample_latents` takes its schedule, timesteps and step from the
    family, so a v-prediction family samples through the same loop (and serving's step batching) with the latents
    of a diffusers `CogVideoXDDIMScheduler` loop over the same transformer."""
    from vidray.config import ModelConfig
    from vidray.inference.sampler import sample_latents

    family = _VPredictionFamily.make()
    components = family.build(ModelConfig(text_encoder="tiny_random", max_sequence_length=16), seed=0)
    embeds, mask = family.encode_prompt(components.text_encoder, components.tokenizer, ["a cat"],
                                        max_sequence_length=16)
    shape = family.latent_shape(Bucket(5, 32, 32), 1)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(4))
    ours = sample_latents(family, components.transformer, embeds, mask, latent_shape=shape,
                          num_inference_steps=steps, shift=1.0, num_train_timesteps=1000, latents=noise.clone())
    scheduler = CogVideoXDDIMScheduler(beta_schedule="scaled_linear", snr_shift_scale=3.0,
                                       rescale_betas_zero_snr=True, timestep_spacing="trailing",
                                       prediction_type="v_prediction", clip_sample=False)
    scheduler.set_timesteps(steps)
    latents = noise.clone()
    with torch.inference_mode():
        for t in scheduler.timesteps:
            pred = family.predict(components.transformer, latents, t.float().reshape(1), embeds, mask)
            latents = scheduler.step(pred, int(t), latents).prev_sample
    assert torch.allclose(ours, latents, atol=1e-5), (ours - latents).abs().max()
