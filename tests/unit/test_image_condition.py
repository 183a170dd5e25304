"""`vidray.models.conditioning.ImageCondition`, the typed image-to-video condition every family's `condition` returns:
what `predict` gets (`predict_kwargs`) and condition dropout per sample (`where`), on plain tensors; and
`ModelFamily.condition`'s None for a text-to-video model (the tiny EasyAnimate T2V transformer)."""

import pytest
import torch

from vidray.buckets import Bucket
from vidray.config import I2VConfig, ModelConfig
from vidray.models import get_family
from vidray.models.base import ModelFamily
from vidray.models.conditioning import ImageCondition


def _condition(batch_size: int, *, embeds: bool, fill: float = 1.0) -> ImageCondition:
    inpaint = torch.arange(batch_size * 17 * 2 * 3 * 3, dtype=torch.float32).view(batch_size, 17, 2, 3, 3) + fill
    image_embeds = torch.full((batch_size, 5, 4), fill) + torch.arange(batch_size).view(-1, 1, 1) if embeds else None
    return ImageCondition(inpaint, image_embeds)


def test_predict_kwargs_name_inpaint_latents_and_image_embeds_only_when_present():
    without = _condition(2, embeds=False)
    assert list(without.predict_kwargs()) == ["inpaint_latents"]
    assert without.predict_kwargs()["inpaint_latents"] is without.inpaint_latents
    both = _condition(2, embeds=True)
    assert list(both.predict_kwargs()) == ["inpaint_latents", "image_embeds"]
    assert both.predict_kwargs()["image_embeds"] is both.image_embeds and both.batch_size == 2
    with pytest.raises(ValueError, match="must have as many samples"):
        ImageCondition(torch.zeros(2, 17, 1, 1, 1), torch.zeros(3, 5, 4))


@pytest.mark.parametrize("embeds", [False, True])
def test_where_keeps_each_samples_condition_or_gives_it_the_empty_one_both_tensors_together(embeds):
    given = _condition(4, embeds=embeds)
    empty = ImageCondition(torch.zeros(4, 17, 2, 3, 3, dtype=torch.float64),  # cast to the condition's dtype
                           torch.zeros(4, 5, 4) if embeds else None)
    keep = torch.tensor([True, False, False, True])
    out = given.where(keep, empty)
    assert out.inpaint_latents.dtype == torch.float32
    for i, kept in enumerate(keep.tolist()):
        want = given if kept else empty
        assert torch.equal(out.inpaint_latents[i], want.inpaint_latents[i].float())
        if embeds:
            assert torch.equal(out.image_embeds[i], want.image_embeds[i])
    if not embeds:
        assert out.image_embeds is None
    assert torch.equal(given.where(torch.ones(4, dtype=torch.bool), empty).inpaint_latents, given.inpaint_latents)
    with pytest.raises(ValueError, match="must carry image_embeds exactly when the condition does"):
        given.where(keep, ImageCondition(empty.inpaint_latents, None if embeds else torch.zeros(4, 5, 4)))


def test_to_moves_both_tensors():
    moved = _condition(1, embeds=True).to(torch.float64)
    assert moved.inpaint_latents.dtype == moved.image_embeds.dtype == torch.float64
    assert _condition(1, embeds=False).to("cpu").image_embeds is None


def test_a_text_to_video_model_has_no_condition_and_an_inpaint_model_an_empty_one():
    family = get_family("easyanimate")
    cfg = ModelConfig(text_encoder="tiny_random", max_sequence_length=32)
    shape = family.latent_shape(Bucket(9, 32, 32), 2)
    assert family.condition(family.build(cfg, seed=0).transformer, latent_shape=shape) is None
    assert family.condition(cfg, clip=torch.zeros(2, 3, 9, 32, 32)) is None  # model.i2v null
    i2v_cfg = ModelConfig(text_encoder="tiny_random", max_sequence_length=32, i2v=I2VConfig())
    empty = family.condition(family.build(i2v_cfg, seed=0).transformer, latent_shape=shape)
    assert empty.inpaint_latents.shape == (2, 17, *shape[2:]) and empty.inpaint_latents.abs().max() == 0
    assert empty.image_embeds is None
    assert ModelFamily.condition(family, i2v_cfg, latent_shape=shape) is None  # the base: no image-to-video model
