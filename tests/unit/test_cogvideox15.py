"""CogVideoX 1.5 text-to-video (`patch_size_t` 2) in the cogvideox family against the stock
`diffusers.CogVideoXPipeline` (issue 29 part 3), on CPU in fp32, with the tiny 1.5 preset
(`build_tiny(version="1.5")`: CogVideoX1.5-5B's layout and scheduler) written as a folder, the way a real
CogVideoX1.5-5B folder comes in (`init: pretrained`); and its image-to-video twin (CogVideoX1.5-5B-I2V's layout:
`ofs_embed_dim`) against the stock `CogVideoXImageToVideoPipeline`.

The latents of a 9-frame bucket have 3 latent frames, padded to 4 (a multiple of patch_size_t) by one leading frame:
noise drawn for all 4 and denoised together by both samplers, the padding dropped before decoding
(`CogVideoXPipeline.__call__`'s `additional_frames`); in training the first latent frame copied in front, as the
CogVideoX 1.5 finetuning scripts' `compute_loss` pads before drawing the noise.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json  # noqa: E402
import shutil  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from diffusers import CogVideoXDDIMScheduler, CogVideoXPipeline  # noqa: E402

from vidray.config import FlowConfig, I2VConfig, ModelConfig  # noqa: E402
from vidray.buckets import Bucket  # noqa: E402
from vidray.diffusion.flow_matching import sample_sigmas  # noqa: E402
from vidray.inference.sampler import generate_video, initial_noise, sample_latents  # noqa: E402
from vidray.models import cogvideox, get_family  # noqa: E402
from vidray.train.step import flow_matching_step_loss  # noqa: E402
from vidray.models.export import load_pipeline_folder

from tests.conftest import clip_condition  # noqa: E402

BUCKET = Bucket(9, 32, 32)
FLOW = FlowConfig(num_train_timesteps=1000)
PROMPTS = ["a red ball bouncing", "waves on a beach"]
MAX_SEQUENCE_LENGTH = 16


def _to_pipeline_layout(latents: torch.Tensor) -> torch.Tensor:
    return latents.permute(0, 2, 1, 3, 4)  # (B, C, F, H, W) <-> (B, F, C, H, W)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny 1.5 preset's export: the folder every test loads."""
    components = cogvideox.build_tiny("tiny_random", seed=0, version="1.5")
    family = get_family("cogvideox").for_transformer(components.transformer)
    return family.save_pipeline(components, tmp_path_factory.mktemp("export15") / "diffusers", FLOW)


@pytest.fixture(scope="module")
def model_cfg(folder):
    return ModelConfig(family="cogvideox", init="pretrained", pretrained_path=str(folder),
                       max_sequence_length=MAX_SEQUENCE_LENGTH)


@pytest.fixture(scope="module")
def family(model_cfg):
    """The family of the 1.5 model (`for_model`: the folder's configs), as a process running it holds."""
    return get_family("cogvideox").for_model(model_cfg)


@pytest.fixture(scope="module")
def loaded(family, folder, model_cfg):
    components = family.build(model_cfg, seed=0)
    pipe = CogVideoXPipeline.from_pretrained(folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return components, pipe


def test_the_export_is_a_stock_cogvideox_pipeline_with_the_1_5_layout_and_scheduler(family, folder, loaded):
    _, pipe = loaded
    assert json.loads((folder / "model_index.json").read_text())["_class_name"] == "CogVideoXPipeline"
    assert pipe.transformer.config.patch_size_t == 2 and pipe.transformer.config.ofs_embed_dim is None
    assert pipe.vae.config.invert_scale_latents
    assert pipe.scheduler.config.snr_shift_scale == 1.0 and pipe.scheduler.config.timestep_spacing == "trailing"
    assert (family.scheduler_config, family.patch_size_t) == (cogvideox.SCHEDULER_CONFIG_5B, 2)
    from_transformer = get_family("cogvideox").for_transformer(loaded[0].transformer)
    assert (from_transformer.scheduler_config, from_transformer.patch_size_t) == (cogvideox.SCHEDULER_CONFIG_5B, 2)


def test_the_latent_shape_pads_the_odd_latent_frames_by_one_as_the_pipeline(family, loaded):
    assert family.latent_shape(Bucket(9, 32, 48), 2) == (2, 16, 4, 4, 6)  # 3 latent frames + 1
    assert get_family("cogvideox").latent_shape(Bucket(9, 32, 48), 2) == (2, 16, 3, 4, 6)  # 1.0's: unpadded
    assert family.latent_shape(Bucket(17, 32, 32), 1)[2] == 6  # 5 + 1
    assert family.latent_shape(Bucket(1, 32, 32), 1)[2] == 2  # 1 + 1: the pipeline's 1-frame video too


@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
def test_stock_pipeline_latents_equal_sample_latents_padding_included(family, loaded, guidance_scale):
    components, pipe = loaded
    embeds, mask = family.encode_prompt(components.text_encoder, components.tokenizer, PROMPTS,
                                        max_sequence_length=MAX_SEQUENCE_LENGTH)
    negative_embeds, negative_mask = family.encode_prompt(components.text_encoder, components.tokenizer, ["", ""],
                                                          max_sequence_length=MAX_SEQUENCE_LENGTH)
    latent_shape = family.latent_shape(BUCKET, len(PROMPTS))
    noise = initial_noise(latent_shape, seed=5)
    ours = sample_latents(
        family, components.transformer, embeds, mask, latent_shape=latent_shape, num_inference_steps=4,
        shift=FLOW.shift, num_train_timesteps=1000, guidance_scale=guidance_scale,
        negative_prompt_embeds=negative_embeds, negative_prompt_attention_mask=negative_mask, latents=noise.clone(),
    )
    stock = pipe(
        prompt=PROMPTS, negative_prompt=["", ""], num_frames=BUCKET.num_frames, height=BUCKET.height,
        width=BUCKET.width, num_inference_steps=4, guidance_scale=guidance_scale,
        max_sequence_length=MAX_SEQUENCE_LENGTH, latents=_to_pipeline_layout(noise.clone()), output_type="latent",
    ).frames  # the padded latents: the pipeline drops the padding only before decoding
    assert ours.shape == latent_shape == (2, 16, 4, 4, 4)
    torch.testing.assert_close(ours, _to_pipeline_layout(stock), atol=1e-5, rtol=1e-5)


def test_generate_video_equals_stock_pipeline_frames_the_padding_dropped(family, loaded):
    components, pipe = loaded
    frames = generate_video(family, components, PROMPTS, BUCKET, flow=FLOW, num_inference_steps=2,
                            max_sequence_length=MAX_SEQUENCE_LENGTH, seed=3)
    noise = initial_noise(family.latent_shape(BUCKET, len(PROMPTS)), seed=3)
    stock = pipe(prompt=PROMPTS, num_frames=BUCKET.num_frames, height=BUCKET.height, width=BUCKET.width,
                 num_inference_steps=2, guidance_scale=1.0, max_sequence_length=MAX_SEQUENCE_LENGTH,
                 latents=_to_pipeline_layout(noise), output_type="np").frames  # (B, F, H, W, 3) in [0, 1]
    assert frames.shape == (2, *BUCKET, 3) and stock.shape == frames.shape
    assert np.abs(frames.astype(int) - (stock * 255).round().astype(int)).max() <= 1


def test_training_pads_the_first_latent_frame_in_front_and_takes_the_v_loss_on_every_frame(family, loaded):
    components, _ = loaded
    video = torch.rand(2, 3, *BUCKET, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = family.encode_video(components.vae, video)
    with torch.no_grad():  # the finetuning scripts' compute_loss: latent = cat([first_frame * ncopy, latent])
        plain = components.vae.encode(video).latent_dist.mode() * components.vae.config.scaling_factor
    torch.testing.assert_close(latents, torch.cat([plain[:, :, :1], plain], dim=2))
    assert latents.shape == family.latent_shape(BUCKET, 2)
    embeds, mask = family.encode_prompt(components.text_encoder, components.tokenizer, PROMPTS,
                                        max_sequence_length=MAX_SEQUENCE_LENGTH)
    loss = flow_matching_step_loss(family, components.transformer, latents, embeds, mask, FLOW,
                                   torch.Generator().manual_seed(4))
    loss.backward()
    assert all(p.grad is not None for p in components.transformer.parameters() if p.requires_grad)
    components.transformer.zero_grad(set_to_none=True)
    g = torch.Generator().manual_seed(4)  # the step's draws: noise for all 4 latent frames, then the sigmas
    noise = torch.randn(latents.shape, generator=g)
    t = (sample_sigmas(2, FLOW, generator=g).double() * 1000).round().long()
    scheduler = CogVideoXDDIMScheduler(**cogvideox.SCHEDULER_CONFIG_5B)
    with torch.no_grad():
        pred = family.predict(components.transformer, scheduler.add_noise(latents, noise, t), t.float(), embeds, mask)
    expected = (pred - scheduler.get_velocity(latents, noise, t)).pow(2).mean()
    torch.testing.assert_close(loss.detach(), expected, atol=1e-6, rtol=1e-5)


def test_decode_drops_the_padding_so_encode_then_decode_keeps_the_frame_count(family, loaded):
    components, _ = loaded
    for bucket in (Bucket(9, 32, 32), Bucket(1, 32, 32)):
        video = torch.rand(1, 3, *bucket, generator=torch.Generator().manual_seed(1)) * 2 - 1
        latents = family.encode_video(components.vae, video)
        with torch.no_grad():
            decoded = family.decode_latents(components.vae, latents)
            expected = components.vae.decode(latents[:, :, 1:] / components.vae.config.scaling_factor).sample
        assert decoded.shape == video.shape
        torch.testing.assert_close(decoded, expected.clamp(-1, 1), atol=1e-6, rtol=0)


def test_load_pretrained_round_trips_the_1_5_export_and_its_scheduler(family, folder, loaded, tmp_path):
    components, _ = loaded
    reloaded = load_pipeline_folder(get_family("cogvideox"), folder)
    assert all(torch.equal(v, reloaded.transformer.state_dict()[k])
               for k, v in components.transformer.state_dict().items())
    assert cogvideox.scheduler_config_of(reloaded.transformer) == cogvideox.SCHEDULER_CONFIG_5B
    assert family.probe_loss(reloaded.transformer, reloaded.transformer).ndim == 0
    assert family.no_grad_parameter_names(reloaded.transformer) == []
    again = family.save_pipeline(reloaded, tmp_path / "again", FLOW)
    assert json.loads((again / "scheduler" / "scheduler_config.json").read_text())["snr_shift_scale"] == 1.0


def _folder_with(folder, tmp_path, subfolder, **change):
    other = tmp_path / "other"
    if not other.exists():
        shutil.copytree(folder, other)
    path = other / subfolder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    return other


@pytest.mark.parametrize("subfolder, change, message", [
    ("vae", {"invert_scale_latents": False},
     "transformer patch_size_t=2 but vae invert_scale_latents=false: a CogVideoX 1.5 model .* fix vae/config.json"),
    ("transformer", {"patch_size_t": 4}, "transformer patch_size_t=4, but the cogvideox family runs null"),
    ("transformer", {"ofs_embed_dim": 32}, "ofs_embed_dim=32 on a text-to-video transformer .* set ofs_embed_dim: "
                                           "null in transformer/config.json"),
    ("transformer", {"use_rotary_positional_embeddings": False},
     "set use_rotary_positional_embeddings: true in transformer/config.json"),
])
def test_a_1_5_folder_the_family_cannot_run_is_refused_in_one_line_naming_it(family, folder, tmp_path, subfolder,
                                                                            change, message):
    other = _folder_with(folder, tmp_path, subfolder, **change)
    with pytest.raises(ValueError, match=f"{other}.*{message}") as err:
        family.load_diffusion_models(ModelConfig(family="cogvideox", init="pretrained", pretrained_path=str(other)),
                                 seed=0).transformer
    assert "\n" not in str(err.value)


def test_a_bucket_past_the_1_5_rotary_table_or_unpadded_latents_are_one_line_errors(family, loaded):
    components, _ = loaded
    embeds, mask = torch.randn(1, 4, 64), torch.ones(1, 4, dtype=torch.bool)
    too_wide = torch.zeros(family.latent_shape(Bucket(9, 32, 96), 1))  # 6 x 2 patches: the table has 4 x 4
    with pytest.raises(ValueError, match=r"covers videos up to 64x64 px, got 32x96: set data.buckets") as err:
        family.predict(components.transformer, too_wide, torch.tensor([500.0]), embeds, mask)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="takes latents padded to a multiple of 2 frames, got 3"):
        family.predict(components.transformer, torch.zeros(1, 16, 3, 4, 4), torch.tensor([500.0]), embeds, mask)


def test_a_transformer_through_another_model_s_family_is_refused_in_one_line(family, loaded):
    two_b = cogvideox.build_tiny("tiny_random", seed=0).transformer
    embeds, mask = torch.randn(1, 4, 64), torch.ones(1, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"^this CogVideoX transformer has patch_size_t=None, snr_shift_scale=3.0, "
                                         "but the family it is called through is bound to patch_size_t=2, "
                                         "snr_shift_scale=1.0: use the family of its own model"):
        family.predict(two_b, torch.zeros(1, 16, 4, 4, 4), torch.tensor([500.0]), embeds, mask)
    with pytest.raises(ValueError, match=r"^this CogVideoX transformer has patch_size_t=2, snr_shift_scale=1.0, but "
                                         "the family it is called through is bound to patch_size_t=None"):
        get_family("cogvideox").predict(loaded[0].transformer, torch.zeros(1, 16, 4, 4, 4), torch.tensor([500.0]),
                                        embeds, mask)


# CogVideoX 1.5 image-to-video (CogVideoX1.5-5B-I2V's layout: in_channels 32, ofs_embed_dim).

def _image(size=(48, 40), seed=0):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def i2v(family, tmp_path_factory, folder):
    from diffusers import CogVideoXImageToVideoPipeline

    components = cogvideox.build_tiny("tiny_random", seed=1, i2v=True, version="1.5")
    out_dir = family.save_pipeline(components, tmp_path_factory.mktemp("export15i2v") / "diffusers", FLOW)
    cfg = ModelConfig(family="cogvideox", init="pretrained", pretrained_path=str(out_dir),
                      max_sequence_length=MAX_SEQUENCE_LENGTH, i2v=I2VConfig(condition="first"))
    loaded = family.build(cfg, seed=0)
    pipe = CogVideoXImageToVideoPipeline.from_pretrained(out_dir, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return loaded, out_dir, pipe


@pytest.mark.parametrize("guidance_scale, steps", [(1.0, 2), (4.0, 4)])
def test_image_to_video_1_5_gives_the_stock_pipelines_latents_and_frames(family, i2v, guidance_scale, steps):
    components, out_dir, pipe = i2v
    assert json.loads((out_dir / "model_index.json").read_text())["_class_name"] == "CogVideoXImageToVideoPipeline"
    assert (pipe.transformer.config.patch_size_t, pipe.transformer.config.ofs_embed_dim) == (2, 32)
    image, seen = _image(), []
    frames = generate_video(family, components, [PROMPTS[0]], BUCKET, flow=FLOW, num_inference_steps=steps,
                            guidance_scale=guidance_scale, max_sequence_length=MAX_SEQUENCE_LENGTH, seed=11,
                            image=image, callback=lambda i, sigma, latents: seen.append(latents.clone()))
    noise = initial_noise(family.latent_shape(BUCKET, 1), seed=11)
    kwargs = dict(image=image, prompt=PROMPTS[0], num_frames=BUCKET.num_frames, height=BUCKET.height,
                  width=BUCKET.width, num_inference_steps=steps, guidance_scale=guidance_scale,
                  max_sequence_length=MAX_SEQUENCE_LENGTH)
    stock = pipe(**kwargs, generator=torch.Generator().manual_seed(11), latents=_to_pipeline_layout(noise.clone()),
                 output_type="latent").frames
    assert seen[-1].shape == (1, 16, 4, 4, 4)
    torch.testing.assert_close(seen[-1], _to_pipeline_layout(stock), atol=1e-5, rtol=1e-5)
    stock_frames = pipe(**kwargs, generator=torch.Generator().manual_seed(11), latents=_to_pipeline_layout(noise),
                        output_type="np").frames
    assert frames.shape == stock_frames.shape == (1, *BUCKET, 3)
    assert np.abs(frames.astype(int) - (stock_frames * 255).round().astype(int)).max() <= 1


def test_image_to_video_1_5_trains_on_its_first_frame_in_the_padded_frame_with_ofs(family, i2v):
    components, _, _ = i2v
    video = torch.rand(2, 3, *BUCKET, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = family.encode_video(components.vae, video)
    i2v_cfg = ModelConfig(family="cogvideox", max_sequence_length=MAX_SEQUENCE_LENGTH, i2v=I2VConfig())
    condition = clip_condition(family, i2v_cfg, components, video, "first").inpaint_latents
    assert condition.shape == latents.shape == (2, 16, 4, 4, 4)
    torch.testing.assert_close(condition[:, :, :1], cogvideox.encode_image_latents(components.vae, video[:, :, 0]))
    assert condition[:, :, 1:].abs().sum() == 0  # the image in frame 0 (the padding frame), zeros after
    embeds, mask = family.encode_prompt(components.text_encoder, components.tokenizer, PROMPTS,
                                        max_sequence_length=MAX_SEQUENCE_LENGTH)
    loss = flow_matching_step_loss(family, components.transformer, latents, embeds, mask, FLOW,
                                   torch.Generator().manual_seed(4), inpaint_latents=condition)
    g = torch.Generator().manual_seed(4)
    noise = torch.randn(latents.shape, generator=g)
    t = (sample_sigmas(2, FLOW, generator=g).double() * 1000).round().long()
    scheduler = CogVideoXDDIMScheduler(**cogvideox.SCHEDULER_CONFIG_5B)
    noisy = scheduler.add_noise(latents, noise, t)
    with torch.no_grad():  # the stock call: noisy then image latents on channels, ofs 2.0
        rotary = cogvideox.rotary_positional_embeddings(components.transformer, 4, 4, 4, "cpu")
        pred = components.transformer(
            hidden_states=torch.cat([noisy, condition], dim=1).permute(0, 2, 1, 3, 4), encoder_hidden_states=embeds,
            timestep=t, ofs=torch.full((1,), 2.0), image_rotary_emb=rotary, return_dict=False)[0]
    expected = (pred.permute(0, 2, 1, 3, 4) - scheduler.get_velocity(latents, noise, t)).pow(2).mean()
    torch.testing.assert_close(loss.detach(), expected, atol=1e-6, rtol=1e-5)
    assert family.probe_loss(components.transformer, components.transformer).ndim == 0
