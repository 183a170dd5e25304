"""CogVideoX 1.0 image-to-video (`model.i2v` on the cogvideox family) against the stock
`diffusers.CogVideoXImageToVideoPipeline`, on CPU in fp32.

Parity: the export loads in the stock I2V pipeline offline, and for the same prompt, image and seed its
`output_type="latent"` latents equal `vidray generate --image`'s (`generate_video`) at atol 1e-5. The stock pipeline
samples the image's VAE posterior from its `generator` (vidray draws it from a CPU generator seeded with the seed),
and draws its initial noise laid out (B, F, C, H, W), so it is given vidray's noise (`initial_noise`, the seed's)
permuted as `latents=`, as in test_cogvideox.py.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import dataclasses  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from diffusers import CogVideoXDDIMScheduler, CogVideoXImageToVideoPipeline, CogVideoXTransformer3DModel  # noqa: E402
from PIL import Image  # noqa: E402

from vidray.cards import get_card  # noqa: E402
from vidray.config import FlowConfig, I2VConfig, ModelConfig  # noqa: E402
from vidray.buckets import Bucket  # noqa: E402
from vidray.inference.sampler import generate_video, initial_noise  # noqa: E402
from vidray.models import get_family  # noqa: E402
from vidray.models.base import Components  # noqa: E402
from vidray.models.cogvideox import SCHEDULER_CONFIG, TINY_I2V_TRANSFORMER, preprocess_image  # noqa: E402
from vidray.models.export import inspect_model  # noqa: E402
from vidray.train.step import flow_matching_step_loss  # noqa: E402
from vidray.models.export import load_pipeline_folder

from tests.conftest import clip_condition, takes_image  # noqa: E402

BUCKET = Bucket(9, 32, 32)
FLOW = FlowConfig(num_train_timesteps=1000)
PROMPT = "a red ball bouncing"
MAX_SEQUENCE_LENGTH = 16
CFG = ModelConfig(family="cogvideox", text_encoder="tiny_random", max_sequence_length=MAX_SEQUENCE_LENGTH,
                  i2v=I2VConfig(condition="first"))
T2V_CFG = dataclasses.replace(CFG, i2v=None)


def _to_pipeline_layout(latents: torch.Tensor) -> torch.Tensor:
    return latents.permute(0, 2, 1, 3, 4)  # (B, C, F, H, W) <-> (B, F, C, H, W)


def _image(size=(48, 40), seed=0) -> Image.Image:
    """A random RGB picture of another size than the bucket (so the resize matters)."""
    pixels = np.random.default_rng(seed).integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def family():
    return get_family("cogvideox")


@pytest.fixture(scope="module")
def exported(family, tmp_path_factory):
    components = family.build(CFG, seed=0)
    out_dir = family.save_pipeline(components, tmp_path_factory.mktemp("export") / "diffusers", FLOW)
    pipe = CogVideoXImageToVideoPipeline.from_pretrained(out_dir, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return components, out_dir, pipe


def _generate_latents(family, components, image, seed, steps, guidance_scale):
    """`generate_video`'s final latents (B, C, F, H, W) (its callback after the last step) and its frames."""
    seen = []
    frames = generate_video(family, components, [PROMPT], BUCKET, flow=FLOW, num_inference_steps=steps,
                            guidance_scale=guidance_scale, max_sequence_length=MAX_SEQUENCE_LENGTH, seed=seed,
                            image=image, callback=lambda i, sigma, latents: seen.append(latents.clone()))
    return seen[-1], frames


def _stock(family, pipe, image, seed, steps, guidance_scale, output_type="latent"):
    noise = initial_noise(family.latent_shape(BUCKET, 1), seed=seed)
    return pipe(image=image, prompt=PROMPT, num_frames=BUCKET.num_frames, height=BUCKET.height, width=BUCKET.width,
                num_inference_steps=steps, guidance_scale=guidance_scale, max_sequence_length=MAX_SEQUENCE_LENGTH,
                generator=torch.Generator().manual_seed(seed), latents=_to_pipeline_layout(noise),
                output_type=output_type).frames


def test_the_export_is_a_cogvideox_image_to_video_pipeline_taking_32_channels(family, exported):
    components, out_dir, pipe = exported
    assert get_card("cogvideox").image_to_video
    assert json.loads((out_dir / "model_index.json").read_text())["_class_name"] == "CogVideoXImageToVideoPipeline"
    assert (pipe.transformer.config.in_channels, pipe.transformer.config.out_channels) == (32, 16)
    assert pipe.transformer.config.ofs_embed_dim is None and pipe.transformer.config.patch_size_t is None
    assert type(pipe.scheduler).__name__ == "CogVideoXDDIMScheduler"
    assert takes_image(family, components.transformer) and not takes_image(family, family.build(T2V_CFG, seed=0)
                                                                                 .transformer)
    info = inspect_model(out_dir)
    assert info.image_to_video and family.image_inputs(info) == 1
    stock = out_dir.parent / "stock"
    shutil.copytree(out_dir, stock, dirs_exist_ok=True)
    (stock / "vidray_job.yaml").unlink(missing_ok=True)  # as a stock CogVideoX-5b-I2V folder
    info = inspect_model(stock)
    assert (info.family_name, info.image_to_video, info.max_sequence_length) == ("cogvideox", True, 226)


@pytest.mark.parametrize("guidance_scale, steps", [(1.0, 2), (4.0, 4)])
def test_generate_with_an_image_gives_the_stock_pipelines_latents_for_the_same_prompt_image_and_seed(
        family, exported, guidance_scale, steps):
    components, _, pipe = exported
    image = _image()
    ours, _ = _generate_latents(family, components, image, seed=11, steps=steps, guidance_scale=guidance_scale)
    stock = _stock(family, pipe, image, seed=11, steps=steps, guidance_scale=guidance_scale)
    assert ours.shape == family.latent_shape(BUCKET, 1)
    torch.testing.assert_close(ours, _to_pipeline_layout(stock), atol=1e-5, rtol=1e-5)
    # The image's posterior is sampled from the seed: another seed, same noise, other latents.
    other = _stock(family, pipe, image, seed=12, steps=steps, guidance_scale=guidance_scale)
    assert not torch.allclose(_to_pipeline_layout(other), ours, atol=1e-4)


def test_generate_with_an_image_gives_the_stock_pipelines_frames(family, exported):
    components, _, pipe = exported
    image = _image(seed=3)
    _, frames = _generate_latents(family, components, image, seed=4, steps=2, guidance_scale=1.0)
    stock = _stock(family, pipe, image, seed=4, steps=2, guidance_scale=1.0, output_type="np")
    assert frames.shape == (1, *BUCKET, 3) and stock.shape == frames.shape
    assert np.abs(frames.astype(int) - (stock * 255).round().astype(int)).max() <= 1


def test_the_image_latents_are_the_pipelines_first_frame_sample_then_zeros(family, exported):
    components, _, pipe = exported
    image = _image(seed=5)
    pixels = pipe.video_processor.preprocess(image, height=BUCKET.height, width=BUCKET.width)
    assert torch.equal(preprocess_image(image, BUCKET), pixels)  # LANCZOS resize to the bucket, then [-1, 1]
    assert torch.equal(preprocess_image(np.asarray(image), BUCKET), pixels)  # a uint8 array is its PIL image
    ours = family.condition(components.transformer, encoders=components, image=image, bucket=BUCKET,
                            generator=torch.Generator().manual_seed(9)).inpaint_latents
    _, stock = pipe.prepare_latents(pixels, 1, 16, BUCKET.num_frames, BUCKET.height, BUCKET.width, torch.float32,
                                    torch.device("cpu"), torch.Generator().manual_seed(9))
    assert ours.shape == (1, 16, 3, 4, 4) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, _to_pipeline_layout(stock), atol=1e-6, rtol=1e-6)
    assert ours[:, :, 1:].abs().sum() == 0 and ours[:, :, 0].abs().sum() > 0
    # Without a generator: the posterior mode times scaling_factor (what training caches), not a sample.
    mode = family.condition(components.transformer, encoders=components, image=image, bucket=BUCKET).inpaint_latents
    with torch.no_grad():
        expected = components.vae.encode(pixels.unsqueeze(2)).latent_dist.mode() * components.vae.config.scaling_factor
    torch.testing.assert_close(mode[:, :, :1], expected)
    assert not torch.allclose(mode, ours)
    with pytest.raises(ValueError, match="first frame only"):
        family.condition(components.transformer, encoders=components, image=image, last_image=image, bucket=BUCKET)


def test_a_training_clip_is_conditioned_on_its_own_first_frame_and_dropout_gives_zeros(family, exported):
    components, _, _ = exported
    video = torch.rand(2, 3, *BUCKET, generator=torch.Generator().manual_seed(0)) * 2 - 1
    condition = clip_condition(family, CFG, components, video, "first").inpaint_latents
    assert condition.shape == family.latent_shape(BUCKET, 2) and condition[:, :, 1:].abs().sum() == 0
    as_image = family.condition(components.transformer, encoders=components, image=(video[1, :, 0] + 1) / 2,
                                bucket=BUCKET).inpaint_latents  # the same frame
    torch.testing.assert_close(condition[1:], as_image, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="set model.i2v.condition: first"):
        clip_condition(family, CFG, components, video, "first_last")
    empty = family.condition(components.transformer, latent_shape=family.latent_shape(BUCKET, 2)).inpaint_latents
    assert empty.shape == condition.shape and empty.abs().sum() == 0
    # The training loss: the condition reaches the transformer; dropout (almost) 1 trains on zeros instead, and
    # equals the loss of the empty condition given outright.
    latents = family.encode_video(components.vae, video)
    embeds, mask = family.encode_prompt(components.text_encoder, components.tokenizer, [PROMPT, "waves"],
                                        max_sequence_length=MAX_SEQUENCE_LENGTH)
    transformer = family.load_diffusion_models(CFG, seed=0).transformer

    def loss(inpaint_latents, dropout):
        return flow_matching_step_loss(family, transformer, latents, embeds, mask, FLOW,
                                       torch.Generator().manual_seed(0), inpaint_latents=inpaint_latents,
                                       condition_dropout=dropout).item()

    kept, dropped, zeros = loss(condition, 0.0), loss(condition, 0.999999), loss(empty, 0.0)
    assert kept != dropped and dropped == zeros


def test_predict_concatenates_the_image_latents_after_the_noisy_latents_on_channels(family, exported):
    components, _, _ = exported
    transformer = components.transformer.eval()
    g = torch.Generator().manual_seed(0)
    latents, image_latents = torch.randn(1, 16, 3, 4, 4, generator=g), torch.randn(1, 16, 3, 4, 4, generator=g)
    embeds = torch.randn(1, 4, 64, generator=g)
    mask = torch.ones(1, 4, dtype=torch.bool)
    with torch.no_grad():
        ours = family.predict(transformer, latents, torch.tensor([500.0]), embeds, mask, inpaint_latents=image_latents)
        direct = transformer(hidden_states=torch.cat([latents, image_latents], dim=1).permute(0, 2, 1, 3, 4),
                             encoder_hidden_states=embeds, timestep=torch.tensor([500]), return_dict=False,
                             image_rotary_emb=__import__("vidray.models.cogvideox", fromlist=["x"])
                             .rotary_positional_embeddings(transformer, 3, 4, 4, "cpu"))[0]
    torch.testing.assert_close(ours, direct.permute(0, 2, 1, 3, 4))
    with pytest.raises(ValueError, match="pass inpaint_latents"):
        family.predict(transformer, latents, torch.tensor([500.0]), embeds, mask)
    with pytest.raises(ValueError, match=r"inpaint_latents must be \(1, 16, 3, 4, 4\)"):
        family.predict(transformer, latents, torch.tensor([500.0]), embeds, mask, inpaint_latents=image_latents[:, :8])
    t2v = family.load_diffusion_models(T2V_CFG, seed=0).transformer
    with pytest.raises(ValueError, match="text-to-video transformer: it takes no image"):
        family.predict(t2v, latents, torch.tensor([500.0]), embeds, mask, inpaint_latents=image_latents)


def test_learned_positional_embeddings_as_cogvideox_5b_i2v_sample_as_the_stock_pipeline_at_their_size(
        family, exported):
    components, _, _ = exported
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        transformer = CogVideoXTransformer3DModel(**TINY_I2V_TRANSFORMER, text_embed_dim=64,
                                                  max_text_seq_length=MAX_SEQUENCE_LENGTH,
                                                  use_learned_positional_embeddings=True).eval()
    learned = dataclasses.replace(components, transformer=transformer)
    pipe = CogVideoXImageToVideoPipeline(tokenizer=learned.tokenizer, text_encoder=learned.text_encoder,
                                         vae=learned.vae, transformer=transformer,
                                         scheduler=CogVideoXDDIMScheduler(**SCHEDULER_CONFIG))
    pipe.set_progress_bar_config(disable=True)
    image = _image(seed=7)
    ours, _ = _generate_latents(family, learned, image, seed=2, steps=2, guidance_scale=1.0)
    stock = _stock(family, pipe, image, seed=2, steps=2, guidance_scale=1.0)
    torch.testing.assert_close(ours, _to_pipeline_layout(stock), atol=1e-5, rtol=1e-5)
    assert family.no_grad_parameter_names(transformer) == []
    big = torch.zeros(1, 16, 3, 6, 6)
    with pytest.raises(ValueError, match="for 32x32 videos only, got 48x48"):
        family.predict(transformer, big, torch.tensor([1.0]), torch.zeros(1, 16, 64), torch.ones(1, 16, dtype=bool),
                       inpaint_latents=big)
    with pytest.raises(ValueError, match="learned positions.*set model.max_sequence_length: 16"):
        family.predict(transformer, big[..., :4, :4], torch.tensor([1.0]), torch.zeros(1, 4, 64),
                       torch.ones(1, 4, dtype=bool), inpaint_latents=big[..., :4, :4])


@pytest.mark.slow
def test_pretrained_i2v_folder_loads_and_a_task_mismatch_is_one_line_naming_the_folder(family, exported, tmp_path):
    components, out_dir, _ = exported
    cfg = dataclasses.replace(CFG, init="pretrained", pretrained_path=str(out_dir))
    loaded = family.build(cfg, seed=123)
    saved = components.transformer.state_dict()
    assert all(torch.equal(saved[k], v) for k, v in loaded.transformer.state_dict().items())
    alone = family.load_diffusion_models(cfg, seed=123).transformer.state_dict()
    assert all(torch.equal(saved[k], v) for k, v in alone.items())
    assert all(torch.equal(family.load_latent_models(cfg, seed=1).vae.state_dict()[k], v)
               for k, v in loaded.vae.state_dict().items())
    assert family.build_encoders(cfg, seed=1).text_encoder is not None
    assert load_pipeline_folder(family, out_dir).transformer.config.in_channels == 32
    t2v_dir = family.save_pipeline(family.build(T2V_CFG, seed=0), tmp_path / "t2v", FLOW)
    with pytest.raises(ValueError, match=f"'{t2v_dir}' holds a CogVideoX text-to-video model .* but model.i2v is set"
                       ) as err:
        family.load_diffusion_models(dataclasses.replace(cfg, pretrained_path=str(t2v_dir)), seed=0).transformer
    assert "\n" not in str(err.value)
    t2v_cfg = dataclasses.replace(T2V_CFG, init="pretrained", pretrained_path=str(out_dir))
    for build in (family.build, family.load_diffusion_models, family.build_encoders, family.load_latent_models):
        with pytest.raises(ValueError, match=f"'{out_dir}' holds a CogVideoX image-to-video model .* model.i2v is "
                                             "null: set model.i2v"):
            build(t2v_cfg, seed=0)
    with pytest.raises(ValueError, match="set model.i2v.condition: first"):
        family.load_diffusion_models(dataclasses.replace(CFG, i2v=I2VConfig(condition="first_last")), seed=0)
    mixed = tmp_path / "mixed"
    shutil.copytree(t2v_dir, mixed)
    index = json.loads((mixed / "model_index.json").read_text())
    (mixed / "model_index.json").write_text(json.dumps({**index, "_class_name": "CogVideoXImageToVideoPipeline"}))
    with pytest.raises(ValueError, match="holds a CogVideoXImageToVideoPipeline whose transformer has in_channels 16"):
        load_pipeline_folder(family, mixed)


def test_the_shipped_cogvideox_i2v_config_builds_the_image_to_video_model_for_its_buckets(family):
    from pathlib import Path

    from vidray.config import load_job_config

    job = load_job_config(Path(__file__).resolve().parents[2] / "jobs" / "configs" / "cogvideox_i2v_tiny.yaml")
    assert (job.model.family, job.model.i2v.condition) == ("cogvideox", "first")
    transformer = family.load_diffusion_models(job.model, seed=job.train.seed).transformer
    assert takes_image(family, transformer)
    for bucket in job.data.buckets:
        assert 2 * family.latent_shape(bucket, 1)[1] == transformer.config.in_channels
    components = Components(transformer=transformer, **vars(family.build_encoders(job.model, seed=job.train.seed)))
    frames = generate_video(family, components, [PROMPT], Bucket(*job.data.buckets[0]), flow=job.flow,
                            num_inference_steps=1, max_sequence_length=job.model.max_sequence_length,
                            image=_image(seed=1))
    assert frames.shape == (1, *job.data.buckets[0], 3)


def test_vidray_generate_samples_the_export_from_an_image_file_and_refuses_a_last_image_in_one_line(
        family, exported, tmp_path):
    from vidray.errors import UserError
    from vidray.generate import generate_to_file

    _, out_dir, _ = exported
    first = tmp_path / "first.png"
    _image(seed=8).save(first)
    video = generate_to_file(out_dir, PROMPT, tmp_path / "out.mp4", bucket=BUCKET, num_inference_steps=1,
                             image=first)
    assert video.is_file() and video.stat().st_size > 0
    with pytest.raises(UserError, match="first frame only .*drop --last-image") as err:
        generate_to_file(out_dir, PROMPT, tmp_path / "last.mp4", bucket=BUCKET, num_inference_steps=1, image=first,
                         last_image=first)
    assert "\n" not in str(err.value)
