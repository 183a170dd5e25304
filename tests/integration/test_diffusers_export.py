"""Export to a stock diffusers folder, reload it offline, and check our sampler against EasyAnimatePipeline.

Comparison (documented): the stock pipeline is run with OUR prompt_embeds/prompt_attention_mask (it would
otherwise pad prompts to 256 tokens, its `encode_prompt` default) and the same CPU generator; then its
output latents equal `sample_latents` and its decoded frames equal `generate_video` (to fp32 rounding).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from diffusers import EasyAnimatePipeline  # noqa: E402

from vidray.config import FlowConfig, ModelConfig  # noqa: E402
from vidray.buckets import Bucket  # noqa: E402
from vidray.inference.sampler import generate_video, sample_latents  # noqa: E402
from vidray.models import get_family  # noqa: E402
from vidray.models.text_encoder import encode_prompts  # noqa: E402

BUCKET = Bucket(9, 64, 64)
FLOW = FlowConfig(shift=3.0, num_train_timesteps=1000)
PROMPTS = ["a red ball bouncing", "waves on a beach"]
MAX_SEQUENCE_LENGTH = 16


@pytest.fixture(scope="module")
def family():
    return get_family("easyanimate")


@pytest.fixture(scope="module")
def exported(family, tmp_path_factory):
    components = family.build(ModelConfig(text_encoder="tiny_random"), seed=0)
    out_dir = family.save_pipeline(components, tmp_path_factory.mktemp("export") / "diffusers", FLOW)
    pipe = EasyAnimatePipeline.from_pretrained(out_dir, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return components, out_dir, pipe


def test_stock_pipeline_loads_export_offline_and_generates_from_prompts(exported):
    _, out_dir, pipe = exported
    assert (out_dir / "model_index.json").is_file()
    assert list(out_dir.glob("transformer/*.safetensors")) and list(out_dir.glob("vae/*.safetensors"))
    assert not list(out_dir.parent.glob(".diffusers.tmp-*"))  # temp folder renamed away
    assert pipe.scheduler.config.shift == FLOW.shift
    frames = pipe(
        prompt=PROMPTS[:1], negative_prompt=[""], num_frames=9, height=64, width=64, num_inference_steps=2,
        guidance_scale=3.0, generator=torch.Generator().manual_seed(0), output_type="np",
    ).frames
    assert frames.shape == (1, 9, 64, 64, 3) and np.isfinite(frames).all()


def test_load_pretrained_round_trips_weights_and_build_accepts_the_folder(family, exported):
    components, out_dir, _ = exported
    loaded = family.build(ModelConfig(init="pretrained", pretrained_path=str(out_dir)), seed=123)
    for module in ("transformer", "vae", "text_encoder"):
        saved, reloaded = getattr(components, module).state_dict(), getattr(loaded, module).state_dict()
        assert saved.keys() == reloaded.keys(), f"{module}: {sorted(saved.keys() ^ reloaded.keys())}"
        assert len(saved) > 0, module
        for (name, a), (name_b, b) in zip(saved.items(), reloaded.items(), strict=True):
            assert name == name_b and torch.equal(a, b), f"{module}.{name}"
    e1, m1 = encode_prompts(components.text_encoder, components.tokenizer, PROMPTS, max_sequence_length=8)
    e2, m2 = encode_prompts(loaded.text_encoder, loaded.tokenizer, PROMPTS, max_sequence_length=8)
    torch.testing.assert_close(e1, e2)
    assert torch.equal(m1, m2)
    assert not any(p.requires_grad for p in loaded.vae.parameters())


@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
def test_sample_latents_equals_stock_pipeline_latents(family, exported, guidance_scale):
    components, _, pipe = exported
    prompt_embeds, prompt_attention_mask = encode_prompts(
        components.text_encoder, components.tokenizer, PROMPTS, max_sequence_length=MAX_SEQUENCE_LENGTH
    )
    negative_prompt_embeds, negative_prompt_attention_mask = encode_prompts(
        components.text_encoder, components.tokenizer, ["", ""], max_sequence_length=MAX_SEQUENCE_LENGTH
    )
    latent_shape = family.latent_shape(BUCKET, len(PROMPTS))
    steps = []
    ours = sample_latents(
        family, components.transformer, prompt_embeds, prompt_attention_mask, latent_shape=latent_shape,
        num_inference_steps=3, shift=FLOW.shift, num_train_timesteps=FLOW.num_train_timesteps,
        guidance_scale=guidance_scale, negative_prompt_embeds=negative_prompt_embeds,
        negative_prompt_attention_mask=negative_prompt_attention_mask, generator=torch.Generator().manual_seed(5),
        callback=lambda i, sigma, latents: steps.append((i, sigma)),
    )
    stock = pipe(
        prompt_embeds=prompt_embeds, prompt_attention_mask=prompt_attention_mask,
        negative_prompt_embeds=negative_prompt_embeds, negative_prompt_attention_mask=negative_prompt_attention_mask,
        num_frames=BUCKET.num_frames, height=BUCKET.height, width=BUCKET.width, num_inference_steps=3,
        guidance_scale=guidance_scale, generator=torch.Generator().manual_seed(5), output_type="latent",
    ).frames
    assert ours.shape == stock.shape == latent_shape
    torch.testing.assert_close(ours, stock, atol=1e-5, rtol=1e-5)
    assert [i for i, _ in steps] == [0, 1, 2] and steps[0][1] == 1.0


def test_generate_video_equals_stock_pipeline_frames(family, exported):
    components, _, pipe = exported
    frames = generate_video(
        family, components, PROMPTS, BUCKET, flow=FLOW, num_inference_steps=2, max_sequence_length=MAX_SEQUENCE_LENGTH,
        seed=3,
    )
    assert frames.shape == (2, 9, 64, 64, 3) and frames.dtype == np.uint8
    prompt_embeds, prompt_attention_mask = encode_prompts(
        components.text_encoder, components.tokenizer, PROMPTS, max_sequence_length=MAX_SEQUENCE_LENGTH
    )
    stock = pipe(
        prompt_embeds=prompt_embeds, prompt_attention_mask=prompt_attention_mask, num_frames=9, height=64, width=64,
        num_inference_steps=2, guidance_scale=1.0, generator=torch.Generator().manual_seed(3), output_type="np",
    ).frames  # (B, F, H, W, 3) float in [0, 1]
    stock_uint8 = (stock * 255).round().astype(np.uint8)
    assert np.abs(frames.astype(int) - stock_uint8.astype(int)).max() <= 1


def test_save_pipeline_refuses_to_overwrite_a_folder_that_is_not_a_pipeline(family, exported, tmp_path):
    components, _, _ = exported
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a diffusers pipeline folder"):
        family.save_pipeline(components, tmp_path, FLOW)
    assert (tmp_path / "notes.txt").read_text() == "keep me"
