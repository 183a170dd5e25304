"""Tiny real EasyAnimate components (no mocks): shapes, gradients, prompt encoding, registry errors."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from diffusers import EasyAnimatePipeline, FlowMatchEulerDiscreteScheduler  # noqa: E402

from vidray.config import FlowConfig, ModelConfig  # noqa: E402
from vidray.buckets import Bucket  # noqa: E402
from vidray.diffusion.flow_matching import (  # noqa: E402
    add_noise,
    flow_matching_loss,
    sample_sigmas,
    timesteps_from_sigmas,
    velocity_target,
)
from vidray.models import get_family  # noqa: E402
from vidray.models.text_encoder import build_text_encoder, encode_prompts  # noqa: E402
from vidray.models.vae import decode_latents, encode_video, frames_to_video, video_to_frames  # noqa: E402

BUCKET = Bucket(9, 64, 64)


@pytest.fixture(scope="module")
def family():
    return get_family("easyanimate")


@pytest.fixture(scope="module")
def components(family):
    return family.build(ModelConfig(text_encoder="tiny_random"), seed=0)


def _num_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_tiny_preset_has_about_2_million_dit_and_45_thousand_vae_params(components):
    num_transformer, num_vae = _num_params(components.transformer), _num_params(components.vae)
    assert 1.5e6 < num_transformer < 2.5e6, num_transformer  # 1.87 M with the 64-wide tiny_random text encoder
    assert 3e4 < num_vae < 6e4, num_vae  # 44.5 k (TINY_VAE: trains on 2 CPU cores in the demo)
    assert not any(p.requires_grad for p in components.vae.parameters())
    assert not any(p.requires_grad for p in components.text_encoder.parameters())
    assert all(p.requires_grad for p in components.transformer.parameters())


def test_build_is_deterministic_under_seed_and_leaves_global_rng_alone(family):
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = family.build(ModelConfig(text_encoder="tiny_random"), seed=7)
    assert torch.equal(torch.get_rng_state(), before)
    b = family.build(ModelConfig(text_encoder="tiny_random"), seed=7)
    c = family.build(ModelConfig(text_encoder="tiny_random"), seed=8)
    for module in ("transformer", "vae", "text_encoder"):
        state_a, state_b = getattr(a, module).state_dict(), getattr(b, module).state_dict()
        assert state_a.keys() == state_b.keys(), module
        assert len(state_a) > 0, module
        for name, value in state_a.items():
            assert torch.equal(value, state_b[name]), f"{module}.{name}"
    # ... and the seed matters: another seed gives other weights.
    state_a, state_c = a.transformer.state_dict(), c.transformer.state_dict()
    assert any(not torch.equal(state_a[name], state_c[name]) for name in state_a)


def test_latent_shape_of_bucket_9x64x64(family):
    assert family.latent_shape(BUCKET, 2) == (2, 16, 3, 8, 8)
    assert family.latent_shape(Bucket(1, 32, 48), 1) == (1, 16, 1, 4, 6)
    with pytest.raises(ValueError, match="multiples of 16"):
        family.latent_shape(Bucket(9, 64, 72), 2)
    with pytest.raises(ValueError, match="num_frames must be 1 or k\\*4\\+1"):
        family.latent_shape(Bucket(8, 64, 64), 2)


def test_forward_backward_at_bucket_9x64x64_gives_velocity_shape_and_grads(family, components):
    transformer = components.transformer
    latent_shape = family.latent_shape(BUCKET, 2)
    g = torch.Generator().manual_seed(0)
    latents, noise = torch.randn(latent_shape, generator=g), torch.randn(latent_shape, generator=g)
    sigmas = sample_sigmas(2, FlowConfig(shift=3.0), generator=g)
    prompt_embeds, prompt_attention_mask = encode_prompts(
        components.text_encoder, components.tokenizer, ["a red ball", "waves"], max_sequence_length=16
    )
    model_pred = family.predict(
        transformer, add_noise(latents, noise, sigmas), timesteps_from_sigmas(sigmas, 1000), prompt_embeds,
        prompt_attention_mask,
    )
    assert model_pred.shape == latent_shape
    loss = flow_matching_loss(model_pred, velocity_target(latents, noise))
    loss.backward()
    assert torch.isfinite(loss)
    no_grad = set(family.no_grad_parameter_names(transformer))
    for name, p in transformer.named_parameters():
        assert (p.grad is None) == (name in no_grad), name
    transformer.zero_grad(set_to_none=True)


def test_predict_calls_transformer_like_the_stock_pipeline(family, components):
    transformer = components.transformer
    g = torch.Generator().manual_seed(1)
    noisy_latents = torch.randn(family.latent_shape(BUCKET, 2), generator=g)
    prompt_embeds = torch.randn(2, 5, 64, generator=g)
    timesteps = torch.tensor([999.0, 250.0])
    with torch.no_grad():
        expected = transformer(noisy_latents, timesteps, encoder_hidden_states=prompt_embeds, return_dict=False)[0]
        mask = torch.ones(2, 5, dtype=torch.bool)
        model_pred = family.predict(transformer, noisy_latents, timesteps, prompt_embeds, mask)
    torch.testing.assert_close(model_pred, expected)
    with pytest.raises(ValueError, match="prompt_attention_mask"):
        family.predict(transformer, noisy_latents, timesteps, prompt_embeds, torch.ones(2, 4, dtype=torch.bool))


def test_no_grad_parameter_names_are_last_block_text_output_and_freezing_them_fixes_the_graph(family):
    components = family.build(ModelConfig(text_encoder="tiny_random"), seed=0)
    transformer = components.transformer
    names = family.no_grad_parameter_names(transformer)
    last = len(transformer.transformer_blocks) - 1
    prefixes = (f"transformer_blocks.{last}.attn1.to_add_out.", f"transformer_blocks.{last}.txt_ff.")
    assert names and all(n.startswith(prefixes) for n in names), names
    assert {n.rsplit(".", 1)[0] for n in names} == {
        f"transformer_blocks.{last}.attn1.to_add_out",
        f"transformer_blocks.{last}.txt_ff.net.0.proj",
        f"transformer_blocks.{last}.txt_ff.net.2",
    }
    assert all(p.grad is None for p in transformer.parameters())  # the probe does not touch .grad
    params = dict(transformer.named_parameters())
    for name in names:
        params[name].requires_grad_(False)
    assert family.no_grad_parameter_names(transformer) == []
    # A real step now gives every trainable parameter a gradient (what DDP's static graph needs).
    out = family.predict(
        transformer,
        torch.randn(1, 16, 1, 4, 4),
        torch.tensor([10.0]),
        torch.randn(1, 3, 64),
        torch.ones(1, 3, dtype=torch.bool),
    )
    out.sum().backward()
    assert all(p.grad is not None for p in transformer.parameters() if p.requires_grad)


def test_vae_encode_decode_shapes_and_frame_conversions(family, components):
    g = torch.Generator().manual_seed(0)
    frames = torch.randint(0, 256, (2, 9, 64, 64, 3), dtype=torch.uint8, generator=g).numpy()
    video = frames_to_video(frames)
    assert video.shape == (2, 3, 9, 64, 64) and video.dtype == torch.float32
    assert video.min() >= -1.0 and video.max() <= 1.0
    np.testing.assert_array_equal(video_to_frames(video), frames)  # exact uint8 round trip
    latents = encode_video(components.vae, video)
    assert latents.shape == family.latent_shape(BUCKET, 2) and latents.dtype == torch.float32
    torch.testing.assert_close(encode_video(components.vae, video), latents)  # posterior mode: deterministic
    decoded = decode_latents(components.vae, latents)
    assert decoded.shape == (2, 3, 9, 64, 64) and decoded.min() >= -1.0 and decoded.max() <= 1.0
    with pytest.raises(ValueError, match="uint8"):
        frames_to_video(frames.astype(np.float32))


def test_encode_prompts_pads_truncates_and_matches_stock_pipeline_encode_prompt(components):
    text_encoder, tokenizer = components.text_encoder, components.tokenizer
    prompts = ["a cat", "a dog running on the beach at sunset " * 4]
    prompt_embeds, prompt_attention_mask = encode_prompts(text_encoder, tokenizer, prompts, max_sequence_length=12)
    assert prompt_embeds.shape == (2, 12, 64) and prompt_embeds.dtype == torch.float32
    assert prompt_attention_mask.dtype == torch.bool
    assert prompt_attention_mask[0].tolist() == [True] * 4 + [False] * 8  # [CLS] a cat [SEP] + right padding
    assert prompt_attention_mask[1].all()  # truncated to 12 tokens
    pipe = EasyAnimatePipeline(
        vae=components.vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=components.transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(),
    )
    expected_embeds, _, expected_mask, _ = pipe.encode_prompt(
        prompts, do_classifier_free_guidance=False, max_sequence_length=12, device=torch.device("cpu"),
        dtype=torch.float32,
    )
    torch.testing.assert_close(prompt_embeds, expected_embeds)
    assert torch.equal(prompt_attention_mask, expected_mask.bool())


def test_minilm_text_encoder_loads_offline_with_384_wide_hidden_states_minus_2():
    text_encoder, tokenizer = build_text_encoder("minilm")
    assert text_encoder.config.hidden_size == 384 and text_encoder.config.num_hidden_layers == 6
    prompt_embeds, prompt_attention_mask = encode_prompts(text_encoder, tokenizer, ["a cat"], max_sequence_length=8)
    assert prompt_embeds.shape == (1, 8, 384)
    ids = tokenizer(["a cat"], padding="max_length", max_length=8, return_tensors="pt")
    with torch.no_grad():
        hidden_states = text_encoder(**ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(prompt_embeds, hidden_states[-2])  # second-to-last layer, as EasyAnimate uses
    assert not torch.allclose(prompt_embeds, hidden_states[-1])


def test_get_family_error_lists_valid_families():
    with pytest.raises(ValueError, match=r"unknown model family 'hunyuanvideo'; valid: animatediff, cogvideox, "
                                         r"easyanimate, wan"):
        get_family("hunyuanvideo")


def test_pretrained_init_with_missing_folder_says_it_is_not_a_local_diffusers_folder(family, tmp_path):
    cfg = ModelConfig(init="pretrained", pretrained_path=str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="not a local diffusers folder"):
        family.build(cfg, seed=0)
    with pytest.raises(ValueError, match="unknown text encoder 'big'; valid: minilm, tiny_random"):
        build_text_encoder("big")
