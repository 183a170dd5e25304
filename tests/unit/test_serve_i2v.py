"""Serving an image-to-video model of every family that has one, its stages outside Serve (no Ray): the VAE stage
encodes a request's first frame (`input_reference`) into the condition `vidray generate --image` samples with (for
CogVideoX a posterior sample drawn from the request's seed, as generate draws it), and the step-batched
denoiser samples with it (or with the empty condition, text-to-video, without one) the latents `generate_video`
gives; the store hands the runner the image a job was created with. Wan 2.1 I2V (`wan21`: `model.i2v.image_encoder`)
also gets the first frame's CLIP embeddings from the VAE stage (its image encoder loaded there), or zeros without.
A CogVideoX 1.5 model (text- and image-to-video) is served with its latent frames padded as generate pads them: the
ingress, which loads no model, reads the padded latent shape from the folder's configs (`ModelInfo.family`)."""

import asyncio
import io
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from vidray.cards import BUILTIN_CARDS  # noqa: E402
from vidray.config import FlowConfig, I2VConfig, ModelConfig, job_config_from_dict  # noqa: E402
from vidray.buckets import Bucket  # noqa: E402
from vidray.inference.request import GenerationRequest  # noqa: E402
from vidray.inference.sampler import generate_video  # noqa: E402
from vidray.models import get_family  # noqa: E402
from vidray.models.export import inspect_model, load_model, write_job_file  # noqa: E402
from vidray.serve.stages import Denoiser, TextEncoder, VaeDecoder  # noqa: E402

BUCKET = Bucket(9, 32, 32)
"""A bucket every image-to-video family takes (9 frames: 4k+1 and 8k+1)."""
STEPS = 3


@pytest.fixture(scope="module", params=[*sorted(c.name for c in BUILTIN_CARDS if c.image_to_video), "wan21"])
def i2v_model_dir(request, tmp_path_factory):
    clip = request.param == "wan21"  # Wan 2.1 I2V: CLIP image embeddings, 512 text tokens
    family = get_family("wan" if clip else request.param)
    i2v, max_sequence_length = ({"image_encoder": True}, 512) if clip else ({}, 16)
    components = family.build(ModelConfig(family=family.name, text_encoder="tiny_random",
                                          max_sequence_length=max_sequence_length, i2v=I2VConfig(**i2v)), seed=0)
    out = family.save_pipeline(components, tmp_path_factory.mktemp("i2v") / "diffusers", FlowConfig(shift=3.0))
    write_job_file(out, job_config_from_dict({"name": "t", "model": {"family": family.name,
                                                                     "text_encoder": "tiny_random",
                                                                     "max_sequence_length": max_sequence_length,
                                                                     "i2v": i2v},
                                              "data": {"buckets": [list(BUCKET)]}, "flow": {"shift": 3.0}}))
    return out


def _png(seed: int) -> bytes:
    image = Image.fromarray(np.random.RandomState(seed).randint(0, 256, (40, 48, 3), dtype=np.uint8))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _serve(model_dir, image: bytes | None, seed: int) -> torch.Tensor:
    """One request through the text, VAE and denoiser stage classes, as the ingress runner chains them (the text
    stage's own encoder called as its `@serve.batch` method calls it: that decorator needs a replica), the latent
    shape from the model's `ModelInfo.family` as the ingress takes it (`vidray.serve.app`)."""
    text = TextEncoder.func_or_class(str(model_dir))
    vae = VaeDecoder.func_or_class(str(model_dir))
    denoiser = Denoiser.func_or_class(str(model_dir), {"latency_target_s": 60.0, "max_batch_size": 2})

    async def run():
        embeds, mask = text.family.encode_prompt(text.text_encoder, text.tokenizer, ["a red fox"],
                                                 max_sequence_length=text.max_sequence_length, device="cpu")
        condition = {} if image is None else await vae.encode_image(image, tuple(BUCKET), seed)
        request = {"prompt_embeds": embeds, "prompt_attention_mask": mask, "negative_prompt_embeds": None,
                   "negative_prompt_attention_mask": None,
                   "request": GenerationRequest(prompt="a red fox", num_frames=BUCKET[0], height=BUCKET[1],
                                                width=BUCKET[2], num_inference_steps=STEPS, guidance_scale=1.0,
                                                seed=seed, fps=8.0, image=None if image is None else "first.png"),
                   "inpaint_latents": None, **condition, "sent_at": time.time()}
        async for event in denoiser.denoise(request):
            if "latents" in event:
                return event["latents"]
        raise AssertionError("no latents")

    return asyncio.run(run())


def _generate(model_dir, image: bytes | None, seed: int) -> torch.Tensor:
    """`vidray generate`'s latents (the last denoising step's, from its callback) for the same request."""
    model = load_model(str(model_dir))
    picture = None if image is None else Image.open(io.BytesIO(image)).convert("RGB")
    steps = []
    generate_video(model.family, model.components, ["a red fox"], BUCKET, flow=model.flow,
                   num_inference_steps=STEPS, guidance_scale=1.0, seed=seed,
                   max_sequence_length=model.max_sequence_length, image=picture,
                   callback=lambda step, sigma, latents: steps.append(latents.clone()))
    return steps[-1]


@pytest.mark.parametrize("with_image", [True, False], ids=["first-frame", "text-only"])
def test_the_stages_sample_what_generate_samples_with_and_without_a_first_frame(i2v_model_dir, with_image):
    image = _png(3) if with_image else None
    served = _serve(i2v_model_dir, image, seed=11)
    generated = _generate(i2v_model_dir, image, seed=11)
    assert served.shape == generated.shape == load_model(str(i2v_model_dir)).family.latent_shape(BUCKET, 1)
    torch.testing.assert_close(served, generated, rtol=1e-5, atol=1e-5)


def test_the_first_frame_changes_the_video_and_bad_image_bytes_are_one_error(i2v_model_dir):
    assert not torch.allclose(_serve(i2v_model_dir, _png(3), 11), _serve(i2v_model_dir, None, 11))
    vae = VaeDecoder.func_or_class(str(i2v_model_dir))
    with pytest.raises(ValueError, match="not an image PIL can decode"):
        asyncio.run(vae.encode_image(b"not an image", tuple(BUCKET)))


def test_the_store_gives_the_runner_the_image_a_job_was_created_with(tmp_path):
    from vidray.serve.jobs import JobStore

    store = JobStore(tmp_path / "store", max_attempts=2, retention_s=None)
    params = {"num_frames": 9, "width": 32, "height": 32, "fps": 8.0, "num_inference_steps": 2,
              "guidance_scale": 1.0, "seed": 0}
    common = {"model": "m", "prompt": "a red fox", "size": "32x32", "seconds": "1.125", "params": params}
    with_image = store.create(**common, input_reference=_png(1), input_suffix=".png")
    without = store.create(**common)
    assert store.read_input(with_image.id) == _png(1)
    assert store.read_input(without.id) is None and store.read_input("video_missing") is None


@pytest.fixture(scope="module", params=[False, True], ids=["cogvideox15", "cogvideox15-i2v"])
def cogvideox15_dir(request, tmp_path_factory):
    """A tiny CogVideoX 1.5 export (`patch_size_t` 2; with the param, CogVideoX1.5-5B-I2V's layout) with its job
    file, as `vidray train` writes it from a 1.5 folder."""
    from vidray.models import cogvideox

    components = cogvideox.build_tiny("tiny_random", seed=0, i2v=request.param, version="1.5")
    family = get_family("cogvideox").for_transformer(components.transformer)
    out = family.save_pipeline(components, tmp_path_factory.mktemp("cog15") / "diffusers", FlowConfig(shift=3.0))
    write_job_file(out, job_config_from_dict({"name": "t", "model": {"family": "cogvideox",
                                                                     "text_encoder": "tiny_random",
                                                                     "max_sequence_length": 16,
                                                                     **({"i2v": {}} if request.param else {})},
                                              "data": {"buckets": [list(BUCKET)]}, "flow": {"shift": 3.0}}))
    return out, request.param


def test_a_cogvideox_1_5_model_serves_generate_s_padded_latents(cogvideox15_dir):
    model_dir, i2v = cogvideox15_dir
    padded = (1, 16, 4, 4, 4)  # 3 latent frames of 9 + the one leading frame of patch_size_t 2
    assert inspect_model(str(model_dir)).family.latent_shape(BUCKET, 1) == padded  # the ingress's, from configs
    assert get_family("cogvideox").latent_shape(BUCKET, 1)[2] == 3  # the registered (1.0) family's: unpadded
    for image in ([_png(3), None] if i2v else [None]):  # first frame, text-only
        served = _serve(model_dir, image, seed=11)
        generated = _generate(model_dir, image, seed=11)
        assert served.shape == generated.shape == padded
        torch.testing.assert_close(served, generated, rtol=1e-5, atol=1e-5)
