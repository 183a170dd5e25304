"""The AnimateDiff family against the stock `diffusers.AnimateDiffPipeline`, on CPU in fp32.

Parity: the export loads in the stock pipeline offline, and for the same prompts, negative prompts, seed (the stock
pipeline draws its noise (B, C, F, H, W) from a CPU generator exactly as `initial_noise` does), num_inference_steps
and guidance_scale, the stock pipeline's `output_type="latent"` latents equal `vidray.inference.sampler`'s, and its
frames equal `generate_video`'s. Only the motion modules train. The family-independent checks are in
test_families.py.
"""

import dataclasses
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from diffusers import AnimateDiffPipeline, UNet2DConditionModel, UNetMotionModel  # noqa: E402

from vidray.config import FlowConfig, ModelConfig, job_config_from_dict, load_job_config  # noqa: E402
from vidray.buckets import Bucket  # noqa: E402
from vidray.inference.sampler import generate_video, initial_noise, sample_latents  # noqa: E402
from vidray.models import get_family  # noqa: E402
from vidray.models.export import inspect_model  # noqa: E402
from vidray.train.step import flow_matching_step_loss  # noqa: E402
from vidray.models.export import load_pipeline_folder

REPO = Path(__file__).resolve().parents[2]
BUCKET = Bucket(4, 64, 64)
FLOW = FlowConfig(num_train_timesteps=1000)
PROMPTS = ["a red ball bouncing", "waves on a beach"]
NEGATIVE = ["", "blurry"]
MAX_SEQUENCE_LENGTH = 16
CFG = ModelConfig(family="animatediff", text_encoder="tiny_random", max_sequence_length=MAX_SEQUENCE_LENGTH)


@pytest.fixture(scope="module")
def family():
    return get_family("animatediff")


@pytest.fixture(scope="module")
def exported(family, tmp_path_factory):
    components = family.build(CFG, seed=0)
    out_dir = family.save_pipeline(components, tmp_path_factory.mktemp("export") / "diffusers", FLOW)
    pipe = AnimateDiffPipeline.from_pretrained(out_dir, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return components, out_dir, pipe


def _stock_latents(pipe, seed, steps, guidance_scale, negative=None):
    return pipe(prompt=PROMPTS, negative_prompt=negative, num_frames=BUCKET.num_frames, height=BUCKET.height,
                width=BUCKET.width, num_inference_steps=steps, guidance_scale=guidance_scale, output_type="latent",
                generator=torch.Generator().manual_seed(seed)).frames


def test_the_export_is_an_animatediff_pipeline_with_the_motion_unet_and_the_epsilon_ddim_scheduler(exported):
    _, out_dir, pipe = exported
    index = json.loads((out_dir / "model_index.json").read_text())
    assert index["_class_name"] == "AnimateDiffPipeline"
    assert index["unet"] == ["diffusers", "UNetMotionModel"] and index["motion_adapter"] == [None, None]
    assert isinstance(pipe.unet, UNetMotionModel) and pipe.motion_adapter is None
    assert type(pipe.scheduler).__name__ == "DDIMScheduler"
    cfg = pipe.scheduler.config
    assert (cfg.prediction_type, cfg.beta_schedule, cfg.beta_start, cfg.beta_end, cfg.steps_offset, cfg.clip_sample,
            cfg.timestep_spacing) == ("epsilon", "linear", 0.00085, 0.012, 1, False, "leading")
    assert type(pipe.text_encoder).__name__ == "CLIPTextModel" and type(pipe.vae).__name__ == "AutoencoderKL"
    assert pipe.tokenizer.model_max_length == MAX_SEQUENCE_LENGTH  # the stock pipeline pads prompts to it
    assert list(out_dir.glob("unet/*.safetensors")) and list(out_dir.glob("vae/*.safetensors"))


@pytest.mark.parametrize("steps", [1, 4, 7])
@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
def test_stock_pipeline_latents_equal_vidrays_for_the_same_prompts_and_seed(family, exported, guidance_scale, steps):
    components, _, pipe = exported
    embeds, mask = family.encode_prompt(components.text_encoder, components.tokenizer, PROMPTS,
                                        max_sequence_length=MAX_SEQUENCE_LENGTH)
    negative_embeds, negative_mask = family.encode_prompt(components.text_encoder, components.tokenizer, NEGATIVE,
                                                          max_sequence_length=MAX_SEQUENCE_LENGTH)
    latent_shape = family.latent_shape(BUCKET, len(PROMPTS))
    ours = sample_latents(
        family, components.transformer, embeds, mask, latent_shape=latent_shape, num_inference_steps=steps,
        shift=FLOW.shift, num_train_timesteps=FLOW.num_train_timesteps, guidance_scale=guidance_scale,
        negative_prompt_embeds=negative_embeds, negative_prompt_attention_mask=negative_mask,
        latents=initial_noise(latent_shape, seed=5),
    )
    stock = _stock_latents(pipe, 5, steps, guidance_scale, NEGATIVE if guidance_scale > 1 else None)
    assert ours.shape == stock.shape == latent_shape  # both (B, C, F, H, W)
    # rtol: the tiny random UNet's DDIM latents reach |x| ~ 20 after 7 steps, and diffusers' alphas_cumprod is a
    # float32 cumprod (vidray.diffusion.ddim's float64, 1.8e-7 apart): differences of fp32 rounding (~6e-7 relative).
    torch.testing.assert_close(ours, stock, atol=1e-5, rtol=1e-5)


def test_generate_video_equals_stock_pipeline_frames(family, exported):
    components, _, pipe = exported
    frames = generate_video(family, components, PROMPTS, BUCKET, flow=FLOW, num_inference_steps=2,
                            max_sequence_length=MAX_SEQUENCE_LENGTH, seed=3)
    stock = pipe(prompt=PROMPTS, num_frames=BUCKET.num_frames, height=BUCKET.height, width=BUCKET.width,
                 num_inference_steps=2, guidance_scale=1.0, output_type="np",
                 generator=torch.Generator().manual_seed(3)).frames  # (B, F, H, W, 3) float in [0, 1]
    assert frames.shape == (2, *BUCKET, 3) and frames.dtype == np.uint8 and stock.shape == frames.shape
    assert np.abs(frames.astype(int) - (stock * 255).round().astype(int)).max() <= 1


def test_encode_prompt_equals_the_pipelines_padding_positions_included(family, exported):
    components, _, pipe = exported
    embeds, mask = family.encode_prompt(components.text_encoder, components.tokenizer, PROMPTS,
                                        max_sequence_length=MAX_SEQUENCE_LENGTH)
    assert embeds.shape == (2, MAX_SEQUENCE_LENGTH, 64) and embeds.dtype == torch.float32 and mask.dtype == torch.bool
    assert 0 < int(mask.sum(dim=1).min()) < MAX_SEQUENCE_LENGTH
    with torch.no_grad():
        stock, _ = pipe.encode_prompt(PROMPTS, "cpu", 1, do_classifier_free_guidance=False)
    assert torch.equal(embeds, stock)


def test_latents_are_per_frame_and_scaled_by_the_vae_configs_scaling_factor(family, exported):
    components, _, _ = exported
    vae = components.vae
    video = torch.rand(1, 3, *BUCKET, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = family.encode_video(vae, video)
    assert latents.shape == family.latent_shape(BUCKET, 1) == (1, 4, 4, 8, 8)
    with torch.no_grad():
        third = vae.encode(video[:, :, 2]).latent_dist.mode() * vae.config.scaling_factor  # one frame alone
        torch.testing.assert_close(latents[:, :, 2], third)
        # the stock pipeline's per-frame decode, on the same VAE module
        expected = AnimateDiffPipeline.decode_latents(SimpleNamespace(vae=vae), latents).clamp(-1, 1)
    torch.testing.assert_close(family.decode_latents(vae, latents), expected, atol=1e-6, rtol=0)


def test_the_objective_is_epsilon_on_the_exported_scheduler(family, exported):
    _, _, pipe = exported
    scheduler = pipe.scheduler
    g = torch.Generator().manual_seed(1)
    latents, noise = torch.randn(3, 4, 2, 8, 8, generator=g), torch.randn(3, 4, 2, 8, 8, generator=g)
    sigmas = torch.tensor([0.0, 0.4173, 1.0])
    t = torch.tensor([0, 417, 999])
    torch.testing.assert_close(family.objective.model_timesteps(sigmas, 1000), t.float())
    torch.testing.assert_close(family.objective.noisy_latents(latents, noise, sigmas),
                               scheduler.add_noise(latents, noise, t),
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(family.objective.training_target(latents, noise, sigmas), noise)
    for steps in (1, 4, 25):
        scheduler.set_timesteps(steps)
        sigmas = family.objective.inference_sigmas(steps, shift=3.0, num_train_timesteps=1000)
        assert torch.equal((sigmas[:-1] * 1000).round().long(), scheduler.timesteps) and sigmas[-1] < 0
    # One sampler step is DDIMScheduler.step (its prev_timestep t - 1000 // steps is vidray's next timestep).
    scheduler.set_timesteps(4)
    sigmas = family.objective.inference_sigmas(4, shift=3.0, num_train_timesteps=1000)
    for i, step_t in enumerate(scheduler.timesteps):
        ours = family.objective.sampler_step(latents, noise, sigmas[i].repeat(3), sigmas[i + 1].repeat(3))
        torch.testing.assert_close(ours, scheduler.step(noise, step_t, latents).prev_sample, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="set flow.num_train_timesteps: 1000"):
        family.objective.inference_sigmas(4, shift=3.0, num_train_timesteps=500)


def test_only_the_motion_modules_train(family):
    components = family.build(CFG, seed=0)
    unet = components.transformer
    trainable = {name for name, p in unet.named_parameters() if p.requires_grad}
    motion = {name for name, _ in unet.named_parameters() if ".motion_modules." in name}
    assert trainable == motion and 0 < len(motion) < len(list(unet.parameters()))
    before = {name: p.detach().clone() for name, p in unet.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in unet.parameters() if p.requires_grad], lr=1e-2)
    latents = torch.randn(family.latent_shape(BUCKET, 2), generator=torch.Generator().manual_seed(0))
    embeds, mask = family.encode_prompt(components.text_encoder, components.tokenizer, PROMPTS,
                                        max_sequence_length=MAX_SEQUENCE_LENGTH)
    generators = [torch.Generator().manual_seed(i) for i in range(2)]
    flow_matching_step_loss(family, unet, latents, embeds, mask, FLOW, generators).backward()
    optimizer.step()
    changed = {name for name, p in unet.named_parameters() if not torch.equal(p, before[name])}
    assert changed and changed <= motion
    assert all(p.grad is None for name, p in unet.named_parameters() if name not in motion)
    assert family.no_grad_parameter_names(family.load_diffusion_models(CFG, seed=0).transformer) == []


def test_load_pretrained_round_trips_the_export_and_the_build_functions_agree(family, exported):
    components, out_dir, _ = exported
    cfg = ModelConfig(family="animatediff", init="pretrained", pretrained_path=str(out_dir),
                      max_sequence_length=MAX_SEQUENCE_LENGTH)
    loaded = family.build(cfg, seed=123)
    for module in ("transformer", "vae", "text_encoder"):
        saved, reloaded = getattr(components, module).state_dict(), getattr(loaded, module).state_dict()
        assert saved.keys() == reloaded.keys() and saved, module
        assert all(torch.equal(saved[k], reloaded[k]) for k in saved), module
    trainable = {name for name, p in loaded.transformer.named_parameters() if p.requires_grad}
    assert trainable == {name for name, _ in loaded.transformer.named_parameters() if ".motion_modules." in name}
    alone = family.load_diffusion_models(cfg, seed=123).transformer.state_dict()
    assert all(torch.equal(alone[k], v) for k, v in loaded.transformer.state_dict().items())
    encoders = family.build_encoders(cfg, seed=123)
    assert all(torch.equal(encoders.vae.state_dict()[k], v) for k, v in loaded.vae.state_dict().items())
    assert all(torch.equal(encoders.text_encoder.state_dict()[k], v)
               for k, v in loaded.text_encoder.state_dict().items())
    alone_vae = family.load_latent_models(cfg, seed=123).vae.state_dict()
    assert all(torch.equal(alone_vae[k], v) for k, v in loaded.vae.state_dict().items())
    assert not any(p.requires_grad for p in loaded.vae.parameters()) and loaded.transformer.training
    vae_cfg = dataclasses.replace(CFG, vae_path=str(out_dir / "vae"))  # a VAE folder alone (model.vae_path)
    vae_folder = family.load_latent_models(vae_cfg, seed=0).vae.state_dict()
    assert all(torch.equal(vae_folder[k], v) for k, v in loaded.vae.state_dict().items())


def test_the_tiny_preset_build_functions_agree_with_build(family):
    built = family.build(CFG, seed=7)
    for alone, whole in ((family.load_diffusion_models(CFG, seed=7).transformer, built.transformer),
                         (family.load_latent_models(CFG, seed=7).vae, built.vae),
                         (family.load_condition_models(CFG, seed=7).text_encoder, built.text_encoder)):
        a, b = alone.state_dict(), whole.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert family.prompt_embeds_dim(built.transformer) == 64
    assert built.tokenizer.model_max_length == MAX_SEQUENCE_LENGTH


def test_a_folder_with_an_image_unet_and_a_motion_adapter_loads_as_the_pipeline_combines_them(family, exported,
                                                                                               tmp_path):
    """The other AnimateDiff layout: SD's UNet2DConditionModel in unet/ and the MotionAdapter in motion_adapter/."""
    components, out_dir, _ = exported
    split = tmp_path / "split"
    shutil.copytree(out_dir, split)
    shutil.rmtree(split / "unet")
    motion_unet = components.transformer
    torch.manual_seed(0)
    image_unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=(16, 32), layers_per_block=1,
        norm_num_groups=8, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=64, attention_head_dim=2)
    image_unet.save_pretrained(split / "unet")
    motion_unet.save_motion_modules(str(split / "motion_adapter"))
    index = json.loads((split / "model_index.json").read_text())
    (split / "model_index.json").write_text(json.dumps({**index, "unet": ["diffusers", "UNet2DConditionModel"],
                                                        "motion_adapter": ["diffusers", "MotionAdapter"]}))
    loaded = load_pipeline_folder(family, split).transformer
    stock = AnimateDiffPipeline.from_pretrained(split, local_files_only=True).unet  # from_unet2d in its __init__
    assert isinstance(loaded, UNetMotionModel)
    a, b = loaded.state_dict(), stock.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    motion = {k: v for k, v in motion_unet.state_dict().items() if ".motion_modules." in k}
    assert all(torch.equal(a[k], v) for k, v in motion.items())
    shutil.rmtree(split / "motion_adapter")
    with pytest.raises(FileNotFoundError, match=f"'{split}' holds an image UNet2DConditionModel and lacks "
                                                "motion_adapter/") as err:
        family.load_diffusion_models(ModelConfig(family="animatediff", init="pretrained", pretrained_path=str(split)),
                                 seed=0).transformer
    assert "\n" not in str(err.value)


def test_a_folder_that_is_not_animatediff_is_refused_in_one_line_naming_it(family, exported, tmp_path):
    _, out_dir, _ = exported
    with pytest.raises(FileNotFoundError, match="no model_index.json"):
        load_pipeline_folder(family, tmp_path)
    incomplete = tmp_path / "incomplete"
    shutil.copytree(out_dir, incomplete)
    shutil.rmtree(incomplete / "vae")
    with pytest.raises(FileNotFoundError, match=f"'{incomplete}' lacks vae/") as err:
        load_pipeline_folder(family, incomplete)
    assert "\n" not in str(err.value)
    other = tmp_path / "other"
    shutil.copytree(out_dir, other)
    index = json.loads((other / "model_index.json").read_text())
    (other / "model_index.json").write_text(json.dumps({**index, "_class_name": "CogVideoXPipeline"}))
    with pytest.raises(ValueError, match=f"'{other}' holds a CogVideoXPipeline pipeline, not a AnimateDiffPipeline: "
                                         "set model.family") as err:
        family.load_diffusion_models(ModelConfig(family="animatediff", init="pretrained", pretrained_path=str(other)),
                                 seed=0).transformer
    assert "\n" not in str(err.value)
    (other / "model_index.json").write_text(json.dumps(index))
    vae_config = json.loads((other / "vae" / "config.json").read_text())
    (other / "vae" / "config.json").write_text(json.dumps({**vae_config, "latent_channels": 16}))
    with pytest.raises(ValueError, match=f"'{other}': vae \\(latent_channels, spatial compression\\) = \\(16, 8\\), "
                                         "but the animatediff family") as err:
        load_pipeline_folder(family, other)
    assert "\n" not in str(err.value)
    (other / "vae" / "config.json").write_text(json.dumps(vae_config))
    unet_config = json.loads((other / "unet" / "config.json").read_text())
    (other / "unet" / "config.json").write_text(json.dumps({**unet_config, "in_channels": 8}))
    with pytest.raises(ValueError, match="unet in_channels/out_channels \\(8, 4\\) do not match the vae's "
                                         "latent_channels 4"):
        family.load_latent_models(ModelConfig(family="animatediff", init="pretrained", pretrained_path=str(other)),
                                  seed=0)
    (other / "unet" / "config.json").write_text(json.dumps(unet_config))
    config = json.loads((other / "scheduler" / "scheduler_config.json").read_text())
    (other / "scheduler" / "scheduler_config.json").write_text(json.dumps({**config,
                                                                           "prediction_type": "v_prediction"}))
    with pytest.raises(ValueError, match=f"'{other}': scheduler prediction_type='v_prediction'"):
        load_pipeline_folder(family, other)


def test_a_stock_animatediff_folder_is_inspected_as_animatediff_with_77_tokens(exported, tmp_path):
    _, out_dir, _ = exported
    stock = tmp_path / "stock"
    shutil.copytree(out_dir, stock)  # no vidray_job.yaml: as a stock AnimateDiff folder
    info = inspect_model(stock)
    assert (info.family_name, info.max_sequence_length, info.buckets) == ("animatediff", 77, [])


def test_any_frame_count_but_sides_multiple_of_64_and_frames_within_the_motion_modules(family, exported):
    components, _, _ = exported
    assert family.latent_shape(Bucket(16, 128, 64), 2) == (2, 4, 16, 16, 8)
    assert family.latent_shape(Bucket(7, 64, 64), 1)[2] == 7  # no temporal compression
    with pytest.raises(ValueError, match="multiples of 64"):
        family.latent_shape(Bucket(16, 96, 64), 1)
    too_many = components.transformer.config.motion_max_seq_length + 1
    latents, embeds = torch.zeros(1, 4, too_many, 8, 8), torch.zeros(1, 4, 64)
    with pytest.raises(ValueError, match="motion_max_seq_length=32: use buckets of at most 32 frames"):
        family.predict(components.transformer, latents, torch.tensor([1.0]), embeds, torch.ones(1, 4, dtype=bool))


def test_a_config_whose_bucket_breaks_the_rule_fails_at_load_naming_it():
    raw = {"name": "bad", "model": {"family": "animatediff"}, "data": {"buckets": [[16, 96, 96]]}}
    with pytest.raises(ValueError, match=r"data.buckets: bucket .*multiples of 64.*model.family=animatediff"):
        job_config_from_dict(raw)
    assert job_config_from_dict({**raw, "data": {"buckets": [[16, 128, 128], [7, 64, 64]]}}).model.family == \
        "animatediff"
    with pytest.raises(ValueError, match="set flow.num_train_timesteps: 1000"):
        job_config_from_dict({**raw, "data": {"buckets": [[16, 64, 64]]}, "flow": {"num_train_timesteps": 500}})


def test_the_shipped_animatediff_config_builds_the_animatediff_family_for_its_buckets(family):
    job = load_job_config(REPO / "jobs" / "configs" / "animatediff_t2v_tiny.yaml")
    assert get_family(job.model.family) is family
    transformer = family.load_diffusion_models(job.model, seed=job.train.seed).transformer
    for bucket in job.data.buckets:
        assert family.latent_shape(bucket, 1)[1] == transformer.config.in_channels
        assert bucket[0] <= transformer.config.motion_max_seq_length


def test_every_nth_block_checkpointing_is_refused_at_load_and_full_checkpointing_runs(family):
    """AnimateDiff has no list of transformer blocks (its motion modules sit in a UNet's down, mid and up blocks):
    `every_<n>` is refused in one line when the config loads, not in the worker; `full` (diffusers' own gradient
    checkpointing of the UNet) is accepted and turns on."""
    from vidray.train.parallel import apply_activation_checkpointing

    raw = {"name": "ac", "model": {"family": "animatediff"}, "data": {"buckets": [[16, 64, 64]]},
           "flow": {"num_train_timesteps": 1000}}
    with pytest.raises(ValueError) as refused:
        job_config_from_dict({**raw, "train": {"activation_checkpointing": "every_2"}})
    message = str(refused.value)
    assert "\n" not in message and message.startswith("train.activation_checkpointing: every_2: model.family "
                                                      "animatediff has no list of transformer blocks")
    assert "use full" in message
    job = job_config_from_dict({**raw, "train": {"activation_checkpointing": "full"}})
    transformer = family.load_diffusion_models(job.model, seed=0).transformer
    assert apply_activation_checkpointing(transformer, "full", family.block_lists(transformer)) > 0
    assert job_config_from_dict({**raw, "model": {"family": "easyanimate"}, "data": {"buckets": [[9, 64, 64]]},
                                 "train": {"activation_checkpointing": "every_2"}})  # a family with blocks: fine
