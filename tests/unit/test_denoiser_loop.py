"""The `Denoiser`'s step loop outside Serve: its class over the tiny exported model, driven with real asyncio. A
fresh batch waits up to the wait for a burst of arrivals to fill it, and no longer than the wait (issue 8,
step-level batching). No Ray is started: the class is used directly."""

import asyncio
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

from vidray.models import get_family  # noqa: E402
from vidray.models.export import load_model  # noqa: E402
from vidray.models.text_encoder import encode_prompts  # noqa: E402
from vidray.serve.stages import Denoiser  # noqa: E402

BUCKET = (9, 64, 48)  # the tiny model's job file's bucket
NUM_STEPS = 4


@pytest.fixture(scope="module")
def base_request(tiny_serve_model_dir):
    model = load_model(str(tiny_serve_model_dir))
    embeds, mask = encode_prompts(model.components.text_encoder, model.components.tokenizer, ["a red ball"],
                                  max_sequence_length=model.max_sequence_length, device="cpu")
    return {"prompt_embeds": embeds, "prompt_attention_mask": mask, "negative_prompt_embeds": None,
            "negative_prompt_attention_mask": None, "guidance_scale": 1.0,
            "latent_shape": get_family("easyanimate").latent_shape(BUCKET, 1), "num_inference_steps": NUM_STEPS}


def _burst(denoiser, base_request, arrivals_s: list[float]) -> float:
    """Send one request at each offset (s) and await all their latents; returns the seconds until the last one."""

    async def one(seed: int, offset: float):
        await asyncio.sleep(offset)
        async for event in denoiser.denoise(dict(base_request, seed=seed, sent_at=time.time())):
            if "latents" in event:
                return event["latents"]
        raise AssertionError("the stream ended without latents")

    async def run():
        start = time.perf_counter()
        latents = await asyncio.gather(*(one(i, offset) for i, offset in enumerate(arrivals_s)))
        assert all(x.shape == tuple(base_request["latent_shape"]) for x in latents)
        return time.perf_counter() - start

    return asyncio.run(run())


def test_a_fresh_batch_waits_for_a_burst_to_fill_it(tiny_serve_model_dir, base_request):
    # Three requests 10 ms apart, batch 3 and a 2 s wait pinned: all three start together and step as one batch.
    # (Stepping at the first arrival after the wait began started the first two a step ahead of the third.)
    denoiser = Denoiser.func_or_class(str(tiny_serve_model_dir), {"latency_target_s": 60.0, "max_batch_size": 4,
                                                       "max_wait_s": 2.0})
    denoiser.reconfigure({"batch_size": 3, "wait_s": 2.0})
    elapsed = _burst(denoiser, base_request, [0.0, 0.01, 0.02])
    assert denoiser.stats()["steps_by_batch_size"] == {3: NUM_STEPS}
    assert elapsed < 2.0  # the full batch ended the wait


def test_a_fresh_batch_waits_no_longer_than_the_wait(tiny_serve_model_dir, base_request):
    denoiser = Denoiser.func_or_class(str(tiny_serve_model_dir), {"latency_target_s": 60.0, "max_batch_size": 4,
                                                       "max_wait_s": 0.3})
    denoiser.reconfigure({"batch_size": 3, "wait_s": 0.3})
    elapsed = _burst(denoiser, base_request, [0.0, 0.01])
    assert denoiser.stats()["steps_by_batch_size"] == {2: NUM_STEPS}  # the third never came: two stepped together
    assert elapsed >= 0.3
