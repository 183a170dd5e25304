"""Serving a two-expert model (Wan 2.2 A14B's layout, issue 29 part 6) as two denoiser stages: `Denoiser` holds the
high-noise expert alone and `LowNoiseDenoiser` the low-noise one; a request's latents go from the first to the
second at the boundary step, and the pair samples what `vidray generate` samples with both experts in one
`TwoExperts`. The stage classes run outside Serve (no Ray), and the job runner chains them through local handles."""

import asyncio
import io
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import av  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from PIL import Image  # noqa: E402

from vidray.config import ExpertsConfig, FlowConfig, I2VConfig, ModelConfig, job_config_from_dict  # noqa: E402
from vidray.buckets import Bucket  # noqa: E402
from vidray.inference.request import GenerationRequest  # noqa: E402
from vidray.inference.sampler import generate_video  # noqa: E402
from vidray.models import get_family  # noqa: E402
from vidray.models.experts import TwoExperts, expert_steps  # noqa: E402
from vidray.models.export import load_model, write_job_file  # noqa: E402
from vidray.serve.app import (LOW_NOISE_DENOISER, ServeSettings, ServeSettingsError, VideoJobService,  # noqa: E402
                              build_app)
from vidray.serve.stages import Denoiser, VaeDecoder  # noqa: E402
from tests.unit.test_serve_app import run_until_finished  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
BUCKET = Bucket(9, 32, 32)
BOUNDARY_RATIO = 0.8
"""With shift 3 and 4 steps the timesteps are 1000, 857.7, 602.2, 8.9: the first two are the high-noise expert's."""
POLICY = {"latency_target_s": 60.0, "max_batch_size": 2}


@pytest.fixture(scope="module")
def experts_dir(tmp_path_factory):
    """A tiny Wan image-to-video model of two experts, exported as training exports it (stock folder + job file)."""
    family = get_family("wan")
    cfg = ModelConfig(family="wan", text_encoder="tiny_random", max_sequence_length=16, i2v=I2VConfig(),
                      experts=ExpertsConfig(boundary_ratio=BOUNDARY_RATIO))
    components = family.build(cfg, seed=0)
    out = family.save_pipeline(components, tmp_path_factory.mktemp("experts") / "diffusers", FlowConfig(shift=3.0))
    write_job_file(out, job_config_from_dict({
        "name": "experts", "model": {"family": "wan", "text_encoder": "tiny_random", "max_sequence_length": 16,
                                     "i2v": {}, "experts": {"boundary_ratio": BOUNDARY_RATIO}},
        "data": {"buckets": [list(BUCKET)]}, "flow": {"shift": 3.0}}))
    return out


@pytest.fixture
def stages(experts_dir):
    """(high-noise Denoiser, low-noise Denoiser, VaeDecoder) stage objects, as Serve would construct them: fresh for
    each test (a Denoiser's step loop belongs to the event loop of its first request, and each test runs its own)."""
    return (Denoiser.func_or_class(str(experts_dir), POLICY, None, "high"),
            Denoiser.func_or_class(str(experts_dir), POLICY, None, "low"),
            VaeDecoder.func_or_class(str(experts_dir)))


def _png(seed: int) -> bytes:
    image = Image.fromarray(np.random.RandomState(seed).randint(0, 256, (40, 48, 3), dtype=np.uint8))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _request(model_dir, condition: dict | None, seed: int, steps: int) -> dict:
    """A denoise request as the job runner builds it; `condition` is the VAE stage's `encode_image` answer."""
    model = load_model(str(model_dir), components=("text_encoder",))
    embeds, mask = model.family.encode_prompt(model.components.text_encoder, model.components.tokenizer,
                                              ["a red fox"], max_sequence_length=model.max_sequence_length)
    return {"prompt_embeds": embeds, "prompt_attention_mask": mask, "negative_prompt_embeds": None,
            "negative_prompt_attention_mask": None,
            "request": GenerationRequest(prompt="a red fox", num_frames=BUCKET[0], height=BUCKET[1], width=BUCKET[2],
                                         num_inference_steps=steps, guidance_scale=1.0, seed=seed, fps=8.0),
            "inpaint_latents": None, **(condition or {}), "sent_at": time.time()}


async def _last_event(denoiser, request: dict) -> dict:
    events = [event async for event in denoiser.denoise(request)]
    assert "latents" in events[-1] and all("latents" not in event for event in events[:-1])
    return events[-1]


def _generated(model_dir, image: bytes | None, seed: int, steps: int) -> torch.Tensor:
    """`vidray generate`'s latents (its last step's, from the callback): both experts in one `TwoExperts`."""
    model = load_model(str(model_dir))
    assert isinstance(model.components.transformer, TwoExperts)
    out = []
    generate_video(model.family, model.components, ["a red fox"], BUCKET, flow=model.flow, num_inference_steps=steps,
                   guidance_scale=1.0, seed=seed, max_sequence_length=model.max_sequence_length,
                   image=None if image is None else Image.open(io.BytesIO(image)).convert("RGB"),
                   callback=lambda step, sigma, latents: out.append(latents.clone()))
    return out[-1]


def test_each_expert_stage_holds_its_expert_alone(experts_dir, stages):
    high, low, _ = stages
    whole = load_model(str(experts_dir), components=("transformer",)).components.transformer
    for stage, expert in ((high, whole.transformer), (low, whole.transformer_2)):
        assert not isinstance(stage.transformer, TwoExperts)
        assert stage.transformer.state_dict().keys() == expert.state_dict().keys()
        assert all(torch.equal(v, expert.state_dict()[k]) for k, v in stage.transformer.state_dict().items())
    assert not torch.equal(next(high.transformer.parameters()), next(low.transformer.parameters()))
    assert high.boundary_timestep == low.boundary_timestep == BOUNDARY_RATIO * 1000


@pytest.mark.parametrize(("with_image", "steps", "handed_over_at"),
                         [(True, 4, 2), (False, 4, 2), (True, 1, 1)],
                         ids=["first-frame", "text-only", "one-step-all-high"])
def test_the_two_stages_hand_over_at_the_boundary_and_sample_what_generate_samples(experts_dir, stages, with_image,
                                                                                   steps, handed_over_at):
    high, low, vae = stages
    image = _png(3) if with_image else None

    async def run():
        condition = None if image is None else await vae.encode_image(image, tuple(BUCKET), 11)
        request = _request(experts_dir, condition, seed=11, steps=steps)
        first = await _last_event(high, request)
        second = await _last_event(low, {**request, "latents": first["latents"], "step": first["step"]})
        return first, second

    first, second = asyncio.run(run())
    assert (first["step"], second["step"]) == (handed_over_at, steps)
    torch.testing.assert_close(second["latents"], _generated(experts_dir, image, seed=11, steps=steps),
                               rtol=1e-5, atol=1e-5)


def test_the_low_noise_stage_refuses_a_request_without_the_high_noise_latents(experts_dir, stages):
    _, low, _ = stages
    with pytest.raises(ValueError, match="the low-noise expert starts at step 2 of 4: the request must carry the "
                                         "high-noise expert's latents and step 2"):
        asyncio.run(_last_event(low, _request(experts_dir, None, seed=0, steps=4)))


def test_expert_steps_split_a_decreasing_schedule_once_and_refuse_a_second_crossing():
    timesteps = torch.tensor([1000.0, 857.7, 800.0, 602.2, 8.9])
    assert expert_steps(timesteps, 800.0, "high") == (0, 3)  # the boundary itself is the high-noise expert's
    assert expert_steps(timesteps, 800.0, "low") == (3, 5)
    assert expert_steps(timesteps, 1001.0, "high") == (0, 0) and expert_steps(timesteps, 1.0, "low") == (5, 5)
    with pytest.raises(ValueError, match="cross the boundary 800.0 more than once"):
        expert_steps(torch.tensor([1000.0, 500.0, 900.0]), 800.0, "low")
    with pytest.raises(ValueError, match="expert 'middle': give one of high, low"):
        expert_steps(timesteps, 800.0, "middle")


class _Handle:
    """A Serve deployment handle over a stage object in this process: `handle.method.remote(...)` runs the call
    (a coroutine to await, or with `options(stream=True)` a stream to iterate)."""

    def __init__(self, stage, methods: dict | None = None):
        self.stage, self.methods = stage, methods or {}

    def options(self, **_):
        return self

    def __getattr__(self, name):
        fn = self.methods.get(name) or getattr(self.stage, name)

        class Method:
            @staticmethod
            def remote(*args, **kwargs):
                result = fn(*args, **kwargs)
                if not hasattr(result, "__aiter__"):
                    return result

                class Stream:
                    def __aiter__(self):
                        return result.__aiter__()

                    def cancel(self):
                        pass

                return Stream()

        return Method()


def _render(experts_dir, tmp_path, denoisers: list) -> np.ndarray:
    """The frames of the mp4 the job runner renders for one image-to-video job through `denoisers`."""
    vae = VaeDecoder.func_or_class(str(experts_dir))
    model = load_model(str(experts_dir), components=("text_encoder",))

    async def encode(prompt: str):
        return model.family.encode_prompt(model.components.text_encoder, model.components.tokenizer, [prompt],
                                          max_sequence_length=model.max_sequence_length)

    settings = ServeSettings(model_path=str(experts_dir), store_dir=str(tmp_path / "store"), fps=8.0,
                             store_on="replica", runner={"poll_s": 0.05})

    async def scenario():
        service = VideoJobService(settings, None, _Handle(None, {"encode": encode}), _Handle(denoisers[0]),
                                  _Handle(vae), *[_Handle(d) for d in denoisers[1:]])
        params = {"num_frames": 9, "width": 32, "height": 32, "seed": 5, "num_inference_steps": 4,
                  "guidance_scale": 1.0, "negative_prompt": "", "fps": 8.0}
        job = service.store.create(model="m", prompt="a red fox", size="32x32", seconds="1.125", params=params,
                                   input_reference=_png(4), input_suffix=".png")
        return await run_until_finished(service, job.id, timeout_s=60)

    job, store = asyncio.run(scenario())
    assert job.status == "completed", job
    with av.open(str(store.video_path(job.id))) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def test_the_job_runner_chains_the_two_expert_stages_into_the_video_one_stage_of_both_makes(experts_dir, stages,
                                                                                           tmp_path):
    high, low, _ = stages
    both = Denoiser.func_or_class(str(experts_dir), POLICY)  # one replica holding both experts (TwoExperts)
    assert isinstance(both.transformer, TwoExperts)
    split = _render(experts_dir, tmp_path / "split", [high, low])
    together = _render(experts_dir, tmp_path / "together", [both])
    assert split.shape == (9, 32, 32, 3)
    np.testing.assert_array_equal(split, together)


def test_build_app_binds_one_denoiser_deployment_per_expert_and_refuses_a_lora(experts_dir, tmp_path):
    app = build_app({"model_path": str(experts_dir), "store_dir": str(tmp_path / "store"),
                     "auth": {"disabled": True}})
    ingress = app._bound_deployment
    high, low = ingress.init_args[3], ingress.init_args[5]
    assert (high._bound_deployment.name, high._bound_deployment.init_args[3]) == ("Denoiser", "high")
    assert (low._bound_deployment.name, low._bound_deployment.init_args[3]) == (LOW_NOISE_DENOISER, "low")
    lora = tmp_path / "adapter.safetensors"
    lora.write_bytes(b"")
    with pytest.raises(ServeSettingsError, match="lora_path: model .* has two experts"):
        build_app({"model_path": str(experts_dir), "store_dir": str(tmp_path / "store"), "lora_path": str(lora),
                   "auth": {"disabled": True}})


def test_the_shipped_experts_config_is_the_serve_config_with_a_low_noise_denoiser():
    (base,) = yaml.safe_load((REPO / "serve/serve_config.yaml").read_text())["applications"]
    (experts,) = yaml.safe_load((REPO / "serve/serve_config_experts.yaml").read_text())["applications"]
    ServeSettings(**experts["args"])
    differs = {"model_path", "model_name", "lora_path"}
    assert ({k: v for k, v in experts["args"].items() if k not in differs}
            == {k: v for k, v in base["args"].items() if k not in differs})
    deployments = {d["name"]: d for d in experts["deployments"]}
    assert {**deployments.pop(LOW_NOISE_DENOISER), "name": "Denoiser"} == deployments["Denoiser"]
    assert deployments == {d["name"]: d for d in base["deployments"]}
    assert {k: v for k, v in experts.items() if k not in ("args", "deployments")} == \
        {k: v for k, v in base.items() if k not in ("args", "deployments")}
