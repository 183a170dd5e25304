"""The CogVideoX 1.0 T2V family against the stock `diffusers.CogVideoXPipeline` (issue 29 part 3), on CPU in fp32.

Parity: the export loads in the stock pipeline offline, and for the same prompts, negative prompts, initial noise,
num_inference_steps, guidance_scale and max_sequence_length, the stock pipeline's `output_type="latent"` latents
(it encodes the prompts itself; laid out (B, F, C, H, W)) equal `vidray.inference.sampler.sample_latents` over
`family.encode_prompt`'s embeddings, and its frames equal `generate_video`'s. The stock pipeline draws its noise laid
out (B, F, C, H, W), so it is given vidray's noise (`initial_noise`, the seed's) permuted as `latents=`. The
family-independent checks are in test_families.py.
"""

import dataclasses
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json  # noqa: E402
import shutil  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from diffusers import CogVideoXPipeline, CogVideoXTransformer3DModel  # noqa: E402

from vidray.config import FlowConfig, ModelConfig  # noqa: E402
from vidray.buckets import Bucket  # noqa: E402
from vidray.inference.sampler import generate_video, initial_noise, sample_latents  # noqa: E402
from vidray.models import cogvideox, get_family  # noqa: E402
from vidray.models.export import inspect_model  # noqa: E402
from vidray.models.export import load_pipeline_folder

BUCKET = Bucket(9, 32, 32)
FLOW = FlowConfig(num_train_timesteps=1000)
PROMPTS = ["a red ball bouncing", "waves on a beach"]
NEGATIVE = ["", "blurry"]
MAX_SEQUENCE_LENGTH = 16
CFG = ModelConfig(family="cogvideox", text_encoder="tiny_random", max_sequence_length=MAX_SEQUENCE_LENGTH)


def _to_pipeline_layout(latents: torch.Tensor) -> torch.Tensor:
    return latents.permute(0, 2, 1, 3, 4)  # (B, C, F, H, W) <-> (B, F, C, H, W)


@pytest.fixture(scope="module")
def family():
    return get_family("cogvideox")


@pytest.fixture(scope="module")
def exported(family, tmp_path_factory):
    components = family.build(CFG, seed=0)
    out_dir = family.save_pipeline(components, tmp_path_factory.mktemp("export") / "diffusers", FLOW)
    pipe = CogVideoXPipeline.from_pretrained(out_dir, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return components, out_dir, pipe


def test_the_export_is_a_cogvideox_pipeline_with_the_v_prediction_ddim_scheduler(exported):
    _, out_dir, pipe = exported
    index = json.loads((out_dir / "model_index.json").read_text())
    assert index["_class_name"] == "CogVideoXPipeline"
    assert type(pipe.scheduler).__name__ == "CogVideoXDDIMScheduler"
    cfg = pipe.scheduler.config
    assert (cfg.prediction_type, cfg.timestep_spacing, cfg.snr_shift_scale, cfg.rescale_betas_zero_snr) == (
        "v_prediction", "trailing", 3.0, True)
    assert type(pipe.text_encoder).__name__ == "T5EncoderModel"
    assert pipe.transformer.config.use_rotary_positional_embeddings
    assert list(out_dir.glob("transformer/*.safetensors")) and list(out_dir.glob("vae/*.safetensors"))


@pytest.mark.parametrize("steps", [4, 5])
@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
def test_stock_pipeline_latents_equal_sample_latents_for_the_same_prompts_and_noise(family, exported,
                                                                                    guidance_scale, steps):
    components, _, pipe = exported
    embeds, mask = family.encode_prompt(components.text_encoder, components.tokenizer, PROMPTS,
                                        max_sequence_length=MAX_SEQUENCE_LENGTH)
    negative_embeds, negative_mask = family.encode_prompt(components.text_encoder, components.tokenizer, NEGATIVE,
                                                          max_sequence_length=MAX_SEQUENCE_LENGTH)
    latent_shape = family.latent_shape(BUCKET, len(PROMPTS))
    noise = initial_noise(latent_shape, seed=5)
    ours = sample_latents(
        family, components.transformer, embeds, mask, latent_shape=latent_shape, num_inference_steps=steps,
        shift=FLOW.shift, num_train_timesteps=FLOW.num_train_timesteps, guidance_scale=guidance_scale,
        negative_prompt_embeds=negative_embeds, negative_prompt_attention_mask=negative_mask,
        latents=noise.clone(),
    )
    stock = pipe(
        prompt=PROMPTS, negative_prompt=NEGATIVE, num_frames=BUCKET.num_frames, height=BUCKET.height,
        width=BUCKET.width, num_inference_steps=steps, guidance_scale=guidance_scale,
        max_sequence_length=MAX_SEQUENCE_LENGTH, latents=_to_pipeline_layout(noise.clone()), output_type="latent",
    ).frames
    assert ours.shape == latent_shape
    torch.testing.assert_close(ours, _to_pipeline_layout(stock), atol=1e-5, rtol=1e-5)


def test_generate_video_equals_stock_pipeline_frames(family, exported):
    components, _, pipe = exported
    frames = generate_video(family, components, PROMPTS, BUCKET, flow=FLOW, num_inference_steps=2,
                            max_sequence_length=MAX_SEQUENCE_LENGTH, seed=3)
    noise = initial_noise(family.latent_shape(BUCKET, len(PROMPTS)), seed=3)
    stock = pipe(
        prompt=PROMPTS, num_frames=BUCKET.num_frames, height=BUCKET.height, width=BUCKET.width,
        num_inference_steps=2, guidance_scale=1.0, max_sequence_length=MAX_SEQUENCE_LENGTH,
        latents=_to_pipeline_layout(noise), output_type="np",
    ).frames  # (B, F, H, W, 3) float in [0, 1]
    assert frames.shape == (2, *BUCKET, 3) and frames.dtype == np.uint8 and stock.shape == frames.shape
    assert np.abs(frames.astype(int) - (stock * 255).round().astype(int)).max() <= 1


def test_encode_prompt_equals_the_pipelines_padding_positions_included(family, exported):
    components, _, pipe = exported
    embeds, mask = family.encode_prompt(components.text_encoder, components.tokenizer, PROMPTS,
                                        max_sequence_length=MAX_SEQUENCE_LENGTH)
    assert embeds.shape == (2, MAX_SEQUENCE_LENGTH, 64) and embeds.dtype == torch.float32 and mask.dtype == torch.bool
    assert 0 < int(mask.sum(dim=1).min()) < MAX_SEQUENCE_LENGTH
    with torch.no_grad():
        stock, _ = pipe.encode_prompt(PROMPTS, do_classifier_free_guidance=False,
                                      max_sequence_length=MAX_SEQUENCE_LENGTH)
    assert torch.equal(embeds, stock)
    assert embeds[~mask].abs().sum() > 0  # no attention mask: padding is encoded, as the pipeline does


def test_latents_are_scaled_by_the_vae_configs_scaling_factor(family, exported):
    components, _, _ = exported
    vae = components.vae
    video = torch.rand(1, 3, *BUCKET, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = family.encode_video(vae, video)
    assert latents.shape == family.latent_shape(BUCKET, 1)
    with torch.no_grad():
        torch.testing.assert_close(latents, vae.encode(video).latent_dist.mode() * vae.config.scaling_factor)
        # CogVideoXPipeline.decode_latents: 1 / scaling_factor * latents (vidray divides: equal to float rounding)
        expected = vae.decode(1 / vae.config.scaling_factor * latents).sample.clamp(-1, 1)
    torch.testing.assert_close(family.decode_latents(vae, latents), expected, atol=1e-6, rtol=0)


def test_the_objective_is_v_prediction_on_the_exported_scheduler(family, exported):
    _, _, pipe = exported
    g = torch.Generator().manual_seed(1)
    latents, noise = torch.randn(3, 16, 3, 4, 4, generator=g), torch.randn(3, 16, 3, 4, 4, generator=g)
    sigmas = torch.tensor([0.0, 0.4173, 1.0])
    t = torch.tensor([0, 417, 999])
    torch.testing.assert_close(family.objective.model_timesteps(sigmas, 1000), t.float())
    torch.testing.assert_close(family.objective.noisy_latents(latents, noise, sigmas),
                               pipe.scheduler.add_noise(latents, noise, t), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(family.objective.training_target(latents, noise, sigmas),
                               pipe.scheduler.get_velocity(latents, noise, t), atol=1e-5, rtol=1e-5)
    pipe.scheduler.set_timesteps(4)
    sigmas = family.objective.inference_sigmas(4, shift=3.0, num_train_timesteps=1000)
    assert torch.equal((sigmas[:-1] * 1000).round().long(), pipe.scheduler.timesteps) and sigmas[-1] < 0
    with pytest.raises(ValueError, match="set flow.num_train_timesteps: 1000"):
        family.objective.inference_sigmas(4, shift=3.0, num_train_timesteps=500)


def _five_b_folder(out_dir, tmp_path):
    """The export with CogVideoX-5b's scheduler config (snr_shift_scale 1.0), as a CogVideoX-5b folder carries."""
    folder = tmp_path / "five_b"
    shutil.copytree(out_dir, folder)
    path = folder / "scheduler" / "scheduler_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "snr_shift_scale": 1.0}))
    return folder


@pytest.mark.parametrize("scheduler_config", [cogvideox.SCHEDULER_CONFIG, cogvideox.SCHEDULER_CONFIG_5B],
                         ids=["2b", "5b"])
def test_the_objective_and_a_sampler_step_follow_the_family_s_scheduler_as_diffusers(scheduler_config):
    from diffusers import CogVideoXDDIMScheduler

    scheduler = CogVideoXDDIMScheduler(**scheduler_config)
    family = cogvideox.CogVideoXFamily(cogvideox.check_scheduler_config(dict(scheduler.config), "test"))
    g = torch.Generator().manual_seed(2)
    latents, noise = torch.randn(3, 16, 3, 4, 4, generator=g), torch.randn(3, 16, 3, 4, 4, generator=g)
    sigmas, t = torch.tensor([0.0, 0.6, 1.0]), torch.tensor([0, 600, 999])
    torch.testing.assert_close(family.objective.noisy_latents(latents, noise, sigmas),
                               scheduler.add_noise(latents, noise, t),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(family.objective.training_target(latents, noise, sigmas),
                               scheduler.get_velocity(latents, noise, t), atol=1e-5, rtol=1e-5)
    scheduler.set_timesteps(4)
    steps = family.objective.inference_sigmas(4, shift=1.0, num_train_timesteps=1000)
    model_pred = torch.randn(1, 16, 3, 4, 4, generator=g)
    for i in (0, 3):  # a middle step (999 -> 749) and the last (249 -> the clean end, final alpha 1)
        ours = family.objective.sampler_step(latents[:1], model_pred, steps[i:i + 1], steps[i + 1:i + 2])
        stock = scheduler.step(model_pred, scheduler.timesteps[i], latents[:1], return_dict=False)[0]
        torch.testing.assert_close(ours, stock, atol=1e-5, rtol=1e-5)


def test_a_cogvideox_5b_scheduler_folder_trains_samples_and_exports_on_its_own_schedule(family, exported, tmp_path):
    from vidray.train.step import flow_matching_step_loss

    _, out_dir, _ = exported
    folder = _five_b_folder(out_dir, tmp_path)
    cfg = ModelConfig(family="cogvideox", init="pretrained", pretrained_path=str(folder),
                      max_sequence_length=MAX_SEQUENCE_LENGTH)
    components = family.build(cfg, seed=0)
    embeds, mask = torch.randn(1, 4, 64), torch.ones(1, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"^this CogVideoX transformer has snr_shift_scale=1.0, but the family it is "
                                         r"called through is bound to snr_shift_scale=3.0: use the family of its own "
                                         r"model \(family.for_model\(model_cfg\)") as err:
        family.predict(components.transformer, torch.zeros(1, 16, 3, 4, 4), torch.tensor([500.0]), embeds, mask)
    assert "\n" not in str(err.value)
    family = family.for_model(cfg)  # configs only: the folder's scheduler, no weights
    assert (family.scheduler_config, family.patch_size_t) == (cogvideox.SCHEDULER_CONFIG_5B, None)
    five_b = get_family("cogvideox").for_transformer(components.transformer)
    assert (five_b.scheduler_config, five_b.patch_size_t) == (cogvideox.SCHEDULER_CONFIG_5B, None)
    # training: the loss of a batch is the v-prediction MSE on the 5b schedule (diffusers' add_noise, get_velocity)
    from diffusers import CogVideoXDDIMScheduler

    scheduler = CogVideoXDDIMScheduler(**cogvideox.SCHEDULER_CONFIG_5B)
    latents = torch.randn(1, 16, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    embeds, mask = family.encode_prompt(components.text_encoder, components.tokenizer, PROMPTS[:1],
                                        max_sequence_length=MAX_SEQUENCE_LENGTH)
    loss = flow_matching_step_loss(family, components.transformer, latents, embeds, mask, FLOW,
                                   torch.Generator().manual_seed(4))
    g = torch.Generator().manual_seed(4)
    noise = torch.randn(latents.shape, generator=g)
    from vidray.diffusion.flow_matching import sample_sigmas

    t = (sample_sigmas(1, FLOW, generator=g).double() * 1000).round().long()
    with torch.no_grad():
        pred = family.predict(components.transformer, scheduler.add_noise(latents, noise, t), t.float(), embeds, mask)
    expected = (pred - scheduler.get_velocity(latents, noise, t)).pow(2).mean()
    torch.testing.assert_close(loss.detach(), expected, atol=1e-6, rtol=1e-5)
    # sampling: the stock pipeline of the folder (its 5b scheduler) gives vidray's latents
    pipe = CogVideoXPipeline.from_pretrained(folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    latent_shape = family.latent_shape(BUCKET, 1)
    noise = initial_noise(latent_shape, seed=6)
    ours = sample_latents(family, components.transformer, embeds, mask, latent_shape=latent_shape,
                          num_inference_steps=4, shift=FLOW.shift, num_train_timesteps=1000, latents=noise.clone())
    stock = pipe(prompt=PROMPTS[:1], num_frames=BUCKET.num_frames, height=BUCKET.height, width=BUCKET.width,
                 num_inference_steps=4, guidance_scale=1.0, max_sequence_length=MAX_SEQUENCE_LENGTH,
                 latents=_to_pipeline_layout(noise.clone()), output_type="latent").frames
    torch.testing.assert_close(ours, _to_pipeline_layout(stock), atol=1e-5, rtol=1e-5)
    two_b = exported[2](prompt=PROMPTS[:1], num_frames=BUCKET.num_frames, height=BUCKET.height, width=BUCKET.width,
                        num_inference_steps=4, guidance_scale=1.0, max_sequence_length=MAX_SEQUENCE_LENGTH,
                        latents=_to_pipeline_layout(noise.clone()), output_type="latent").frames
    assert (two_b - stock).abs().max() > 1e-2  # the same weights on 2b's schedule sample other latents
    # the export of a model fine-tuned from it carries its scheduler
    export = family.save_pipeline(components, tmp_path / "export", FLOW)
    saved = json.loads((export / "scheduler" / "scheduler_config.json").read_text())
    assert saved["snr_shift_scale"] == 1.0 and saved["timestep_spacing"] == "trailing"


def test_a_transformer_of_another_schedule_than_the_family_s_is_refused_in_one_line(family, exported, tmp_path):
    components, out_dir, _ = exported
    five_b = family.for_model(ModelConfig(family="cogvideox", init="pretrained",
                                          pretrained_path=str(_five_b_folder(out_dir, tmp_path))))
    embeds, mask = torch.randn(1, 4, 64), torch.ones(1, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"^this CogVideoX transformer has snr_shift_scale=3.0, but the family it is "
                                         r"called through is bound to snr_shift_scale=1.0: use the family of its own "
                                         r"model") as err:
        five_b.predict(components.transformer, torch.zeros(1, 16, 1, 4, 4), torch.tensor([500.0]), embeds, mask)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("change, message", [
    ({"prediction_type": "epsilon"}, 'scheduler prediction_type=.epsilon., .* set prediction_type: "v_prediction"'),
    ({"timestep_spacing": "linspace"}, 'set timestep_spacing: "trailing" in scheduler/scheduler_config.json'),
    ({"clip_sample": True}, "set clip_sample: false"),
    ({"num_train_timesteps": 500}, "set num_train_timesteps: 1000"),
    ({"trained_betas": [0.1] * 1000}, "set trained_betas: null"),
    ({"beta_schedule": "squaredcos_cap_v2"}, "follows 'linear' or 'scaled_linear' only"),
    ({"snr_shift_scale": 0.0}, "snr_shift_scale=0.0 must be a number > 0"),
    ({"_class_name": "CogVideoXDPMScheduler"}, "scheduler is CogVideoXDPMScheduler, .* set _class_name to "
                                                "CogVideoXDDIMScheduler"),
])
def test_a_scheduler_config_the_family_cannot_follow_is_one_line_naming_the_key_and_the_fix(change, message):
    with pytest.raises(ValueError, match=f"^pretrained_path '/x': .*{message}") as err:
        cogvideox.check_scheduler_config({**cogvideox.SCHEDULER_CONFIG, **change}, "pretrained_path '/x'")
    assert "\n" not in str(err.value)
    checked = cogvideox.check_scheduler_config(
        {"_class_name": "CogVideoXDDIMScheduler", **cogvideox.SCHEDULER_CONFIG_5B, "beta_end": 0.02,
         "rescale_betas_zero_snr": False, "set_alpha_to_one": False, "clip_sample_range": 2.0}, "x")
    assert checked == {**cogvideox.SCHEDULER_CONFIG_5B, "beta_end": 0.02, "rescale_betas_zero_snr": False,
                       "set_alpha_to_one": False}


def test_vidray_train_refuses_a_folder_with_a_scheduler_it_cannot_follow_on_the_driver(family, exported, tmp_path):
    _, out_dir, _ = exported
    folder = _five_b_folder(out_dir, tmp_path)
    cfg = ModelConfig(family="cogvideox", init="pretrained", pretrained_path=str(folder))
    family.check_trainable(cfg)  # 5b's scheduler trains; nothing is loaded
    assert family.scheduler_config == cogvideox.SCHEDULER_CONFIG  # the registered family is left as it was
    path = folder / "scheduler" / "scheduler_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "prediction_type": "epsilon"}))
    with pytest.raises(ValueError, match=f"^pretrained_path '{folder}': scheduler prediction_type='epsilon'") as err:
        family.check_trainable(cfg)
    assert "\n" not in str(err.value)


def test_a_transformer_without_rotary_positions_takes_exactly_max_text_seq_length_tokens(family):
    torch.manual_seed(0)
    transformer = CogVideoXTransformer3DModel(num_attention_heads=2, attention_head_dim=16, in_channels=16,
                                              out_channels=16, time_embed_dim=32, text_embed_dim=64, num_layers=1,
                                              sample_width=4, sample_height=4, sample_frames=9,
                                              max_text_seq_length=8)  # the CogVideoX-2b layout: sincos positions
    latents = torch.randn(1, 16, 3, 4, 4)
    embeds, mask = torch.randn(1, 8, 64), torch.ones(1, 8, dtype=torch.bool)
    pred = family.predict(transformer, latents, torch.tensor([500.0]), embeds, mask)
    assert pred.shape == latents.shape
    with pytest.raises(ValueError, match="set model.max_sequence_length: 8"):
        family.predict(transformer, latents, torch.tensor([500.0]), embeds[:, :4], mask[:, :4])
    assert family.probe_loss(transformer, transformer).ndim == 0


def test_load_pretrained_round_trips_the_export_and_the_build_functions_agree(family, exported):
    components, out_dir, _ = exported
    cfg = ModelConfig(family="cogvideox", init="pretrained", pretrained_path=str(out_dir))
    loaded = family.build(cfg, seed=123)
    for module in ("transformer", "vae", "text_encoder"):
        saved, reloaded = getattr(components, module).state_dict(), getattr(loaded, module).state_dict()
        assert saved.keys() == reloaded.keys() and saved, module
        assert all(torch.equal(saved[k], reloaded[k]) for k in saved), module
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


@pytest.mark.slow  # 37 s on 2 cores: four builds of the tiny model, each with CogVideoX's VAE
def test_the_tiny_preset_build_functions_agree_with_build(family):
    built = family.build(CFG, seed=7)
    alone = family.load_diffusion_models(CFG, seed=7).transformer.state_dict()
    state = built.transformer.state_dict()
    assert state.keys() == alone.keys() and all(torch.equal(state[k], alone[k]) for k in state)
    encoders = family.build_encoders(CFG, seed=7)
    assert all(torch.equal(encoders.vae.state_dict()[k], v) for k, v in built.vae.state_dict().items())
    assert all(torch.equal(family.load_latent_models(CFG, seed=7).vae.state_dict()[k], v)
               for k, v in built.vae.state_dict().items())
    assert family.no_grad_parameter_names(family.load_diffusion_models(CFG, seed=7).transformer) == []
    assert family.prompt_embeds_dim(built.transformer) == 64


def test_a_folder_that_is_not_cogvideox_t2v_is_refused_in_one_line_naming_it(family, exported, tmp_path):
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
    (other / "model_index.json").write_text(json.dumps({**index, "_class_name": "WanPipeline"}))
    with pytest.raises(ValueError, match=f"'{other}' holds a WanPipeline pipeline, not a CogVideoXPipeline: "
                                         "set model.family") as err:
        family.load_diffusion_models(ModelConfig(family="cogvideox", init="pretrained", pretrained_path=str(other)),
                                 seed=0).transformer
    assert "\n" not in str(err.value)
    (other / "model_index.json").write_text(json.dumps(index))
    config = json.loads((other / "scheduler" / "scheduler_config.json").read_text())
    (other / "scheduler" / "scheduler_config.json").write_text(json.dumps({**config, "timestep_spacing": "leading"}))
    with pytest.raises(ValueError, match=f"'{other}': scheduler timestep_spacing='leading', but .* set "
                                         'timestep_spacing: "trailing" in scheduler/scheduler_config.json'):
        load_pipeline_folder(family, other)
    (other / "scheduler" / "scheduler_config.json").write_text(json.dumps(config))
    transformer_config = json.loads((other / "transformer" / "config.json").read_text())
    (other / "transformer" / "config.json").write_text(json.dumps({**transformer_config, "patch_size_t": 2}))
    with pytest.raises(ValueError, match=f"'{other}': transformer patch_size_t=2 but vae invert_scale_latents=false: "
                                         "a CogVideoX 1.5 model"):
        family.load_diffusion_models(ModelConfig(family="cogvideox", init="pretrained", pretrained_path=str(other)),
                                 seed=0).transformer


def test_a_stock_cogvideox_folder_is_inspected_as_cogvideox_with_226_tokens(exported, tmp_path):
    _, out_dir, _ = exported
    stock = tmp_path / "stock"
    shutil.copytree(out_dir, stock)  # no vidray_job.yaml: as a stock CogVideoX folder
    info = inspect_model(stock)
    assert (info.family_name, info.max_sequence_length, info.buckets) == ("cogvideox", 226, [])


def test_the_bucket_rule_is_8k_plus_1_frames_because_the_vae_decodes_odd_latent_counts_only(family, exported):
    components, _, _ = exported
    assert family.latent_shape(Bucket(17, 32, 48), 1) == (1, 16, 5, 4, 6)
    with pytest.raises(ValueError, match=r"num_frames must be 1 or k\*8\+1"):
        family.latent_shape(Bucket(5, 32, 32), 1)
    with torch.no_grad():  # why: 2 latent frames (5 frames) decode to 8 frames, 3 (9 frames) to 9
        assert components.vae.decode(torch.zeros(1, 16, 2, 4, 4)).sample.shape[2] == 8
        assert components.vae.decode(torch.zeros(1, 16, 3, 4, 4)).sample.shape[2] == 9


@pytest.mark.parametrize("text_encoder", ["tiny_random", "minilm"])
def test_the_planners_shape_of_a_cogvideox_tiny_job_is_the_model_the_family_builds(family, text_encoder):
    from vidray.models.presets import model_preset
    from vidray.train.plan import count_model

    preset = model_preset("cogvideox", "tiny", text_encoder)
    assert preset.name == "cogvideox-tiny" and preset.family == "cogvideox"
    transformer = family.load_diffusion_models(ModelConfig(family="cogvideox", text_encoder=text_encoder),
                                               seed=0).transformer
    assert count_model(preset).total == sum(p.numel() for p in transformer.parameters())


def test_the_shipped_cogvideox_config_builds_the_cogvideox_family_for_its_buckets(family):
    from pathlib import Path

    from vidray.config import load_job_config

    job = load_job_config(Path(__file__).resolve().parents[2] / "jobs" / "configs" / "cogvideox_t2v_tiny.yaml")
    assert get_family(job.model.family) is family
    transformer = family.load_diffusion_models(job.model, seed=job.train.seed).transformer
    for bucket in job.data.buckets:
        assert family.latent_shape(bucket, 1)[1] == transformer.config.in_channels
