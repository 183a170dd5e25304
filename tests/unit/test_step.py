"""`vidray.train.step`: the training step's loss against a hand computation, and its noise generator."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from vidray.config import FlowConfig, ModelConfig  # noqa: E402
from vidray.buckets import Bucket  # noqa: E402
from vidray.models import get_family  # noqa: E402
from vidray.train.step import flow_matching_step_loss, step_generator  # noqa: E402

BUCKET = Bucket(5, 32, 32)  # latents (B, 16, 2, 4, 4)
FLOW = FlowConfig(sigma_sampling="logit_normal", logit_mean=0.2, logit_std=0.8, shift=3.0, num_train_timesteps=1000)


@pytest.fixture(scope="module")
def family():
    return get_family("easyanimate")


@pytest.fixture(scope="module")
def transformer(family):
    return family.build(ModelConfig(text_encoder="tiny_random"), seed=0).transformer


def _batch(family, transformer, batch_size=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(family.latent_shape(BUCKET, batch_size), generator=g)  # (B, 16, 2, 4, 4)
    prompt_embeds = torch.randn(batch_size, 6, transformer.config.text_embed_dim, generator=g)  # (B, L, D)
    prompt_attention_mask = torch.ones(batch_size, 6, dtype=torch.bool)
    return latents, prompt_embeds, prompt_attention_mask


def test_loss_equals_hand_computed_rectified_flow_mse_with_the_same_generator(family, transformer):
    latents, prompt_embeds, mask = _batch(family, transformer)
    loss = flow_matching_step_loss(family, transformer, latents, prompt_embeds, mask, FLOW, step_generator(3, 7, 1))

    # By hand, from the definitions (SD3 eq. 1-3; diffusers' shifted logit-normal sigmas), same draw order.
    g = step_generator(3, 7, 1)
    noise = torch.randn(latents.shape, generator=g)
    u = torch.randn(latents.shape[0], generator=g)
    sigmas = torch.sigmoid(u * FLOW.logit_std + FLOW.logit_mean)
    sigmas = FLOW.shift * sigmas / (1 + (FLOW.shift - 1) * sigmas)  # (B,)
    s = sigmas.view(-1, 1, 1, 1, 1)
    noisy_latents = (1 - s) * latents + s * noise
    with torch.no_grad():
        model_pred = transformer(noisy_latents, sigmas * 1000, encoder_hidden_states=prompt_embeds).sample
    expected = ((model_pred - (noise - latents)) ** 2).mean()

    assert loss.shape == () and loss.dtype == torch.float32
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)
    other = flow_matching_step_loss(family, transformer, latents, prompt_embeds, mask, FLOW, step_generator(3, 8, 1))
    assert not torch.isclose(loss, other), "another step's noise must give another loss"


def test_step_generator_is_a_pure_function_of_seed_step_and_rank():
    def draw(seed, step, rank):
        return torch.randn(64, generator=step_generator(seed, step, rank))

    torch.manual_seed(0)
    a = draw(0, 5, 1)
    torch.manual_seed(999)  # the global RNG plays no part
    torch.randn(10)
    assert torch.equal(a, draw(0, 5, 1))
    others = [draw(1, 5, 1), draw(0, 6, 1), draw(0, 5, 0), draw(0, 4, 1), draw(0, 5, 2)]
    for other in others:
        assert not torch.equal(a, other)
        assert abs(torch.corrcoef(torch.stack([a, other]))[0, 1]) < 0.5  # not shifted copies of one stream
    # Distinct (seed, step, rank) triples of a real run map to distinct generator seeds.
    seeds = {step_generator(seed, step, rank).initial_seed() for seed in range(3) for step in range(1, 200)
             for rank in range(8)}
    assert len(seeds) == 3 * 199 * 8


def test_gradient_reaches_trainable_transformer_parameters_and_not_frozen_ones(family):
    transformer = family.build(ModelConfig(text_encoder="tiny_random"), seed=0).transformer
    frozen = set(family.no_grad_parameter_names(transformer)) | {
        name for name, _ in transformer.named_parameters() if name.startswith("transformer_blocks.0.")
    }
    for name, p in transformer.named_parameters():
        p.requires_grad_(name not in frozen)
    latents, prompt_embeds, mask = _batch(family, transformer)
    prompt_embeds.requires_grad_(False)
    loss = flow_matching_step_loss(family, transformer, latents, prompt_embeds, mask, FLOW, step_generator(0, 1, 0))
    loss.backward()

    params = dict(transformer.named_parameters())
    trainable = [n for n in params if n not in frozen]
    assert len(trainable) > 10 and len(frozen) > 2
    assert all(params[n].grad is None for n in frozen), [n for n in frozen if params[n].grad is not None]
    no_grad = [n for n in trainable if params[n].grad is None or not torch.isfinite(params[n].grad).all()]
    assert not no_grad
    assert sum(float(params[n].grad.abs().sum()) for n in trainable) > 0
    assert latents.grad is None  # the latents are data, not parameters


def test_the_step_trains_the_familys_objective(family, transformer):
    """The step asks the family's objective for noisy_latents and the target: a family trained on epsilon
    (AnimateDiff's objective) plugs in by giving its own `objective`, without touching the step."""
    from vidray.diffusion.objectives import FlowMatching
    from vidray.models.easyanimate import EasyAnimateFamily

    class Epsilon(FlowMatching):
        name = "epsilon"

        def training_target(self, latents, noise, sigmas):
            return noise

    class EpsilonFamily(EasyAnimateFamily):
        objective = Epsilon()

    latents, prompt_embeds, mask = _batch(family, transformer)
    eps = flow_matching_step_loss(EpsilonFamily(), transformer, latents, prompt_embeds, mask, FLOW,
                                  step_generator(3, 7, 1))
    g = step_generator(3, 7, 1)
    noise = torch.randn(latents.shape, generator=g)
    u = torch.randn(latents.shape[0], generator=g)
    s = FLOW.shift * torch.sigmoid(u * FLOW.logit_std + FLOW.logit_mean)
    s = (s / (1 + (FLOW.shift - 1) * torch.sigmoid(u * FLOW.logit_std + FLOW.logit_mean))).view(-1, 1, 1, 1, 1)
    with torch.no_grad():
        model_pred = transformer((1 - s) * latents + s * noise, s.flatten() * 1000,
                                 encoder_hidden_states=prompt_embeds).sample
    torch.testing.assert_close(eps.detach(), ((model_pred - noise) ** 2).mean(), rtol=1e-5, atol=1e-6)
    assert family.objective.name == "flow_matching"
