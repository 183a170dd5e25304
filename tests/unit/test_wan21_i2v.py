"""Wan 2.1 image-to-video with its CLIP image encoder (`model.i2v.image_encoder`) against the stock
`diffusers.WanImageToVideoPipeline` (issue 29 part 2), on CPU in fp32, with tiny random models (a random
`CLIPVisionModel` from a `CLIPVisionConfig`, a `CLIPImageProcessor` configured here: nothing is downloaded).

Parity: the export loads in the stock pipeline offline WITH `image_encoder` and `image_processor`, and for the same
prompt embeddings, image (and last image), seed, steps and guidance, the stock pipeline's latents equal
`vidray.inference.sampler.sample_latents` over the family's latent condition and CLIP `image_embeds`. The CLIP
embeddings of a training clip equal the stock pipeline's `encode_image` of the clip's own first (and last) frame.
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
from transformers import CLIPVisionModel  # noqa: E402

from vidray.config import ConfigError, FlowConfig, I2VConfig, ModelConfig, job_config_from_dict  # noqa: E402
from vidray.buckets import Bucket  # noqa: E402
from vidray.inference.sampler import generate_video, sample_latents  # noqa: E402
from vidray.models import get_family  # noqa: E402
from vidray.models.export import inspect_model, load_model, write_job_file  # noqa: E402
from vidray.models.vae import frames_to_video  # noqa: E402
from vidray.train.step import flow_matching_step_loss, sample_generator  # noqa: E402

from tests.conftest import clip_condition, guided_prompts  # noqa: E402

FAMILY = get_family("wan")
BUCKET = Bucket(9, 32, 32)
FLOW = FlowConfig(shift=3.0, num_train_timesteps=1000)
MAX_SEQUENCE_LENGTH = 512  # Wan's transformer splits its context at 512 text tokens when it takes CLIP embeddings
CFG = ModelConfig(family="wan", text_encoder="tiny_random", max_sequence_length=MAX_SEQUENCE_LENGTH,
                  i2v=I2VConfig(image_encoder=True))
FLF_CFG = dataclasses.replace(CFG, i2v=I2VConfig(condition="first_last", image_encoder=True))
NO_CLIP_CFG = dataclasses.replace(CFG, i2v=I2VConfig())
JOB = {"name": "wan21-i2v", "model": {"family": "wan", "text_encoder": "tiny_random",
                                      "max_sequence_length": MAX_SEQUENCE_LENGTH,
                                      "i2v": {"condition": "first", "image_encoder": True}},
       "data": {"buckets": [list(BUCKET)]}, "flow": {"shift": FLOW.shift}}


def random_image(seed: int, height: int = 40, width: int = 48) -> Image.Image:
    """An RGB image of another size than the bucket's and CLIP's (both resize it)."""
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8))


def export(cfg: ModelConfig, out_dir) -> tuple:
    components = FAMILY.build(cfg, seed=0)
    out_dir = FAMILY.save_pipeline(components, out_dir, FLOW)
    pipe = WanImageToVideoPipeline.from_pretrained(out_dir, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return components, out_dir, pipe


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    components, out_dir, pipe = export(CFG, tmp_path_factory.mktemp("export") / "diffusers")
    write_job_file(out_dir, job_config_from_dict(JOB))
    return components, out_dir, pipe


@pytest.fixture(scope="module")
def exported_flf(tmp_path_factory):
    return export(FLF_CFG, tmp_path_factory.mktemp("flf") / "diffusers")


@pytest.fixture(scope="module")
def prompts(exported):
    return guided_prompts(FAMILY, exported[0], MAX_SEQUENCE_LENGTH)


def test_the_wan21_preset_has_a_clip_image_branch_and_exports_the_stock_pipeline_with_its_image_encoder(exported):
    components, out_dir, pipe = exported
    config = components.transformer.config
    assert (config.in_channels, config.image_dim, config.added_kv_proj_dim, config.pos_embed_seq_len) == \
        (36, 32, 32, None)
    assert isinstance(components.image_encoder, CLIPVisionModel) and not components.image_encoder.training
    assert not any(p.requires_grad for p in components.image_encoder.parameters())
    shape = FAMILY.latent_shape(BUCKET, 1)
    assert FAMILY.condition(components.transformer, latent_shape=shape).image_embeds.shape == (1, 257, 32)
    assert FAMILY.condition(FAMILY.load_diffusion_models(NO_CLIP_CFG, seed=0).transformer, latent_shape=shape).image_embeds is None
    index = json.loads((out_dir / "model_index.json").read_text())
    assert index["_class_name"] == "WanImageToVideoPipeline"
    assert index["image_encoder"] == ["transformers", "CLIPVisionModel"] and index["image_processor"][0] is not None
    assert isinstance(pipe.image_encoder, CLIPVisionModel) and pipe.image_processor is not None
    # the transformer alone equals the whole build's
    alone = FAMILY.load_diffusion_models(CFG, seed=0).transformer.state_dict()
    assert all(torch.equal(value, components.transformer.state_dict()[key]) for key, value in alone.items())
    image_encoder = FAMILY.load_condition_models(CFG, seed=0, text=False).image_encoder  # the image encoder alone too
    assert all(torch.equal(v, components.image_encoder.state_dict()[k]) for k, v in image_encoder.state_dict().items())
    assert FAMILY.load_condition_models(NO_CLIP_CFG, seed=0, text=False).image_encoder is None
    assert FAMILY.no_grad_parameter_names(components.transformer) == []  # the image branch trains too


def test_image_embeds_are_the_stock_pipelines_encode_image(exported):
    components, _, pipe = exported
    image = random_image(0)
    ours = FAMILY.condition(components.transformer, encoders=components, image=image, bucket=BUCKET).image_embeds
    assert ours.shape == (1, 257, 32) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, pipe.encode_image(image, "cpu"), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
def test_stock_pipeline_latents_equal_sample_latents_for_the_same_image(exported, prompts, guidance_scale):
    components, _, pipe = exported
    embeds, mask, negative, negative_mask = prompts
    image = random_image(0)
    condition = FAMILY.condition(components.transformer, encoders=components, image=image, bucket=BUCKET,
                                 latent_shape=FAMILY.latent_shape(BUCKET, 2))
    assert condition.image_embeds.shape == (2, 257, 32)  # the image's, repeated over the prompts
    ours = sample_latents(
        FAMILY, components.transformer, embeds, mask, latent_shape=FAMILY.latent_shape(BUCKET, 2),
        num_inference_steps=3, shift=FLOW.shift, num_train_timesteps=FLOW.num_train_timesteps,
        guidance_scale=guidance_scale, negative_prompt_embeds=negative, negative_prompt_attention_mask=negative_mask,
        generator=torch.Generator().manual_seed(5), **condition.predict_kwargs(),
    )
    stock = pipe(
        image=image, prompt_embeds=embeds, negative_prompt_embeds=negative, num_frames=BUCKET.num_frames,
        height=BUCKET.height, width=BUCKET.width, num_inference_steps=3, guidance_scale=guidance_scale,
        generator=torch.Generator().manual_seed(5), output_type="latent",
    ).frames
    assert ours.shape == stock.shape == FAMILY.latent_shape(BUCKET, 2)
    torch.testing.assert_close(ours, stock, atol=1e-5, rtol=1e-5)


def test_a_first_and_last_frame_model_matches_the_stock_pipeline_with_both_images(exported_flf, prompts):
    components, _, pipe = exported_flf
    assert components.transformer.config.pos_embed_seq_len == 2 * 257  # Wan 2.1 FLF2V's layout
    embeds, mask = prompts[0][:1], prompts[1][:1]
    first, last = random_image(1), random_image(2, 32, 32)
    condition = FAMILY.condition(components.transformer, encoders=components, image=first, last_image=last,
                                 bucket=BUCKET)
    assert condition.image_embeds.shape == (1, 514, 32)
    ours = sample_latents(FAMILY, components.transformer, embeds, mask, latent_shape=FAMILY.latent_shape(BUCKET, 1),
                          num_inference_steps=2, shift=FLOW.shift, num_train_timesteps=FLOW.num_train_timesteps,
                          generator=torch.Generator().manual_seed(7), **condition.predict_kwargs())
    stock = pipe(image=first, last_image=last, prompt_embeds=embeds, num_frames=BUCKET.num_frames,
                 height=BUCKET.height, width=BUCKET.width, num_inference_steps=2, guidance_scale=1.0,
                 generator=torch.Generator().manual_seed(7), output_type="latent").frames
    torch.testing.assert_close(ours, stock, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("condition", ["first", "first_last"])
def test_the_image_embeds_of_a_training_clip_equal_the_pipelines_for_its_own_frames(exported, exported_flf,
                                                                                    condition):
    components, _, pipe = exported if condition == "first" else exported_flf
    frames = np.random.RandomState(3).randint(0, 256, (2, *BUCKET, 3), dtype=np.uint8)  # (B, F, H, W, 3)
    ours = clip_condition(FAMILY, CFG, components, frames_to_video(frames), condition).image_embeds
    for b in range(2):
        pictures = [Image.fromarray(frames[b, 0])]
        if condition == "first_last":
            pictures.append(Image.fromarray(frames[b, -1]))
        stock = pipe.encode_image(pictures, "cpu").reshape(1, -1, 32)  # as the transformer views (2, 257, D)
        torch.testing.assert_close(ours[b:b + 1], stock, atol=1e-6, rtol=1e-6)
    assert ours.shape == (2, 257 * (2 if condition == "first_last" else 1), 32)
    # and the latent condition is the one the A14B layout builds (tests/unit/test_wan_i2v.py checks it)
    latent = clip_condition(FAMILY, CFG, components, frames_to_video(frames[:1]), condition).inpaint_latents
    assert latent.shape == (1, 20, 3, 4, 4)


def test_predict_refuses_missing_misshapen_or_stray_image_embeds(exported):
    components, _, _ = exported
    shape = FAMILY.latent_shape(BUCKET, 2)
    latents, timesteps = torch.zeros(shape), torch.full((2,), 500.0)
    embeds = torch.zeros(2, MAX_SEQUENCE_LENGTH, components.transformer.config.text_dim)
    mask = torch.ones(2, MAX_SEQUENCE_LENGTH, dtype=torch.bool)
    empty, no_image = FAMILY.condition(components.transformer, latent_shape=shape).predict_kwargs().values()
    assert no_image.shape == (2, 257, 32) and no_image.abs().max() == 0
    assert FAMILY.predict(components.transformer, latents, timesteps, embeds, mask, inpaint_latents=empty,
                          image_embeds=no_image).shape == shape
    with pytest.raises(ValueError, match=r"needs its CLIP image_embeds \(2, 257, 32\), got None"):
        FAMILY.predict(components.transformer, latents, timesteps, embeds, mask, inpaint_latents=empty)
    with pytest.raises(ValueError, match=r"got \(2, 514, 32\)"):
        FAMILY.predict(components.transformer, latents, timesteps, embeds, mask, inpaint_latents=empty,
                       image_embeds=torch.zeros(2, 514, 32))
    with pytest.raises(ValueError, match="takes no CLIP image_embeds"):
        FAMILY.predict(FAMILY.load_diffusion_models(NO_CLIP_CFG, seed=0).transformer, latents, timesteps, embeds, mask,
                       inpaint_latents=empty, image_embeds=no_image)


def test_condition_dropout_drops_the_latent_condition_and_the_image_embeds_together(exported, monkeypatch):
    components, _, _ = exported
    shape = FAMILY.latent_shape(BUCKET, 4)
    latents = torch.randn(shape)
    prompt_embeds = torch.randn(4, MAX_SEQUENCE_LENGTH, components.transformer.config.text_dim)
    mask = torch.ones(4, MAX_SEQUENCE_LENGTH, dtype=torch.bool)
    inpaint = torch.rand(4, 20, *shape[2:]) + 1
    image_embeds = torch.rand(4, 257, 32) + 1
    seen = {}
    predict = FAMILY.predict

    def spy(transformer, *args, **kwargs):
        seen.update(kwargs)
        return predict(transformer, *args, **kwargs)

    monkeypatch.setattr(FAMILY, "predict", spy)
    generators = [sample_generator(0, 1, k) for k in range(4)]
    loss = flow_matching_step_loss(FAMILY, components.transformer, latents, prompt_embeds, mask, FLOW, generators,
                                   inpaint_latents=inpaint, condition_dropout=0.5, image_embeds=image_embeds)
    assert torch.isfinite(loss)
    kept_latent = seen["inpaint_latents"].flatten(1).abs().amax(1) > 0
    kept_image = seen["image_embeds"].flatten(1).abs().amax(1) > 0
    assert torch.equal(kept_latent, kept_image) and 0 < int(kept_latent.sum()) < 4  # seeds 0..3: both kinds
    assert torch.equal(seen["image_embeds"][kept_image], image_embeds[kept_image])


def test_the_export_loads_as_wan21_and_generate_with_an_image_is_the_stock_pipelines_video(exported, tmp_path):
    components, out_dir, pipe = exported
    info = inspect_model(out_dir)
    assert info.image_to_video and FAMILY.image_inputs(info) == 1
    image = random_image(4)
    stock = shutil.copytree(out_dir, tmp_path / "stock")  # a stock folder without vidray's job file
    (stock / "vidray_job.yaml").unlink()
    assert inspect_model(stock).max_sequence_length == MAX_SEQUENCE_LENGTH
    for folder in (out_dir, stock):
        loaded = load_model(folder)
        assert FAMILY.condition(loaded.components.transformer, latent_shape=(1, 16, 3, 4, 4)).image_embeds is not None
        assert isinstance(loaded.components.image_encoder, CLIPVisionModel)
        ours = generate_video(FAMILY, loaded.components, ["a cat"], BUCKET, flow=FLOW, num_inference_steps=2,
                              max_sequence_length=MAX_SEQUENCE_LENGTH, seed=3, image=image)
        video = pipe(image=image, prompt="a cat", num_frames=BUCKET.num_frames, height=BUCKET.height,
                     width=BUCKET.width, num_inference_steps=2, guidance_scale=1.0,
                     generator=torch.Generator().manual_seed(3), output_type="np").frames  # (1, F, H, W, 3) in [0, 1]
        assert ours.shape == (1, *BUCKET, 3)
        assert np.abs(ours.astype(np.int16) - np.round(video * 255).astype(np.int16)).max() <= 1
    without = generate_video(FAMILY, load_model(stock).components, ["a cat"], BUCKET, flow=FLOW,
                             num_inference_steps=2, max_sequence_length=MAX_SEQUENCE_LENGTH, seed=3)
    assert without.shape == (1, *BUCKET, 3)  # text only: zero condition and zero image embeddings
    whole = load_model(stock).components
    for name in ("transformer", "vae", "text_encoder"):  # what each serve stage loads alone
        part = getattr(load_model(stock, components=(name,)).components, name)
        assert all(torch.equal(v, getattr(whole, name).state_dict()[k]) for k, v in part.state_dict().items())


def test_init_pretrained_loads_a_wan21_folder_and_its_task_must_be_the_configs(exported):
    components, out_dir, _ = exported
    loaded = FAMILY.build(dataclasses.replace(CFG, init="pretrained", pretrained_path=str(out_dir)), seed=1)
    for name in ("transformer", "image_encoder"):
        want = getattr(components, name).state_dict()
        assert all(torch.equal(v, want[k]) for k, v in getattr(loaded, name).state_dict().items())
    encoders = FAMILY.build_encoders(dataclasses.replace(CFG, init="pretrained", pretrained_path=str(out_dir)),
                                     seed=1)
    assert isinstance(encoders.image_encoder, CLIPVisionModel) and encoders.image_processor is not None
    cfg = dataclasses.replace(NO_CLIP_CFG, init="pretrained", pretrained_path=str(out_dir))
    for build in (FAMILY.build, FAMILY.load_diffusion_models):
        with pytest.raises(ValueError, match="takes CLIP image embeddings .*set model.i2v.image_encoder: true") as e:
            build(cfg, seed=0)
        assert "\n" not in str(e.value)


def test_a_folder_with_image_dim_but_no_image_encoder_or_the_reverse_fails_in_one_line(exported, tmp_path):
    _, out_dir, _ = exported
    no_clip = shutil.copytree(out_dir, tmp_path / "no-clip")
    index = json.loads((no_clip / "model_index.json").read_text())
    (no_clip / "model_index.json").write_text(json.dumps({**index, "image_encoder": [None, None]}))
    stray = shutil.copytree(out_dir, tmp_path / "stray")
    config = json.loads((stray / "transformer" / "config.json").read_text())
    (stray / "transformer" / "config.json").write_text(json.dumps({**config, "image_dim": None}))
    cases = [(no_clip, rf"{no_clip}'?: the transformer takes CLIP image embeddings .* has no image_encoder: add "),
             (stray, rf"{stray}'? has image_encoder and image_processor but its transformer takes no CLIP .*remove")]
    for folder, message in cases:
        cfg = dataclasses.replace(CFG, init="pretrained", pretrained_path=str(folder))
        for build in (FAMILY.build, FAMILY.load_diffusion_models, FAMILY.build_encoders):
            with pytest.raises(ValueError, match=message) as err:
                build(cfg, seed=0)
            assert "\n" not in str(err.value)


@pytest.mark.parametrize("model, message", [
    ({"family": "easyanimate", "max_sequence_length": 512}, "model.family easyanimate takes no CLIP image embeddings"),
    ({"max_sequence_length": 32}, "needs model.max_sequence_length 512 .* set model.max_sequence_length: 512"),
    ({"experts": {"boundary_ratio": 0.9}}, "with model.experts .* is not a Wan model"),
])
def test_a_bad_image_encoder_section_fails_at_load_in_one_line(model, message):
    raw = {**JOB, "model": {**JOB["model"], **model}}
    with pytest.raises(ConfigError, match=message) as err:
        job_config_from_dict(raw)
    assert "\n" not in str(err.value)


def test_a_last_image_for_a_one_image_model_is_refused_in_one_line(exported):
    from vidray.errors import UserError

    components, _, _ = exported
    with pytest.raises(UserError, match=r"takes image embeddings \(257, 32\).*drop --last-image"):
        generate_video(FAMILY, components, ["a cat"], BUCKET, flow=FLOW, num_inference_steps=1,
                       max_sequence_length=MAX_SEQUENCE_LENGTH, image=random_image(1), last_image=random_image(2))


def test_the_encode_stage_hands_and_caches_each_clips_clip_embeddings_beside_its_latent_condition(tmp_path):
    """The VAE stage of a Wan 2.1 I2V run embeds each clip's own first frame with the model's CLIP (the frames it
    decodes anyway), keeps the embeddings in the clip's latent cache entry under an id that names the image encoder
    (a run without CLIP never meets them), and a hit or the decode operator's cached entry gives the same bits."""
    from vidray.data.encode import EncodeStage, latents_identity, pack_cached_latents, vae_identity

    def stage(model: ModelConfig, cache: str = "") -> EncodeStage:
        return EncodeStage("vae", dataclasses.asdict(model), 0, max_sequence_length=model.max_sequence_length,
                           latent_cache=cache, hot_bytes=0)

    def batch(frames, shas):
        return {"i": np.array([0]), "frames": frames[None], "clip_sha": np.array([json.dumps(shas)]),
                "captions": np.array([json.dumps(["x"] * len(shas))])}

    frames = np.random.default_rng(5).integers(0, 256, size=(2, *BUCKET, 3), dtype=np.uint8)
    shas = ["e" * 64, "f" * 64]
    first_stage = stage(CFG, str(tmp_path))
    first = first_stage(batch(frames, shas))
    assert first["image_embeds"].shape == (1, 2, 257, 32) and first["image_embeds"].dtype == np.float32
    assert first["inpaint_latents"].shape == (1, 2, 20, 3, 4, 4)
    encoders = FAMILY.build_encoders(CFG, seed=0)
    want = FAMILY.condition(CFG, encoders=encoders, clip=frames_to_video(frames)).image_embeds
    np.testing.assert_allclose(first["image_embeds"][0], want.numpy(), rtol=1e-5, atol=1e-6)
    assert vae_identity(dataclasses.asdict(CFG), 0) == first_stage.vae_id
    assert first_stage.vae_id != stage(NO_CLIP_CFG).vae_id != latents_identity("", dataclasses.asdict(CFG))
    again = stage(CFG, str(tmp_path))(batch(frames, shas))
    assert (again["vae_hits"][0], again["vae_misses"][0]) == (2, 0)
    np.testing.assert_array_equal(again["image_embeds"], first["image_embeds"])
    entry = {name: first[name][0, 1] for name in ("latents", "inpaint_latents", "image_embeds")}
    blank = frames.copy()
    blank[1] = 0  # the decode operator read clip 1 from the cache: not decoded
    out = stage(CFG)({**batch(blank, ["", ""]), "cached_latents": np.array(
        [pack_cached_latents(first_stage.vae_id, {1: entry})], dtype=object)})
    np.testing.assert_array_equal(out["image_embeds"][0, 1], entry["image_embeds"])
    np.testing.assert_array_equal(out["image_embeds"][0, 0], first["image_embeds"][0, 0])


def test_the_end_of_run_export_holds_the_jobs_image_encoder(tmp_path):
    """What rank 0 writes after training (`vidray.train.loop._export_pipeline`): the trained transformer with the
    job's VAE, text encoder AND image encoder, a stock folder the pipeline loads."""
    from vidray.train.loop import _export_pipeline

    job = job_config_from_dict(JOB)
    transformer = FAMILY.load_diffusion_models(job.model, seed=job.train.seed).transformer
    out = _export_pipeline(FAMILY, transformer, job, None, str(tmp_path))
    index = json.loads((tmp_path / "diffusers" / "model_index.json").read_text())
    assert out == str(tmp_path / "diffusers") and index["image_encoder"] == ["transformers", "CLIPVisionModel"]
    pipe = WanImageToVideoPipeline.from_pretrained(out, local_files_only=True)
    assert isinstance(pipe.image_encoder, CLIPVisionModel) and pipe.transformer.config.image_dim == 32


def test_the_videos_api_refuses_an_image_for_a_first_and_last_frame_model_naming_why(exported, exported_flf, tmp_path):
    # A new user's trial: a served Wan 2.1 FLF2V model queued every input_reference request, then failed it as
    # internal_error (its CLIP takes two images; the Videos API gives one). It is now a 400 naming why.
    import io

    from vidray.serve.api import _check_image
    from vidray.serve.errors import ApiLimits, RequestError
    from vidray.serve.app import ServeSettings, model_spec

    flf = tmp_path / "flf"
    shutil.copytree(exported_flf[1], flf)
    assert FAMILY.image_inputs(inspect_model(flf)) == 2  # a stock folder: its transformer config says
    write_job_file(flf, job_config_from_dict({**JOB, "model": {**JOB["model"], "i2v": {"condition": "first_last",
                                                                                      "image_encoder": True}}}))
    png = io.BytesIO()
    random_image(0).save(png, format="PNG")
    spec = model_spec(ServeSettings(model_path=str(flf), store_dir=str(tmp_path / "s")), inspect_model(flf))
    assert not spec.supports_image_to_video
    with pytest.raises(RequestError, match="is conditioned on a first and a last frame, and the Videos API gives one "
                                           "image"):
        _check_image(("first.png", "image/png", png.getvalue()), spec=spec, limits=ApiLimits())
    one_image = model_spec(ServeSettings(model_path=str(exported[1]), store_dir=str(tmp_path / "s")),
                           inspect_model(exported[1]))
    assert one_image.supports_image_to_video and FAMILY.image_inputs(inspect_model(exported[1])) == 1
    from vidray.generate import GenerateArgumentError, generate_to_file  # generate takes both frames, or says so

    random_image(0).save(tmp_path / "first.png")
    random_image(1).save(tmp_path / "last.png")
    with pytest.raises(GenerateArgumentError, match="is conditioned on a first and a last frame .*: give --last-image"):
        generate_to_file(flf, "a red fox", tmp_path / "flf.mp4", image=tmp_path / "first.png", num_inference_steps=1)
    generate_to_file(flf, "a red fox", tmp_path / "flf.mp4", image=tmp_path / "first.png",
                     last_image=tmp_path / "last.png", num_inference_steps=1)
    assert (tmp_path / "flf.mp4").stat().st_size > 0


def test_generate_on_a_folder_the_family_refuses_is_a_one_line_user_error(exported, tmp_path):
    # A new user's trial: `vidray generate --model` on such a folder printed a traceback (train refused it in a line).
    from vidray.errors import UserError
    from vidray.generate import generate_to_file

    no_clip = shutil.copytree(exported[1], tmp_path / "no-clip")
    index = json.loads((no_clip / "model_index.json").read_text())
    (no_clip / "model_index.json").write_text(json.dumps({**index, "image_encoder": [None, None]}))
    with pytest.raises(UserError, match=rf"--model {no_clip}: the model family cannot load it: .*has no "
                                        "image_encoder") as err:
        generate_to_file(no_clip, "a red fox", tmp_path / "out.mp4", num_inference_steps=1)
    assert "\n" not in str(err.value) and not (tmp_path / "out.mp4").exists()
