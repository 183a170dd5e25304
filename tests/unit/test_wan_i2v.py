"""Wan image-to-video (Wan 2.2 A14B's layout: no CLIP image embeddings) and Wan 2.2's two experts against the stock
`diffusers.WanImageToVideoPipeline` / `WanPipeline` (issue 29 part 2), on CPU in fp32.

Parity: the export of a `model.i2v` tiny Wan model loads in the stock image-to-video pipeline offline, and for the
same prompt embeddings, first (and last) image, seed, steps and guidance, the stock pipeline's `output_type="latent"`
latents equal `vidray.inference.sampler.sample_latents` over `family.condition`'s condition. The
condition of a training clip equals the stock pipeline's for the clip's own first (and last) frame.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import dataclasses  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from diffusers import WanImageToVideoPipeline  # noqa: E402
from PIL import Image  # noqa: E402

from vidray.config import (ConfigError, ExpertsConfig, FlowConfig, I2VConfig, ModelConfig,  # noqa: E402
                           job_config_from_dict)
from vidray.buckets import Bucket  # noqa: E402
from vidray.inference.sampler import generate_video, sample_latents  # noqa: E402
from vidray.models import get_family  # noqa: E402
from vidray.models.experts import TwoExperts  # noqa: E402
from vidray.models.export import inspect_model, load_model, write_job_file  # noqa: E402
from vidray.models.vae import frames_to_video  # noqa: E402
from vidray.train.step import flow_matching_step_loss, sample_generator  # noqa: E402
from vidray.models.export import load_pipeline_folder

from tests.conftest import clip_condition, guided_prompts, takes_image  # noqa: E402

FAMILY = get_family("wan")
BUCKET = Bucket(9, 32, 32)
FLOW = FlowConfig(shift=3.0, num_train_timesteps=1000)
MAX_SEQUENCE_LENGTH = 16
CFG = ModelConfig(family="wan", text_encoder="tiny_random", max_sequence_length=MAX_SEQUENCE_LENGTH, i2v=I2VConfig())
T2V_CFG = ModelConfig(family="wan", text_encoder="tiny_random", max_sequence_length=MAX_SEQUENCE_LENGTH)
JOB = {"name": "wan-i2v", "model": {"family": "wan", "text_encoder": "tiny_random",
                                    "max_sequence_length": MAX_SEQUENCE_LENGTH, "i2v": {"condition": "first"}},
       "data": {"buckets": [list(BUCKET)]}, "flow": {"shift": FLOW.shift}}


def random_image(seed: int, height: int = 40, width: int = 48) -> Image.Image:
    """An RGB image of another size than the bucket's (the condition resizes it)."""
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    components = FAMILY.build(CFG, seed=0)
    out_dir = FAMILY.save_pipeline(components, tmp_path_factory.mktemp("export") / "diffusers", FLOW)
    write_job_file(out_dir, job_config_from_dict(JOB))
    pipe = WanImageToVideoPipeline.from_pretrained(out_dir, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return components, out_dir, pipe


@pytest.fixture(scope="module")
def prompts(exported):
    return guided_prompts(FAMILY, exported[0], MAX_SEQUENCE_LENGTH)


def test_the_i2v_tiny_preset_takes_the_condition_and_exports_the_stock_i2v_pipeline(exported):
    components, out_dir, pipe = exported
    config = components.transformer.config
    assert config.in_channels == 16 + 4 + 16 and config.out_channels == 16 and config.image_dim is None
    assert takes_image(FAMILY, components.transformer)
    assert not takes_image(FAMILY, FAMILY.load_diffusion_models(T2V_CFG, seed=0).transformer)
    index = json.loads((out_dir / "model_index.json").read_text())
    assert index["_class_name"] == "WanImageToVideoPipeline" and index["image_encoder"] == [None, None]
    assert index["transformer_2"] == [None, None] and pipe.config.boundary_ratio is None
    # the transformer alone equals the whole build's
    alone = FAMILY.load_diffusion_models(CFG, seed=0).transformer.state_dict()
    assert all(torch.equal(value, components.transformer.state_dict()[key]) for key, value in alone.items())
    assert FAMILY.no_grad_parameter_names(components.transformer) == []


@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
def test_stock_i2v_pipeline_latents_equal_sample_latents_for_the_same_first_frame(exported, prompts, guidance_scale):
    components, _, pipe = exported
    embeds, mask, negative, negative_mask = prompts
    image = random_image(0)
    condition = FAMILY.condition(components.transformer, encoders=components, image=image, bucket=BUCKET,
                                 latent_shape=FAMILY.latent_shape(BUCKET, 2)).inpaint_latents
    ours = sample_latents(
        FAMILY, components.transformer, embeds, mask, latent_shape=FAMILY.latent_shape(BUCKET, 2),
        num_inference_steps=3, shift=FLOW.shift, num_train_timesteps=FLOW.num_train_timesteps,
        guidance_scale=guidance_scale, negative_prompt_embeds=negative, negative_prompt_attention_mask=negative_mask,
        generator=torch.Generator().manual_seed(5), inpaint_latents=condition,
    )
    stock = pipe(
        image=image, prompt_embeds=embeds, negative_prompt_embeds=negative, num_frames=BUCKET.num_frames,
        height=BUCKET.height, width=BUCKET.width, num_inference_steps=3, guidance_scale=guidance_scale,
        generator=torch.Generator().manual_seed(5), output_type="latent",
    ).frames
    assert ours.shape == stock.shape == FAMILY.latent_shape(BUCKET, 2)
    torch.testing.assert_close(ours, stock, atol=1e-5, rtol=1e-5)


def test_a_first_and_last_image_also_match_the_stock_pipeline(exported, prompts):
    components, _, pipe = exported
    embeds, mask = prompts[0][:1], prompts[1][:1]
    first, last = random_image(1), random_image(2, 32, 32)
    condition = FAMILY.condition(components.transformer, encoders=components, image=first, last_image=last,
                                 bucket=BUCKET).inpaint_latents
    ours = sample_latents(FAMILY, components.transformer, embeds, mask, latent_shape=FAMILY.latent_shape(BUCKET, 1),
                          num_inference_steps=2, shift=FLOW.shift, num_train_timesteps=FLOW.num_train_timesteps,
                          generator=torch.Generator().manual_seed(7), inpaint_latents=condition)
    stock = pipe(image=first, last_image=last, prompt_embeds=embeds, num_frames=BUCKET.num_frames,
                 height=BUCKET.height, width=BUCKET.width, num_inference_steps=2, guidance_scale=1.0,
                 generator=torch.Generator().manual_seed(7), output_type="latent").frames
    torch.testing.assert_close(ours, stock, atol=1e-5, rtol=1e-5)


def stock_condition(pipe, image, last_image=None) -> torch.Tensor:
    """The condition the stock pipeline concatenates to the latents for `image` (and `last_image`):
    `prepare_latents`' second output, for the bucket."""
    def preprocess(picture):
        return pipe.video_processor.preprocess(picture, height=BUCKET.height, width=BUCKET.width).float()

    _, condition = pipe.prepare_latents(
        preprocess(image), 1, 16, BUCKET.height, BUCKET.width, BUCKET.num_frames, torch.float32, "cpu",
        torch.Generator().manual_seed(0), None, None if last_image is None else preprocess(last_image))
    return condition


@pytest.mark.parametrize("condition", ["first", "first_last"])
def test_the_condition_of_a_training_clip_equals_the_pipelines_for_its_own_frames(exported, condition):
    components, _, pipe = exported
    frames = np.random.RandomState(3).randint(0, 256, (1, *BUCKET, 3), dtype=np.uint8)  # (1, F, H, W, 3)
    ours = clip_condition(FAMILY, CFG, components, frames_to_video(frames), condition).inpaint_latents
    last = Image.fromarray(frames[0, -1]) if condition == "first_last" else None
    stock = stock_condition(pipe, Image.fromarray(frames[0, 0]), last)
    assert ours.shape == stock.shape == (1, 20, 3, 4, 4) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, stock, atol=1e-5, rtol=1e-5)
    given_last = float(condition == "first_last")
    assert ours[:, :4, 0].min() == 1 and ours[:, :4, 1].max() == 0  # the mask: the first frame's 4 channels
    assert bool((ours[:, :4, 2, ...] == torch.tensor([0, 0, 0, given_last]).view(1, 4, 1, 1)).all())


def test_empty_condition_is_zeros_and_predict_refuses_a_missing_or_stray_condition(exported):
    components, _, _ = exported
    shape = FAMILY.latent_shape(BUCKET, 2)
    empty = FAMILY.condition(components.transformer, latent_shape=shape).inpaint_latents
    assert empty.shape == (2, 20, *shape[2:]) and empty.abs().max() == 0
    latents, timesteps = torch.zeros(shape), torch.full((2,), 500.0)
    embeds, mask = torch.zeros(2, 4, components.transformer.config.text_dim), torch.ones(2, 4, dtype=torch.bool)
    assert FAMILY.predict(components.transformer, latents, timesteps, embeds, mask,
                          inpaint_latents=empty).shape == shape
    with pytest.raises(ValueError, match=r"needs its condition inpaint_latents \(2, 20, 3, 4, 4\), got None"):
        FAMILY.predict(components.transformer, latents, timesteps, embeds, mask)
    t2v = FAMILY.load_diffusion_models(T2V_CFG, seed=0).transformer
    with pytest.raises(ValueError, match="a text-to-video transformer takes no inpaint_latents"):
        FAMILY.predict(t2v, latents, timesteps, embeds, mask, inpaint_latents=empty)


def test_the_export_loads_as_image_to_video_and_generate_uses_the_image(exported, tmp_path):
    components, out_dir, _ = exported
    info = inspect_model(out_dir)
    assert info.image_to_video and FAMILY.image_inputs(info) == 1
    loaded = load_model(out_dir)
    assert takes_image(FAMILY, loaded.components.transformer)
    kwargs = dict(flow=FLOW, num_inference_steps=2, max_sequence_length=MAX_SEQUENCE_LENGTH, seed=3)
    with_image = generate_video(FAMILY, loaded.components, ["a cat"], BUCKET, image=random_image(4), **kwargs)
    without = generate_video(FAMILY, loaded.components, ["a cat"], BUCKET, **kwargs)
    assert with_image.shape == without.shape == (1, *BUCKET, 3) and not np.array_equal(with_image, without)
    stock = shutil.copytree(out_dir, tmp_path / "stock")  # a stock folder without vidray's job file
    (stock / "vidray_job.yaml").unlink()
    assert inspect_model(stock).image_to_video
    whole = load_model(stock).components
    for name in ("transformer", "vae", "text_encoder"):  # what each serve stage loads alone
        part = getattr(load_model(stock, components=(name,)).components, name)
        assert all(torch.equal(v, getattr(whole, name).state_dict()[k]) for k, v in part.state_dict().items())


def test_a_folder_of_the_other_task_or_with_a_stray_image_encoder_fails_in_one_line(exported, tmp_path):
    _, i2v_dir, _ = exported
    t2v_dir = FAMILY.save_pipeline(FAMILY.build(T2V_CFG, seed=0), tmp_path / "t2v", FLOW)
    assert json.loads((t2v_dir / "model_index.json").read_text())["_class_name"] == "WanPipeline"
    cases = [(t2v_dir, I2VConfig(), "holds a text-to-video transformer .* but model.i2v is set"),
             (i2v_dir, None, "holds an image-to-video transformer .* but model.i2v is null")]
    for folder, i2v, message in cases:
        cfg = ModelConfig(family="wan", init="pretrained", pretrained_path=str(folder), i2v=i2v)
        for build in (FAMILY.build, FAMILY.load_diffusion_models):
            with pytest.raises(ValueError, match=message) as err:
                build(cfg, seed=0)
            assert "\n" not in str(err.value)
    clip = shutil.copytree(i2v_dir, tmp_path / "wan21-i2v")
    index = json.loads((clip / "model_index.json").read_text())
    (clip / "model_index.json").write_text(json.dumps({**index, "image_encoder": ["transformers",
                                                                                  "CLIPVisionModel"]}))
    with pytest.raises(ValueError, match="has image_encoder but its transformer takes no CLIP image embeddings") \
            as err:
        FAMILY.load_diffusion_models(ModelConfig(family="wan", init="pretrained", pretrained_path=str(clip),
                                             i2v=I2VConfig()), seed=0).transformer
    assert "\n" not in str(err.value)


BOUNDARY_RATIO = 0.8
"""With shift 3 and 4 steps the timesteps are 1000, 857.7, 602.2, 8.9: two steps for each expert."""


def two_experts(cfg: ModelConfig) -> TwoExperts:
    """Two tiny experts of `cfg`'s layout drawn under seeds 0 (high noise) and 1 (low noise)."""
    return TwoExperts(FAMILY.load_diffusion_models(cfg, seed=0).transformer,
                      FAMILY.load_diffusion_models(cfg, seed=1).transformer,
                      boundary_ratio=BOUNDARY_RATIO, num_train_timesteps=FLOW.num_train_timesteps)


@pytest.fixture(scope="module")
def exported_experts(exported, tmp_path_factory):
    components, _, _ = exported
    experts = two_experts(CFG)
    out_dir = FAMILY.save_pipeline(dataclasses.replace(components, transformer=experts),
                                   tmp_path_factory.mktemp("experts") / "diffusers", FLOW)
    pipe = WanImageToVideoPipeline.from_pretrained(out_dir, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return dataclasses.replace(components, transformer=experts), out_dir, pipe


def test_two_experts_export_as_the_stock_pipelines_transformer_and_transformer_2_with_the_boundary(exported_experts):
    components, out_dir, pipe = exported_experts
    index = json.loads((out_dir / "model_index.json").read_text())
    assert index["_class_name"] == "WanImageToVideoPipeline" and index["boundary_ratio"] == BOUNDARY_RATIO
    assert index["transformer_2"] == ["diffusers", "WanTransformer3DModel"]
    for ours, theirs in ((components.transformer.transformer, pipe.transformer),
                         (components.transformer.transformer_2, pipe.transformer_2)):
        assert all(torch.equal(v, theirs.state_dict()[k]) for k, v in ours.state_dict().items())
    loaded = load_model(out_dir)
    assert isinstance(loaded.components.transformer, TwoExperts)
    assert loaded.components.transformer.boundary_timestep == BOUNDARY_RATIO * FLOW.num_train_timesteps
    alone = load_model(out_dir, components=("transformer",)).components.transformer  # the denoiser stage's load
    assert isinstance(alone, TwoExperts) and takes_image(FAMILY, alone)
    assert all(torch.equal(v, loaded.components.transformer.state_dict()[k]) for k, v in alone.state_dict().items())


@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
def test_two_experts_sample_the_stock_pipelines_latents_switching_at_the_boundary(exported_experts, prompts,
                                                                                  guidance_scale):
    components, _, pipe = exported_experts
    embeds, mask, negative, negative_mask = prompts
    image = random_image(0)
    condition = FAMILY.condition(components.transformer, encoders=components, image=image, bucket=BUCKET,
                                 latent_shape=FAMILY.latent_shape(BUCKET, 2)).inpaint_latents
    calls = {"high": 0, "low": 0}
    hooks = [expert.register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
             for name, expert in (("high", components.transformer.transformer),
                                  ("low", components.transformer.transformer_2))]
    try:
        ours = sample_latents(
            FAMILY, components.transformer, embeds, mask, latent_shape=FAMILY.latent_shape(BUCKET, 2),
            num_inference_steps=4, shift=FLOW.shift, num_train_timesteps=FLOW.num_train_timesteps,
            guidance_scale=guidance_scale, negative_prompt_embeds=negative,
            negative_prompt_attention_mask=negative_mask, generator=torch.Generator().manual_seed(5),
            inpaint_latents=condition)
    finally:
        for hook in hooks:
            hook.remove()
    assert calls["high"] == calls["low"] > 0  # two steps each (guidance batches both halves in one call)
    stock = pipe(image=image, prompt_embeds=embeds, negative_prompt_embeds=negative, num_frames=BUCKET.num_frames,
                 height=BUCKET.height, width=BUCKET.width, num_inference_steps=4, guidance_scale=guidance_scale,
                 generator=torch.Generator().manual_seed(5), output_type="latent").frames
    torch.testing.assert_close(ours, stock, atol=1e-5, rtol=1e-5)


def test_a_batch_of_samples_on_both_sides_of_the_boundary_gets_each_samples_own_expert(exported_experts):
    """Serving batches requests at different steps: each sample's output is its own expert's alone."""
    experts = exported_experts[0].transformer
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 36, 3, 4, 4, generator=generator)
    text = torch.randn(3, 5, experts.config.text_dim, generator=generator)
    timesteps = torch.tensor([950.0, 500.0, 900.0])  # high, low, high (the boundary itself is high, as the stock)
    with torch.no_grad():
        mixed = experts(hidden_states=hidden, timestep=timesteps, encoder_hidden_states=text, return_dict=False)[0]
        for i, expert in enumerate([experts.transformer, experts.transformer_2, experts.transformer]):
            alone = expert(hidden_states=hidden[i:i + 1], timestep=timesteps[i:i + 1],
                           encoder_hidden_states=text[i:i + 1], return_dict=False)[0]
            torch.testing.assert_close(mixed[i:i + 1], alone, atol=1e-6, rtol=1e-6)


def test_two_text_to_video_experts_match_the_stock_wan_pipeline(exported, tmp_path):
    from diffusers import WanPipeline

    components, _, _ = exported
    t2v = FAMILY.build(T2V_CFG, seed=0)
    experts = two_experts(T2V_CFG)
    out_dir = FAMILY.save_pipeline(dataclasses.replace(t2v, transformer=experts), tmp_path / "t2v", FLOW)
    pipe = WanPipeline.from_pretrained(out_dir, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.config.boundary_ratio == BOUNDARY_RATIO and pipe.transformer_2 is not None
    embeds, mask = FAMILY.encode_prompt(t2v.text_encoder, t2v.tokenizer, ["a red ball"],
                                        max_sequence_length=MAX_SEQUENCE_LENGTH)
    ours = sample_latents(FAMILY, experts, embeds, mask, latent_shape=FAMILY.latent_shape(BUCKET, 1),
                          num_inference_steps=4, shift=FLOW.shift, num_train_timesteps=FLOW.num_train_timesteps,
                          generator=torch.Generator().manual_seed(2))
    stock = pipe(prompt_embeds=embeds, num_frames=BUCKET.num_frames, height=BUCKET.height, width=BUCKET.width,
                 num_inference_steps=4, guidance_scale=1.0, generator=torch.Generator().manual_seed(2),
                 output_type="latent").frames
    torch.testing.assert_close(ours, stock, atol=1e-5, rtol=1e-5)


def test_a_bad_boundary_or_half_an_expert_pair_fails_in_one_line(exported_experts, tmp_path):
    _, out_dir, _ = exported_experts
    for ratio in (0, 1, 1.5, True, "0.9"):
        with pytest.raises(ValueError, match="boundary_ratio must be a number in \\(0, 1\\)") as err:
            TwoExperts(torch.nn.Linear(1, 1), torch.nn.Linear(1, 1), boundary_ratio=ratio)
        assert "\n" not in str(err.value)
    folder = shutil.copytree(out_dir, tmp_path / "half")
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "boundary_ratio": None}))
    with pytest.raises(ValueError, match="transformer_2 and boundary_ratio go together"):
        load_pipeline_folder(FAMILY, folder)
    (folder / "model_index.json").write_text(json.dumps({**index, "boundary_ratio": 1.2}))
    with pytest.raises(ValueError, match="boundary_ratio must be a number in \\(0, 1\\)"):
        load_model(folder, components=("transformer",))
    (folder / "model_index.json").write_text(json.dumps(index))
    shutil.rmtree(folder / "transformer_2")
    with pytest.raises(FileNotFoundError, match="lacks transformer_2/"):
        load_pipeline_folder(FAMILY, folder)


EXPERTS_CFG = dataclasses.replace(CFG, experts=ExpertsConfig(boundary_ratio=0.9))


def test_model_experts_builds_two_tiny_experts_and_the_transformer_alone_equals_the_whole_build():
    whole = FAMILY.build(EXPERTS_CFG, seed=3).transformer
    alone = FAMILY.load_diffusion_models(EXPERTS_CFG, seed=3).transformer
    assert isinstance(whole, TwoExperts) and whole.boundary_timestep == 900.0
    assert whole.state_dict().keys() == alone.state_dict().keys()
    assert all(torch.equal(v, alone.state_dict()[k]) for k, v in whole.state_dict().items())
    high, low = whole.transformer.state_dict(), whole.transformer_2.state_dict()
    assert not all(torch.equal(high[k], low[k]) for k in high)  # two draws, not one model twice
    assert FAMILY.no_grad_parameter_names(whole) == []


def test_each_expert_trains_only_on_the_samples_whose_timestep_falls_on_its_side():
    """One training step of 16 samples: the high-noise expert gets exactly the samples at timesteps >= 900, the
    low-noise one the rest, and each gets gradients from its own samples."""
    experts = FAMILY.load_diffusion_models(EXPERTS_CFG, seed=0).transformer
    seen = {"high": [], "low": []}
    for name, expert in (("high", experts.transformer), ("low", experts.transformer_2)):
        expert.register_forward_pre_hook(lambda _, args, kwargs, name=name: seen[name].extend(
            kwargs["timestep"].tolist()), with_kwargs=True)
    shape = FAMILY.latent_shape(BUCKET, 16)
    latents = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    embeds, mask = torch.randn(16, 4, experts.config.text_dim), torch.ones(16, 4, dtype=torch.bool)
    generators = [sample_generator(0, 1, key) for key in range(16)]
    loss = flow_matching_step_loss(FAMILY, experts, latents, embeds, mask, FlowConfig(shift=5.0), generators,
                                   **FAMILY.condition(experts, latent_shape=shape).predict_kwargs())
    loss.backward()
    assert len(seen["high"]) + len(seen["low"]) == 16 and seen["high"] and seen["low"]
    assert min(seen["high"]) >= 900 > max(seen["low"])
    for expert in (experts.transformer, experts.transformer_2):
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in expert.parameters())


def test_a_folders_experts_must_be_the_configs_on_the_driver_and_at_build(exported, exported_experts, tmp_path):
    from vidray.errors import UserError
    from vidray.train.trainer import check_job_inputs

    _, one_dir, _ = exported
    _, two_dir, _ = exported_experts
    cases = [(two_dir, None, r"holds two experts .* but model.experts is null: set model.experts: "
                             r"\{boundary_ratio: 0.8\}"),
             (one_dir, 0.9, "holds one transformer but model.experts is set"),
             (two_dir, 0.9, "switches its experts at boundary_ratio 0.8 but model.experts.boundary_ratio is 0.9")]
    for folder, ratio, message in cases:
        experts = None if ratio is None else {"boundary_ratio": ratio}
        job = job_config_from_dict({**JOB, "model": {**JOB["model"], "init": "pretrained", "experts": experts,
                                                     "pretrained_path": str(folder)},
                                    "data": {**JOB["data"], "shards_dir": str(tmp_path / "shards")},
                                    "storage": {"path": str(tmp_path / "runs")}})
        with pytest.raises(UserError, match=message) as err:  # on the driver, before anything is reserved
            check_job_inputs(job)
        assert "\n" not in str(err.value)
        with pytest.raises(ValueError, match=message):
            FAMILY.load_diffusion_models(job.model, seed=0).transformer
    matching = dataclasses.replace(CFG, init="pretrained", pretrained_path=str(two_dir),
                                   experts=ExpertsConfig(boundary_ratio=BOUNDARY_RATIO))
    assert isinstance(FAMILY.load_diffusion_models(matching, seed=0).transformer, TwoExperts)


@pytest.mark.parametrize("experts, extra, message", [
    ({"boundary_ratio": 1.0}, {}, r"model.experts.boundary_ratio must be in \(0, 1\)"),
    ({"boundary_ratio": True}, {}, "is a boolean, not a number"),
    ({}, {"model": {"family": "easyanimate"}}, "model.family easyanimate has no two-expert model"),
    ({"layout": "shared"}, {"scaling": {"strategy": "fsdp"}},
     "model.experts.layout: shared trains with scaling.strategy: ddp only"),  # groups shard each expert: fine
    ({}, {"train": {"grad_compression": "powersgd"}}, "model.experts with train.grad_compression: powersgd"),
    ({}, {"flow": {"num_train_timesteps": 500}}, "model.experts needs flow.num_train_timesteps 1000"),
])
def test_a_bad_experts_section_fails_at_load_in_one_line(experts, extra, message):
    raw = {"model": {"family": "wan", "experts": experts, **extra.get("model", {})},
           **{k: v for k, v in extra.items() if k != "model"}}
    with pytest.raises(ConfigError, match=message) as err:
        job_config_from_dict(raw)
    assert "\n" not in str(err.value)


def test_a_last_image_for_a_model_trained_on_first_frames_only_is_sampled_with_a_warning(exported, tmp_path, caplog):
    from vidray.generate import generate_to_file

    _, out_dir, _ = exported  # its job file: model.i2v.condition first
    first, last = tmp_path / "first.png", tmp_path / "last.png"
    random_image(1).save(first)
    random_image(2).save(last)
    with caplog.at_level("WARNING", logger="vidray.generate"):
        video = generate_to_file(out_dir, "a cat", tmp_path / "out.mp4", num_inference_steps=1, image=first,
                                 last_image=last)
    assert video.is_file()
    assert "trained with model.i2v.condition: first" in caplog.text
