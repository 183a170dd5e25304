"""Flow-matching formulas checked against their definitions and against diffusers' scheduler."""

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from vidray.config import FlowConfig
from vidray.diffusion.flow_matching import (
    add_noise,
    euler_step,
    flow_matching_loss,
    inference_sigmas,
    sample_sigmas,
    shift_sigmas,
    timesteps_from_sigmas,
    velocity_target,
)

SHAPE = (2, 4, 3, 8, 8)  # (B, C, F, H, W)


def _latents_and_noise(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)


def test_add_noise_endpoints_are_latents_at_sigma_0_and_noise_at_sigma_1():
    latents, noise = _latents_and_noise()
    torch.testing.assert_close(add_noise(latents, noise, torch.zeros(2)), latents)
    torch.testing.assert_close(add_noise(latents, noise, torch.ones(2)), noise)
    mixed = add_noise(latents, noise, torch.tensor([0.0, 1.0]))  # per-sample sigmas broadcast over (C, F, H, W)
    torch.testing.assert_close(mixed[0], latents[0])
    torch.testing.assert_close(mixed[1], noise[1])


def test_velocity_target_is_derivative_of_noisy_latents_wrt_sigma():
    latents, noise = _latents_and_noise(1)
    sigmas = torch.tensor([0.3, 0.8], requires_grad=True)
    noisy_latents = add_noise(latents, noise, sigmas)
    # d(noisy_latents)/d(sigma_b) summed against the target direction: compare with a full Jacobian-vector product.
    tangent = torch.ones(2)
    _, jvp = torch.func.jvp(lambda s: add_noise(latents, noise, s), (sigmas.detach(),), (tangent,))
    torch.testing.assert_close(jvp, velocity_target(latents, noise))
    # and by finite difference
    eps = 1e-3
    s = sigmas.detach()
    fd = (add_noise(latents, noise, s + eps) - add_noise(latents, noise, s - eps)) / (2 * eps)
    torch.testing.assert_close(fd, velocity_target(latents, noise), atol=1e-3, rtol=1e-3)
    # and by backprop through add_noise: d(sum(noisy_latents[b]))/d(sigma_b) = sum(target[b]) per sample.
    noisy_latents.sum().backward()
    torch.testing.assert_close(sigmas.grad, velocity_target(latents, noise).sum(dim=(1, 2, 3, 4)), rtol=1e-4, atol=1e-3)


def test_shift_is_identity_at_1_monotone_and_fixes_endpoints():
    sigmas = torch.linspace(0, 1, 101)
    torch.testing.assert_close(shift_sigmas(sigmas, 1.0), sigmas)
    for shift in (0.5, 3.0, 7.0):
        shifted = shift_sigmas(sigmas, shift)
        assert torch.all(shifted[1:] > shifted[:-1])
        assert shifted[0] == 0.0 and shifted[-1] == 1.0
    assert torch.all(shift_sigmas(sigmas[1:-1], 3.0) > sigmas[1:-1])  # shift > 1 -> noisier
    with pytest.raises(ValueError, match="shift must be > 0"):
        shift_sigmas(sigmas, 0.0)


def test_logit_normal_sigmas_have_expected_mean_and_range():
    g = torch.Generator().manual_seed(0)
    sigmas = sample_sigmas(20000, FlowConfig(sigma_sampling="logit_normal", logit_mean=0.0, logit_std=1.0), generator=g)
    assert sigmas.shape == (20000,) and sigmas.dtype == torch.float32
    assert 0.0 < sigmas.min() and sigmas.max() < 1.0
    assert 0.49 < sigmas.mean() < 0.51  # symmetric around 0.5 for logit_mean 0
    high = sample_sigmas(20000, FlowConfig(sigma_sampling="logit_normal", logit_mean=1.0), generator=g)
    assert 0.68 < high.mean() < 0.72  # E[sigmoid(N(1, 1))] ~= 0.70
    shifted = sample_sigmas(20000, FlowConfig(sigma_sampling="logit_normal", shift=3.0), generator=g)
    assert shifted.mean() > 0.6


def test_uniform_sigmas_are_seeded_and_uniform():
    flow = FlowConfig(sigma_sampling="uniform")
    a = sample_sigmas(10000, flow, generator=torch.Generator().manual_seed(3))
    b = sample_sigmas(10000, flow, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(a, b)
    assert 0.48 < a.mean() < 0.52 and a.min() >= 0.0 and a.max() <= 1.0


@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0])
@pytest.mark.parametrize("num_inference_steps", [1, 2, 8, 50])
def test_inference_sigmas_equal_diffusers_flow_match_euler_scheduler(shift, num_inference_steps):
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift, num_train_timesteps=1000)
    scheduler.set_timesteps(num_inference_steps)
    sigmas = inference_sigmas(num_inference_steps, shift, num_train_timesteps=1000)
    assert sigmas.shape == (num_inference_steps + 1,) and sigmas.dtype == torch.float32
    assert sigmas[0] == 1.0 and sigmas[-1] == 0.0
    torch.testing.assert_close(sigmas, scheduler.sigmas, atol=1e-6, rtol=0)
    torch.testing.assert_close(timesteps_from_sigmas(sigmas[:-1], 1000), scheduler.timesteps, atol=1e-3, rtol=0)


def test_euler_step_matches_diffusers_scheduler_step():
    latents, model_pred = _latents_and_noise(2)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(4)
    expected = scheduler.step(model_pred, scheduler.timesteps[0], latents, return_dict=False)[0]
    sigmas = inference_sigmas(4, 3.0)
    torch.testing.assert_close(euler_step(latents, model_pred, sigmas[0], sigmas[1]), expected)


def test_euler_with_exact_velocity_recovers_latents_from_noise():
    latents, noise = _latents_and_noise(4)
    sample = noise.clone()  # sigma = 1
    sigmas = inference_sigmas(5, 3.0)
    for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
        sample = euler_step(sample, velocity_target(latents, noise), sigma, sigma_next)  # straight path: exact
        torch.testing.assert_close(sample, add_noise(latents, noise, sigma_next.expand(2)), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sample, latents, atol=1e-5, rtol=1e-5)


def test_flow_matching_loss_is_fp32_mse():
    latents, noise = _latents_and_noise(5)
    loss = flow_matching_loss(latents.to(torch.bfloat16), noise)
    assert loss.dtype == torch.float32 and loss.ndim == 0
    torch.testing.assert_close(loss, ((latents.to(torch.bfloat16).float() - noise) ** 2).mean())
    assert flow_matching_loss(noise, noise) == 0.0


def test_bad_sigma_shapes_and_sampling_choices_raise():
    latents, noise = _latents_and_noise()
    with pytest.raises(ValueError, match=r"sigmas must be a scalar or have shape \(2,\)"):
        add_noise(latents, noise, torch.zeros(3))
    with pytest.raises(ValueError, match="num_inference_steps must be >= 1"):
        inference_sigmas(0, 1.0)
