"""Per-sample noise keyed by (seed, step, sample) and the weighted loss of padded batches (`vidray.train.step`)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from vidray.config import FlowConfig, ModelConfig  # noqa: E402
from vidray.buckets import Bucket  # noqa: E402
from vidray.models import get_family  # noqa: E402
from vidray.train.step import flow_matching_step_loss, sample_generator  # noqa: E402

BUCKET = Bucket(5, 32, 32)
FLOW = FlowConfig(sigma_sampling="logit_normal", shift=3.0)


@pytest.fixture(scope="module")
def setup():
    family = get_family("easyanimate")
    transformer = family.build(ModelConfig(text_encoder="tiny_random"), seed=0).transformer
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(family.latent_shape(BUCKET, 3), generator=g)  # (3, 16, 2, 4, 4)
    embeds = torch.randn(3, 6, transformer.config.text_embed_dim, generator=g)
    mask = torch.ones(3, 6, dtype=torch.bool)
    return family, transformer, latents, embeds, mask


def test_sample_noise_depends_on_seed_step_and_sample_only():
    a = torch.randn(32, generator=sample_generator(0, 5, 123))
    torch.manual_seed(7)
    assert torch.equal(a, torch.randn(32, generator=sample_generator(0, 5, 123)))
    for other in (sample_generator(1, 5, 123), sample_generator(0, 6, 123), sample_generator(0, 5, 124)):
        assert not torch.equal(a, torch.randn(32, generator=other))


def test_a_sample_draws_the_same_noise_in_any_batch_position(setup):
    """Resized runs put a sample on another rank and slot: its noise and sigma must not change."""
    family, transformer, latents, embeds, mask = setup
    keys = [11, 22, 33]
    weights = torch.tensor([0.0, 1.0, 0.0])  # only sample 22 counts
    loss = flow_matching_step_loss(family, transformer, latents, embeds, mask, FLOW,
                                   [sample_generator(0, 4, k) for k in keys], loss_weights=weights)
    order = [1, 2, 0]
    moved = flow_matching_step_loss(family, transformer, latents[order], embeds[order], mask[order], FLOW,
                                    [sample_generator(0, 4, keys[i]) for i in order],
                                    loss_weights=weights[order])
    alone = flow_matching_step_loss(family, transformer, latents[1:2], embeds[1:2], mask[1:2], FLOW,
                                    [sample_generator(0, 4, 22)], loss_weights=torch.ones(1))
    assert moved.item() == pytest.approx(loss.item(), rel=1e-5)
    assert alone.item() == pytest.approx(loss.item(), rel=1e-5)


def test_weight_zero_samples_give_no_gradient_and_unit_weights_over_b_equal_the_mean(setup):
    family, transformer, latents, embeds, mask = setup
    gens = lambda: [sample_generator(3, 1, k) for k in (1, 2, 3)]  # noqa: E731
    mean = flow_matching_step_loss(family, transformer, latents, embeds, mask, FLOW, gens())
    weighted = flow_matching_step_loss(family, transformer, latents, embeds, mask, FLOW, gens(),
                                       loss_weights=torch.full((3,), 1 / 3))
    assert weighted.item() == pytest.approx(mean.item(), rel=1e-5)
    latents = latents.clone().requires_grad_(True)
    loss = flow_matching_step_loss(family, transformer, latents, embeds, mask, FLOW, gens(),
                                   loss_weights=torch.tensor([1.0, 0.0, 1.0]))
    loss.backward()
    assert latents.grad[1].abs().max() == 0 and latents.grad[0].abs().max() > 0
