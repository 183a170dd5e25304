"""The Wan 2.1 T2V family against the stock `diffusers.WanPipeline` (issue 29 part 2), on CPU in fp32.

Parity: the export loads in the stock pipeline offline, and for the same prompts, negative prompts, seed,
num_inference_steps, guidance_scale and max_sequence_length, the stock pipeline's `output_type="latent"` latents
(it encodes the prompts itself) equal `vidray.inference.sampler.sample_latents` over `family.encode_prompt`'s
embeddings, and its frames equal `generate_video`'s. The family-independent checks are in test_families.py.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json  # noqa: E402
import shutil  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from diffusers import WanPipeline  # noqa: E402

from vidray.config import FlowConfig, ModelConfig  # noqa: E402
from vidray.buckets import Bucket  # noqa: E402
from vidray.inference.sampler import generate_video, sample_latents  # noqa: E402
from vidray.models import get_family  # noqa: E402
from vidray.models.export import inspect_model  # noqa: E402
from vidray.models.export import load_pipeline_folder

BUCKET = Bucket(9, 32, 32)
FLOW = FlowConfig(shift=3.0, num_train_timesteps=1000)
PROMPTS = ["a red ball bouncing", "waves  on a &amp; beach "]  # prompt_clean: whitespace and HTML entities
NEGATIVE = ["", "blurry"]
MAX_SEQUENCE_LENGTH = 16
CFG = ModelConfig(family="wan", text_encoder="tiny_random", max_sequence_length=MAX_SEQUENCE_LENGTH)


@pytest.fixture(scope="module")
def family():
    return get_family("wan")


@pytest.fixture(scope="module")
def exported(family, tmp_path_factory):
    components = family.build(CFG, seed=0)
    out_dir = family.save_pipeline(components, tmp_path_factory.mktemp("export") / "diffusers", FLOW)
    pipe = WanPipeline.from_pretrained(out_dir, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return components, out_dir, pipe


def test_the_export_is_a_wan_pipeline_with_an_euler_scheduler_carrying_the_shift(exported):
    _, out_dir, pipe = exported
    index = json.loads((out_dir / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline" and index["transformer_2"] == [None, None]
    assert type(pipe.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    assert pipe.scheduler.config.shift == FLOW.shift
    assert type(pipe.text_encoder).__name__ == "UMT5EncoderModel"
    assert list(out_dir.glob("transformer/*.safetensors")) and list(out_dir.glob("vae/*.safetensors"))
    assert not list(out_dir.parent.glob(".diffusers.tmp-*"))


@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
def test_stock_pipeline_latents_equal_sample_latents_for_the_same_prompts_and_seed(family, exported,
                                                                                   guidance_scale):
    components, _, pipe = exported
    embeds, mask = family.encode_prompt(components.text_encoder, components.tokenizer, PROMPTS,
                                        max_sequence_length=MAX_SEQUENCE_LENGTH)
    negative_embeds, negative_mask = family.encode_prompt(components.text_encoder, components.tokenizer, NEGATIVE,
                                                          max_sequence_length=MAX_SEQUENCE_LENGTH)
    latent_shape = family.latent_shape(BUCKET, len(PROMPTS))
    ours = sample_latents(
        family, components.transformer, embeds, mask, latent_shape=latent_shape, num_inference_steps=3,
        shift=FLOW.shift, num_train_timesteps=FLOW.num_train_timesteps, guidance_scale=guidance_scale,
        negative_prompt_embeds=negative_embeds, negative_prompt_attention_mask=negative_mask,
        generator=torch.Generator().manual_seed(5),
    )
    stock = pipe(
        prompt=PROMPTS, negative_prompt=NEGATIVE, num_frames=BUCKET.num_frames, height=BUCKET.height,
        width=BUCKET.width, num_inference_steps=3, guidance_scale=guidance_scale,
        max_sequence_length=MAX_SEQUENCE_LENGTH, generator=torch.Generator().manual_seed(5), output_type="latent",
    ).frames
    assert ours.shape == stock.shape == latent_shape
    torch.testing.assert_close(ours, stock, atol=1e-5, rtol=1e-5)


def test_generate_video_equals_stock_pipeline_frames(family, exported):
    components, _, pipe = exported
    frames = generate_video(family, components, PROMPTS, BUCKET, flow=FLOW, num_inference_steps=2,
                            max_sequence_length=MAX_SEQUENCE_LENGTH, seed=3)
    stock = pipe(
        prompt=PROMPTS, num_frames=BUCKET.num_frames, height=BUCKET.height, width=BUCKET.width,
        num_inference_steps=2, guidance_scale=1.0, max_sequence_length=MAX_SEQUENCE_LENGTH,
        generator=torch.Generator().manual_seed(3), output_type="np",
    ).frames  # (B, F, H, W, 3) float in [0, 1]
    assert frames.shape == (2, *BUCKET, 3) and frames.dtype == np.uint8
    assert np.abs(frames.astype(int) - (stock * 255).round().astype(int)).max() <= 1


def test_encode_prompt_zeroes_every_position_past_the_prompt_as_the_pipeline_does(family, exported):
    components, _, pipe = exported
    embeds, mask = family.encode_prompt(components.text_encoder, components.tokenizer, PROMPTS,
                                        max_sequence_length=MAX_SEQUENCE_LENGTH)
    assert embeds.shape == (2, MAX_SEQUENCE_LENGTH, 64) and embeds.dtype == torch.float32 and mask.dtype == torch.bool
    lengths = mask.sum(dim=1)
    assert 0 < int(lengths.min()) < MAX_SEQUENCE_LENGTH
    for row, length in zip(embeds, lengths):
        assert row[length:].abs().sum() == 0 and row[:length].abs().sum(dim=-1).gt(0).all()
    with torch.no_grad():
        stock, _ = pipe.encode_prompt(PROMPTS, do_classifier_free_guidance=False,
                                      max_sequence_length=MAX_SEQUENCE_LENGTH)
    assert torch.equal(embeds, stock)


def test_latents_are_normalised_per_channel_with_the_vae_configs_mean_and_std(family, exported):
    components, _, _ = exported
    vae = components.vae
    video = torch.rand(1, 3, *BUCKET, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = family.encode_video(vae, video)
    with torch.no_grad():
        mode = vae.encode(video).latent_dist.mode()
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
        torch.testing.assert_close(latents, (mode - mean) / std)
        # WanPipeline's decode (diffusers/pipelines/wan/pipeline_wan.py): latents / (1 / std) + mean
        expected = vae.decode(latents / (1.0 / std) + mean, return_dict=False)[0].clamp(-1, 1)
    torch.testing.assert_close(family.decode_latents(vae, latents), expected, atol=0, rtol=0)


def test_load_pretrained_round_trips_the_export_and_load_diffusion_models_agrees(family, exported):
    components, out_dir, _ = exported
    cfg = ModelConfig(family="wan", init="pretrained", pretrained_path=str(out_dir))
    loaded = family.build(cfg, seed=123)
    for module in ("transformer", "vae", "text_encoder"):
        saved, reloaded = getattr(components, module).state_dict(), getattr(loaded, module).state_dict()
        assert saved.keys() == reloaded.keys() and saved, module
        assert all(torch.equal(saved[k], reloaded[k]) for k in saved), module
    alone = family.load_diffusion_models(cfg, seed=123).transformer.state_dict()
    assert all(torch.equal(alone[k], v) for k, v in loaded.transformer.state_dict().items())
    encoders = family.build_encoders(cfg, seed=123)
    assert all(torch.equal(encoders.vae.state_dict()[k], v) for k, v in loaded.vae.state_dict().items())
    alone_vae = family.load_latent_models(cfg, seed=123).vae.state_dict()
    assert all(torch.equal(alone_vae[k], v) for k, v in loaded.vae.state_dict().items())
    assert not any(p.requires_grad for p in loaded.vae.parameters()) and loaded.transformer.training


def test_the_tiny_preset_transformer_alone_equals_builds(family):
    built = family.build(CFG, seed=7).transformer.state_dict()
    alone = family.load_diffusion_models(CFG, seed=7).transformer.state_dict()
    assert built.keys() == alone.keys() and all(torch.equal(built[k], alone[k]) for k in built)
    assert family.no_grad_parameter_names(family.load_diffusion_models(CFG, seed=7).transformer) == []


def test_a_folder_that_is_not_a_wan_folder_it_can_load_is_refused_in_one_line_naming_it(family, exported, tmp_path):
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
    (other / "model_index.json").write_text(json.dumps({**index, "_class_name": "EasyAnimatePipeline"}))
    with pytest.raises(ValueError, match="holds a EasyAnimatePipeline pipeline, not a WanPipeline: set model.family"):
        load_pipeline_folder(family, other)
    (other / "model_index.json").write_text(json.dumps({**index, "transformer_2": ["diffusers",
                                                                                   "WanTransformer3DModel"]}))
    with pytest.raises(ValueError, match="transformer_2 and boundary_ratio go together"):  # two experts: test_wan_i2v
        family.load_diffusion_models(ModelConfig(family="wan", init="pretrained", pretrained_path=str(other)), seed=0)


def test_a_stock_wan_folder_is_inspected_as_wan_with_its_flow_shift_and_512_tokens(exported, tmp_path):
    _, out_dir, _ = exported
    stock = tmp_path / "stock"
    shutil.copytree(out_dir, stock)  # no vidray_job.yaml: as a stock Wan 2.1 folder
    (stock / "scheduler" / "scheduler_config.json").write_text(json.dumps(
        {"_class_name": "UniPCMultistepScheduler", "flow_shift": 5.0, "num_train_timesteps": 1000}))
    info = inspect_model(stock)
    assert (info.family_name, info.flow.shift, info.max_sequence_length, info.buckets) == ("wan", 5.0, 512, [])


def test_the_minilm_text_encoder_sets_the_transformers_text_dim(family):
    cfg = ModelConfig(family="wan", text_encoder="minilm")
    transformer = family.load_diffusion_models(cfg, seed=0).transformer
    assert family.prompt_embeds_dim(transformer) == 384
    loss = family.probe_loss(transformer, transformer)
    assert loss.ndim == 0 and torch.isfinite(loss)


@pytest.mark.parametrize("text_encoder", ["tiny_random", "minilm"])
def test_the_planners_shape_of_a_wan_tiny_job_is_the_model_the_family_builds(family, text_encoder):
    from vidray.models.presets import model_preset
    from vidray.train.plan import count_model

    preset = model_preset("wan", "tiny", text_encoder)
    assert preset.name == "wan-tiny" and preset.family == "wan"
    transformer = family.load_diffusion_models(ModelConfig(family="wan", text_encoder=text_encoder), seed=0).transformer
    assert count_model(preset).total == sum(p.numel() for p in transformer.parameters())


def test_the_shipped_wan_config_builds_the_wan_family_for_its_buckets(family):
    from pathlib import Path

    from vidray.config import load_job_config

    job = load_job_config(Path(__file__).resolve().parents[2] / "jobs" / "configs" / "wan_t2v_tiny.yaml")
    assert get_family(job.model.family) is family
    transformer = family.load_diffusion_models(job.model, seed=job.train.seed).transformer
    for bucket in job.data.buckets:
        assert family.latent_shape(bucket, 1)[1] == transformer.config.in_channels


def _timesteps_seen(transformer, run) -> list[torch.Tensor]:
    seen = []
    handle = transformer.register_forward_pre_hook(lambda _, args, kwargs: seen.append(kwargs["timestep"].clone()),
                                                   with_kwargs=True)
    try:
        run()
    finally:
        handle.remove()
    return seen


def test_the_transformer_gets_the_stock_pipelines_float32_timesteps_even_in_bf16(family, exported):
    import copy

    components, _, pipe = exported
    embeds, mask = family.encode_prompt(components.text_encoder, components.tokenizer, PROMPTS[:1],
                                        max_sequence_length=MAX_SEQUENCE_LENGTH)
    transformer = copy.deepcopy(components.transformer).to(torch.bfloat16)
    kwargs = dict(num_inference_steps=3, shift=FLOW.shift, num_train_timesteps=FLOW.num_train_timesteps)
    ours = _timesteps_seen(transformer, lambda: sample_latents(
        family, transformer, embeds, mask, latent_shape=family.latent_shape(BUCKET, 1), **kwargs))
    stock = _timesteps_seen(pipe.transformer, lambda: pipe(
        prompt=PROMPTS[:1], num_frames=BUCKET.num_frames, height=BUCKET.height, width=BUCKET.width,
        num_inference_steps=3, guidance_scale=1.0, max_sequence_length=MAX_SEQUENCE_LENGTH, output_type="latent"))
    assert len(ours) == len(stock) == 3
    for a, b in zip(ours, stock):
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)


def test_lora_adapters_load_in_the_stock_pipelines_wan_lora_loader(family, exported, tmp_path):
    from vidray.config import LoraConfig
    from vidray.models.lora import apply_lora, save_lora_weights

    _, out_dir, _ = exported
    transformer = apply_lora(family.load_diffusion_models(CFG, seed=0).transformer, LoraConfig(rank=4), seed=0)
    with torch.no_grad():  # B starts at zero: give the adapters an effect to compare
        for name, p in transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
    lora_dir = save_lora_weights(transformer, tmp_path / "lora")
    pipe = WanPipeline.from_pretrained(out_dir, local_files_only=True)
    pipe.load_lora_weights(lora_dir, weight_name="pytorch_lora_weights.safetensors")
    latents = torch.randn(family.latent_shape(BUCKET, 1), generator=torch.Generator().manual_seed(0))
    embeds = torch.randn(1, MAX_SEQUENCE_LENGTH, 64, generator=torch.Generator().manual_seed(2))
    mask = torch.ones(1, MAX_SEQUENCE_LENGTH, dtype=torch.bool)
    timesteps = torch.tensor([500.0])
    with torch.no_grad():
        ours = family.predict(transformer, latents, timesteps, embeds, mask)
        base = family.predict(family.load_diffusion_models(CFG, seed=0).transformer, latents, timesteps, embeds, mask)
        stock = family.predict(pipe.transformer, latents, timesteps, embeds, mask)
    assert not torch.allclose(ours, base, atol=1e-4)
    torch.testing.assert_close(stock, ours, atol=1e-5, rtol=1e-5)
