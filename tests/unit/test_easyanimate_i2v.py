"""EasyAnimate image-to-video (InP) against the stock `diffusers.EasyAnimateInpaintPipeline` (issue 29 part 1), on
CPU in fp32.

Parity: the export of a `model.i2v` tiny model loads in the stock inpaint pipeline offline, and for the same prompt
embeddings, first-frame image, seed, steps and guidance, the stock pipeline's `output_type="latent"` latents equal
`vidray.inference.sampler.sample_latents` over `family.condition`'s inpaint latents. The condition of a
training clip equals what the stock pipeline gives the transformer for the clip's first frame; condition dropout
gives the text-to-video input and does not depend on the batch. The stock pipeline needs
`vae.register_to_config(cache_mag_vae=True)` (AutoencoderKLMagvit drops the key on load; vidray conditions with
True, EasyAnimate V5's value).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json  # noqa: E402
import shutil  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from diffusers import EasyAnimateInpaintPipeline  # noqa: E402
from diffusers.pipelines.easyanimate.pipeline_easyanimate_inpaint import get_image_to_video_latent  # noqa: E402
from PIL import Image  # noqa: E402

from vidray.cards import all_cards  # noqa: E402
from vidray.config import ConfigError, FlowConfig, I2VConfig, ModelConfig, job_config_from_dict  # noqa: E402
from vidray.buckets import Bucket  # noqa: E402
from vidray.inference.sampler import generate_video, sample_latents  # noqa: E402
from vidray.errors import UserError  # noqa: E402
from vidray.generate import GenerateArgumentError, check_generate_args  # noqa: E402
from vidray.models import get_family  # noqa: E402
from vidray.models.base import ModelFamily  # noqa: E402
from vidray.models.export import inspect_model, load_model, write_job_file  # noqa: E402
from vidray.models.vae import frames_to_video  # noqa: E402
from vidray.train.step import condition_keep, flow_matching_step_loss, sample_generator  # noqa: E402

from tests.conftest import clip_condition, guided_prompts, takes_image  # noqa: E402

FAMILY = get_family("easyanimate")
BUCKET = Bucket(9, 32, 32)
FLOW = FlowConfig(shift=3.0, num_train_timesteps=1000)
MAX_SEQUENCE_LENGTH = 16
CFG = ModelConfig(text_encoder="tiny_random", max_sequence_length=MAX_SEQUENCE_LENGTH, i2v=I2VConfig())
T2V_CFG = ModelConfig(text_encoder="tiny_random", max_sequence_length=MAX_SEQUENCE_LENGTH)
JOB = {"name": "i2v", "model": {"text_encoder": "tiny_random", "max_sequence_length": MAX_SEQUENCE_LENGTH,
                                "i2v": {"condition": "first"}},
       "data": {"buckets": [list(BUCKET)]}, "flow": {"shift": FLOW.shift}}


def random_image(seed: int, height: int = 40, width: int = 48) -> Image.Image:
    """An RGB image of another size than the bucket's (the condition resizes it)."""
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    components = FAMILY.build(CFG, seed=0)
    out_dir = FAMILY.save_pipeline(components, tmp_path_factory.mktemp("export") / "diffusers", FLOW)
    write_job_file(out_dir, job_config_from_dict(JOB))
    pipe = EasyAnimateInpaintPipeline.from_pretrained(out_dir, local_files_only=True)
    pipe.vae.register_to_config(cache_mag_vae=True)  # dropped on load; the pipeline's resize_mask reads it
    pipe.set_progress_bar_config(disable=True)
    return components, out_dir, pipe


@pytest.fixture(scope="module")
def prompts(exported):
    return guided_prompts(FAMILY, exported[0], MAX_SEQUENCE_LENGTH)


def test_the_i2v_tiny_preset_is_an_inpaint_transformer_exported_as_the_stock_inpaint_pipeline(exported):
    components, out_dir, pipe = exported
    config = components.transformer.config
    assert config.in_channels == 16 + 1 + 16 and config.out_channels == 16  # latents + mask + masked video
    assert config.resize_inpaint_mask_directly and not config.add_noise_in_inpaint_model
    assert takes_image(FAMILY, components.transformer)
    assert not takes_image(FAMILY, FAMILY.load_diffusion_models(T2V_CFG, seed=0).transformer)
    assert json.loads((out_dir / "model_index.json").read_text())["_class_name"] == "EasyAnimateInpaintPipeline"
    assert type(pipe.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler" and pipe.scheduler.config.shift == 3.0
    # the transformer alone equals the whole build's
    alone = FAMILY.load_diffusion_models(CFG, seed=0).transformer.state_dict()
    assert all(torch.equal(value, components.transformer.state_dict()[key]) for key, value in alone.items())


@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
def test_stock_inpaint_pipeline_latents_equal_sample_latents_for_the_same_first_frame(exported, prompts,
                                                                                     guidance_scale):
    components, _, pipe = exported
    embeds, mask, negative, negative_mask = prompts
    image = random_image(0)
    condition = FAMILY.condition(components.transformer, encoders=components, image=image, bucket=BUCKET,
                                 latent_shape=FAMILY.latent_shape(BUCKET, 2))
    ours = sample_latents(
        FAMILY, components.transformer, embeds, mask, latent_shape=FAMILY.latent_shape(BUCKET, 2),
        num_inference_steps=3, shift=FLOW.shift, num_train_timesteps=FLOW.num_train_timesteps,
        guidance_scale=guidance_scale, negative_prompt_embeds=negative, negative_prompt_attention_mask=negative_mask,
        generator=torch.Generator().manual_seed(5), **condition.predict_kwargs(),
    )
    video, mask_video = get_image_to_video_latent([image], None, BUCKET.num_frames, (BUCKET.height, BUCKET.width))
    stock = pipe(
        prompt_embeds=embeds, prompt_attention_mask=mask, negative_prompt_embeds=negative,
        negative_prompt_attention_mask=negative_mask, video=video.repeat(2, 1, 1, 1, 1),
        mask_video=mask_video.repeat(2, 1, 1, 1, 1), num_frames=BUCKET.num_frames, height=BUCKET.height,
        width=BUCKET.width, num_inference_steps=3, guidance_scale=guidance_scale,
        generator=torch.Generator().manual_seed(5), output_type="latent",
    ).frames
    assert ours.shape == stock.shape == FAMILY.latent_shape(BUCKET, 2)
    torch.testing.assert_close(ours, stock, atol=1e-5, rtol=1e-5)


def test_first_and_last_image_and_no_image_also_match_the_stock_pipeline(exported, prompts):
    components, _, pipe = exported
    embeds, mask = prompts[0][:1], prompts[1][:1]
    first, last = random_image(1), random_image(2, 32, 32)
    kwargs = dict(num_inference_steps=2)
    cases = {
        "first_last": (FAMILY.condition(components.transformer, encoders=components, image=first, last_image=last,
                                        bucket=BUCKET).inpaint_latents,
                       get_image_to_video_latent([first], last, BUCKET.num_frames, (BUCKET.height, BUCKET.width))),
        "text only": (FAMILY.condition(components.transformer, latent_shape=FAMILY.latent_shape(BUCKET, 1))
                      .inpaint_latents, (None, None)),
    }
    for name, (condition, (video, mask_video)) in cases.items():
        ours = sample_latents(
            FAMILY, components.transformer, embeds, mask, latent_shape=FAMILY.latent_shape(BUCKET, 1),
            num_inference_steps=kwargs["num_inference_steps"], shift=FLOW.shift,
            num_train_timesteps=FLOW.num_train_timesteps, generator=torch.Generator().manual_seed(7),
            inpaint_latents=condition,
        )
        stock = pipe(prompt_embeds=embeds, prompt_attention_mask=mask, video=video, mask_video=mask_video,
                     num_frames=BUCKET.num_frames, height=BUCKET.height, width=BUCKET.width,
                     num_inference_steps=kwargs["num_inference_steps"], guidance_scale=1.0,
                     generator=torch.Generator().manual_seed(7), output_type="latent").frames
        torch.testing.assert_close(ours, stock, atol=1e-5, rtol=1e-5, msg=name)


def stock_inpaint_latents(pipe, image, last_image=None) -> torch.Tensor:
    """The `inpaint_latents` the stock pipeline hands its transformer for `image` (one step, no guidance)."""
    seen = []
    forward = pipe.transformer.forward

    def record(*args, **kwargs):
        seen.append(kwargs["inpaint_latents"].clone())
        return forward(*args, **kwargs)

    pipe.transformer.forward = record
    try:
        video, mask_video = get_image_to_video_latent([image], last_image, BUCKET.num_frames,
                                                      (BUCKET.height, BUCKET.width))
        pipe(prompt_embeds=torch.zeros(1, 4, pipe.transformer.config.text_embed_dim),
             prompt_attention_mask=torch.ones(1, 4, dtype=torch.bool), video=video, mask_video=mask_video,
             num_frames=BUCKET.num_frames, height=BUCKET.height, width=BUCKET.width, num_inference_steps=1,
             guidance_scale=1.0, output_type="latent")
    finally:
        pipe.transformer.forward = forward
    return seen[0]


@pytest.mark.parametrize("condition", ["first", "first_last"])
def test_the_condition_of_a_training_clip_equals_the_pipelines_for_its_first_frame(exported, condition):
    components, _, pipe = exported
    frames = np.random.RandomState(3).randint(0, 256, (1, *BUCKET, 3), dtype=np.uint8)  # (1, F, H, W, 3)
    ours = clip_condition(FAMILY, CFG, components, frames_to_video(frames), condition).inpaint_latents
    last = Image.fromarray(frames[0, -1]) if condition == "first_last" else None
    stock = stock_inpaint_latents(pipe, Image.fromarray(frames[0, 0]), last)
    assert ours.shape == stock.shape == (1, 17, 3, 4, 4) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, stock, atol=1e-5, rtol=1e-5)
    assert ours[:, 0, 0].abs().min() > 0 and ours[:, 0, 1:-1].abs().max() == 0  # mask: first latent frame given


class RecordingFamily:
    """The EasyAnimate family, recording the inpaint_latents each `predict` gets."""

    def __init__(self):
        self.seen = []

    def __getattr__(self, name):
        return getattr(FAMILY, name)

    def predict(self, *args, **kwargs):
        self.seen.append(kwargs["inpaint_latents"].clone())
        return FAMILY.predict(*args, **kwargs)


def test_condition_dropout_gives_the_t2v_input_and_each_samples_draw_ignores_the_batch(exported):
    components, _, _ = exported
    keys = list(range(100, 108))
    latent_shape = FAMILY.latent_shape(BUCKET, len(keys))
    latents = torch.randn(latent_shape, generator=torch.Generator().manual_seed(0))
    condition = torch.randn(latent_shape[0], 17, *latent_shape[2:], generator=torch.Generator().manual_seed(1))
    embeds = torch.randn(len(keys), 4, components.transformer.config.text_embed_dim)
    mask = torch.ones(len(keys), 4, dtype=torch.bool)

    def step(indices):
        family = RecordingFamily()
        generators = [sample_generator(0, 3, keys[i]) for i in indices]
        flow_matching_step_loss(family, components.transformer, latents[indices], embeds[indices], mask[indices],
                                FLOW, generators, inpaint_latents=condition[indices], condition_dropout=0.5)
        return family.seen[0]

    whole = step(list(range(len(keys))))
    kept = [bool(torch.equal(whole[i], condition[i])) for i in range(len(keys))]
    dropped = [bool(whole[i].abs().max() == 0) for i in range(len(keys))]
    assert all(k != d for k, d in zip(kept, dropped)) and any(kept) and any(dropped)
    empty = FAMILY.condition(components.transformer, latent_shape=latent_shape)
    assert empty.image_embeds is None and torch.equal(whole[dropped.index(True)], empty.inpaint_latents[0])
    part = step([6, 2, 5])  # another batch (another worker count): the same samples keep or drop the same way
    assert [bool(torch.equal(part[j], condition[i])) for j, i in enumerate([6, 2, 5])] == [kept[6], kept[2], kept[5]]
    assert condition_keep([sample_generator(0, 3, k) for k in keys], len(keys), 0.0).all()


def test_load_model_and_inspect_say_the_export_takes_an_image_and_generate_uses_it(exported):
    components, out_dir, _ = exported
    info = inspect_model(out_dir)
    assert info.image_to_video and FAMILY.image_inputs(info) == 1
    loaded = load_model(out_dir)
    assert takes_image(FAMILY, loaded.components.transformer)
    part = load_model(out_dir, components=("transformer",)).components.transformer
    assert takes_image(FAMILY, part)
    kwargs = dict(flow=FLOW, num_inference_steps=2, max_sequence_length=MAX_SEQUENCE_LENGTH, seed=3)
    with_image = generate_video(FAMILY, loaded.components, ["a cat"], BUCKET, image=random_image(4), **kwargs)
    without = generate_video(FAMILY, loaded.components, ["a cat"], BUCKET, **kwargs)
    assert with_image.shape == without.shape == (1, *BUCKET, 3) and not np.array_equal(with_image, without)


def test_a_stock_inpaint_folder_without_job_file_loads_as_image_to_video(exported, tmp_path):
    _, out_dir, _ = exported
    stock = shutil.copytree(out_dir, tmp_path / "stock")
    (stock / "vidray_job.yaml").unlink()
    info = inspect_model(stock)
    assert info.job is None and info.image_to_video and FAMILY.image_inputs(info) == 1
    assert takes_image(FAMILY, load_model(stock, components=("transformer",)).components.transformer)
    whole = load_model(stock).components
    for name in ("vae", "text_encoder"):  # what the encode and text stages load, through the inpaint class
        part = getattr(load_model(stock, components=(name,)).components, name)
        assert all(torch.equal(v, getattr(whole, name).state_dict()[k]) for k, v in part.state_dict().items())


def test_a_t2v_folder_for_an_i2v_config_and_the_reverse_fail_in_one_line(exported, tmp_path):
    _, i2v_dir, _ = exported
    t2v_dir = FAMILY.save_pipeline(FAMILY.build(T2V_CFG, seed=0), tmp_path / "t2v", FLOW)
    assert json.loads((t2v_dir / "model_index.json").read_text())["_class_name"] == "EasyAnimatePipeline"
    assert not inspect_model(t2v_dir).image_to_video
    cases = [(t2v_dir, I2VConfig(), "holds a text-to-video transformer .* but model.i2v is set"),
             (i2v_dir, None, "holds an image-to-video .* but model.i2v is null")]
    for folder, i2v, message in cases:
        cfg = ModelConfig(init="pretrained", pretrained_path=str(folder), i2v=i2v)
        for build in (FAMILY.build, FAMILY.load_diffusion_models):
            with pytest.raises(ValueError, match=message) as err:
                build(cfg, seed=0)
            assert "\n" not in str(err.value)


def test_an_image_for_a_t2v_model_and_a_bad_condition_dropout_fail_in_one_line(exported, tmp_path):
    t2v_dir = FAMILY.save_pipeline(FAMILY.build(T2V_CFG, seed=0), tmp_path / "t2v", FLOW)
    write_job_file(t2v_dir, job_config_from_dict({**JOB, "model": {**JOB["model"], "i2v": None}}))
    image = tmp_path / "first.png"
    random_image(5).save(image)
    with pytest.raises(GenerateArgumentError, match="is text-to-video and takes no image; drop --image") as err:
        check_generate_args(t2v_dir, "a cat", tmp_path / "out.mp4", image=image)
    assert "\n" not in str(err.value)
    with pytest.raises(GenerateArgumentError, match="--image .* is not a file"):
        check_generate_args(exported[1], "a cat", tmp_path / "out.mp4", image=tmp_path / "missing.png")
    (tmp_path / "clip.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 not an image")  # refused before weights load
    with pytest.raises(GenerateArgumentError, match="--image .*clip.mp4 is not an image PIL can read"):
        check_generate_args(exported[1], "a cat", tmp_path / "out.mp4", image=tmp_path / "clip.mp4")
    check_generate_args(exported[1], "a cat", tmp_path / "out.mp4", image=image)  # an i2v model takes it
    t2v = load_model(t2v_dir)
    with pytest.raises(UserError, match="text-to-video and takes no image"):
        generate_video(FAMILY, t2v.components, ["a cat"], BUCKET, flow=FLOW, num_inference_steps=1,
                       max_sequence_length=MAX_SEQUENCE_LENGTH, image=random_image(5))
    for dropout in (1.0, -0.1):
        with pytest.raises(ConfigError, match=r"model.i2v.condition_dropout must be in \[0, 1\)") as err:
            job_config_from_dict({**JOB, "model": {**JOB["model"], "i2v": {"condition_dropout": dropout}}})
        assert "\n" not in str(err.value)
    # A family with no image-to-video model, when one is registered (easyanimate, wan and cogvideox all have one).
    for t2v_only in sorted(card.name for card in all_cards() if not card.image_to_video)[:1]:
        with pytest.raises(ConfigError, match=f"model.i2v is set but model.family {t2v_only} has no image-to-video"):
            job_config_from_dict({"model": {"family": t2v_only, "i2v": {}}})
    assert ModelFamily.condition(FAMILY, CFG, clip=torch.zeros(1, 3, 1, 16, 16)) is None  # the default: no I2V
    assert FAMILY.condition(T2V_CFG, clip=torch.zeros(1, 3, 1, 16, 16)) is None  # a T2V model: no condition
    with pytest.raises(ValueError, match=r"needs the job's model config \(model.i2v.condition\)"):
        FAMILY.condition(FAMILY.load_diffusion_models(CFG, seed=0).transformer, clip=torch.zeros(1, 3, 1, 16, 16))
    with pytest.raises(ValueError, match=r"condition_dropout must be in \[0, 1\)"):
        condition_keep(torch.Generator(), 2, 1.0)


def test_changing_model_i2v_on_resume_is_a_fixed_key_change():
    from vidray.config import diff_for_resume

    t2v = job_config_from_dict({**JOB, "model": {**JOB["model"], "i2v": None}})
    for saved, resumed in ((t2v, job_config_from_dict(JOB)), (job_config_from_dict(JOB), t2v),
                           (job_config_from_dict(JOB), job_config_from_dict(
                               {**JOB, "model": {**JOB["model"], "i2v": {"condition_dropout": 0.3}}}))):
        diff = diff_for_resume(saved.to_dict(), resumed)
        assert list(diff.fixed) == ["model.i2v"] and not diff.changeable


def test_an_i2v_export_is_served_and_its_spec_takes_an_image(exported, tmp_path, monkeypatch):
    """`serve run` of an image-to-video export builds, and its model spec accepts `input_reference` (the stages:
    tests/unit/test_serve_i2v.py; over HTTP: tests/integration/test_serve.py)."""
    from vidray.serve.app import ServeSettings, build_app, model_spec

    _, out_dir, _ = exported
    monkeypatch.setenv("VIDRAY_API_TOKEN", "a-token-of-at-least-16-chars")
    settings = {"model_path": str(out_dir), "store_dir": str(tmp_path / "store"), "store_on": "replica"}
    assert build_app(settings) is not None
    assert model_spec(ServeSettings(**settings), inspect_model(out_dir)).supports_image_to_video


def test_the_training_probe_and_the_frozen_parameters_of_an_inpaint_transformer():
    """The loop's set-up probes the transformer (`no_grad_parameter_names`, PowerSGD's `prime_buckets`) as
    `predict` calls it: 16 noisy latent channels plus 17 of inpaint latents, not 33 noisy ones. The unused
    text-stream outputs of the last block are found as in the text-to-video model."""
    transformer = FAMILY.load_diffusion_models(CFG, seed=0).transformer
    assert takes_image(FAMILY, transformer)
    assert torch.isfinite(FAMILY.probe_loss(transformer, transformer))
    frozen = FAMILY.no_grad_parameter_names(transformer)
    t2v_frozen = FAMILY.no_grad_parameter_names(FAMILY.load_diffusion_models(T2V_CFG, seed=0).transformer)
    assert frozen == t2v_frozen and frozen
