"""The `Denoiser`'s step loop outside Serve: its class over the tiny exported model, driven with real asyncio. A
fresh batch waits up to the wait for a burst of arrivals to fill it, and no longer than the wait (issue 8,
step-level batching); what the loop asks the policy before each step (`policy_inputs`); the `VaeDecoder` given
concurrent requests. No Ray is started: the classes are used directly."""

import asyncio
import dataclasses
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from vidray.inference.request import GenerationRequest  # noqa: E402
from vidray.inference.sampler import DenoiseState  # noqa: E402
from vidray.models import get_family  # noqa: E402
from vidray.models.export import load_model  # noqa: E402
from vidray.models.text_encoder import encode_prompts  # noqa: E402
from vidray.serve.stages import Denoiser, _Request, policy_inputs  # noqa: E402

BUCKET = (9, 64, 48)  # the tiny model's job file's bucket
NUM_STEPS = 4
LATENT_SHAPE = get_family("easyanimate").latent_shape(BUCKET, 1)


def asking(request: dict, **changes) -> dict:
    """`request` (a denoise call's dict) whose `GenerationRequest` has `changes` (seed=..., guidance_scale=...)."""
    return dict(request, request=dataclasses.replace(request["request"], **changes))


@pytest.fixture(scope="module")
def base_request(tiny_serve_model_dir):
    model = load_model(str(tiny_serve_model_dir))
    embeds, mask = encode_prompts(model.components.text_encoder, model.components.tokenizer, ["a red ball"],
                                  max_sequence_length=model.max_sequence_length, device="cpu")
    return {"prompt_embeds": embeds, "prompt_attention_mask": mask, "negative_prompt_embeds": None,
            "negative_prompt_attention_mask": None,
            "request": GenerationRequest(prompt="a red ball", num_frames=BUCKET[0], height=BUCKET[1], width=BUCKET[2],
                                         num_inference_steps=NUM_STEPS, guidance_scale=1.0, fps=8.0)}


def _burst(denoiser, base_request, arrivals_s: list[float]) -> float:
    """Send one request at each offset (s) and await all their latents; returns the seconds until the last one."""

    async def one(seed: int, offset: float):
        await asyncio.sleep(offset)
        async for event in denoiser.denoise(dict(asking(base_request, seed=seed), sent_at=time.time())):
            if "latents" in event:
                return event["latents"]
        raise AssertionError("the stream ended without latents")

    async def run():
        start = time.perf_counter()
        latents = await asyncio.gather(*(one(i, offset) for i, offset in enumerate(arrivals_s)))
        assert all(x.shape == tuple(LATENT_SHAPE) for x in latents)
        return time.perf_counter() - start

    return asyncio.run(run())


def test_a_fresh_batch_waits_for_a_burst_to_fill_it(tiny_serve_model_dir, base_request):
    # Three requests 10 ms apart, batch 3 and a 2 s wait pinned: all three start together and step as one batch.
    # (Stepping at the first arrival after the wait began started the first two a step ahead of the third.)
    denoiser = Denoiser.func_or_class(str(tiny_serve_model_dir), {"latency_target_s": 60.0, "max_batch_size": 4,
                                                       "max_wait_s": 2.0})
    denoiser.reconfigure({"batch_size": 3, "wait_s": 2.0})
    elapsed = _burst(denoiser, base_request, [0.0, 0.01, 0.02])
    stats = denoiser.stats()
    assert stats["steps_by_batch_size"] == {3: NUM_STEPS}
    assert (stats["steps"], stats["items_stepped"], stats["completed"]) == (NUM_STEPS, 3 * NUM_STEPS, 3)
    assert elapsed < 2.0  # the full batch ended the wait


def test_a_fresh_batch_waits_no_longer_than_the_wait(tiny_serve_model_dir, base_request):
    denoiser = Denoiser.func_or_class(str(tiny_serve_model_dir), {"latency_target_s": 60.0, "max_batch_size": 4,
                                                       "max_wait_s": 0.3})
    denoiser.reconfigure({"batch_size": 3, "wait_s": 0.3})
    elapsed = _burst(denoiser, base_request, [0.0, 0.01])
    assert denoiser.stats()["steps_by_batch_size"] == {2: NUM_STEPS}  # the third never came: two stepped together
    assert elapsed >= 0.3


def test_denoiser_asks_the_policy_about_the_admitted_request_and_how_far_the_running_ones_are():
    # Two requests at step 14 of 16 and a fresh one queued: the admission is about 16 steps (the mean, 6, made the
    # fresh request look short), and each running request reports its seconds since arrival and steps left.
    def request(step: int, arrived_at: float) -> _Request:
        state = DenoiseState(latents=torch.zeros(1, 4, 2, 4, 4), sigmas=torch.linspace(1.0, 0.0, 17),
                             prompt_embeds=torch.zeros(1, 8, 16),
                             prompt_attention_mask=torch.ones(1, 8, dtype=torch.bool), step=step)
        return _Request(state, asyncio.Queue(), arrived_at)

    running = [request(14, 100.0), request(14, 100.5)]
    inputs = policy_inputs(running, [request(0, 101.0)], now=102.0)
    assert inputs["num_steps"] == 16
    assert inputs["queue_depth"] == 1 and inputs["num_running"] == 2
    assert inputs["running_progress"] == [(2.0, 2), (1.5, 2)]
    assert inputs["bytes_per_item"] == (8 * 16 + 4 * 2 * 4 * 4) * 4  # prompt_embeds + latents, float32
    assert policy_inputs([], [], now=0.0) == {"queue_depth": 0, "num_running": 0, "num_steps": 1,
                                              "bytes_per_item": 0, "running_progress": []}


def test_concurrent_vae_decodes_give_each_request_its_own_video(tiny_serve_model_dir):
    # A new user's trial: 4 jobs at once through `serve run` gave one mp4 of 12 frames instead of 9, two equal
    # requests differing by up to 143/255, and for two sizes "Sizes of tensors must match". The decoder ran its
    # requests in threads on one VAE, whose causal convolutions keep each call's state in the modules.
    from vidray.models.vae import decode_latents, video_to_frames
    from vidray.serve.stages import VaeDecoder

    decoder = VaeDecoder.func_or_class(str(tiny_serve_model_dir))
    family = get_family("easyanimate")
    generator = torch.Generator().manual_seed(0)
    latents = [torch.randn(family.latent_shape(bucket, 1), generator=generator)
               for bucket in [(9, 64, 48), (9, 64, 48), (9, 48, 64), (5, 32, 32), (9, 64, 48), (9, 48, 64)]]
    alone = [video_to_frames(decode_latents(decoder.vae, x))[0] for x in latents]

    async def together():
        return await asyncio.gather(*(decoder.decode(x) for x in latents))

    for frames, expected in zip(asyncio.run(together()), alone):
        assert frames.shape == expected.shape
        assert (frames == expected).all()


def test_a_request_whose_latents_overflow_fails_alone_and_its_batch_mate_completes(tiny_serve_model_dir,
                                                                                 base_request):
    # A new user's trial: guidance_scale 1e300 "completed" an all-black video through serving.
    from vidray.inference.sampler import NonFiniteLatentsError

    model = load_model(str(tiny_serve_model_dir))
    negative = encode_prompts(model.components.text_encoder, model.components.tokenizer, [""],
                              max_sequence_length=model.max_sequence_length, device="cpu")
    guided = dict(base_request, negative_prompt_embeds=negative[0], negative_prompt_attention_mask=negative[1])
    denoiser = Denoiser.func_or_class(str(tiny_serve_model_dir), {"latency_target_s": 60.0, "max_batch_size": 4})

    async def run(request: dict):
        async for event in denoiser.denoise(dict(request, sent_at=time.time())):
            if "latents" in event:
                return event["latents"]

    async def both():
        return await asyncio.gather(run(asking(guided, seed=1, guidance_scale=1e300)),
                                    run(asking(guided, seed=2, guidance_scale=6.0)), return_exceptions=True)

    overflowed, fine = asyncio.run(both())
    assert isinstance(overflowed, NonFiniteLatentsError), overflowed
    assert "guidance_scale 1e+300" in str(overflowed)
    assert isinstance(fine, torch.Tensor) and bool(torch.isfinite(fine).all())


def test_denoiser_counts_each_request_once_by_outcome_and_every_step_in_its_metrics(tiny_serve_model_dir,
                                                                                   base_request):
    # `vidray.serve.metrics.DenoiserMetrics` as the Denoiser reports to it: a request whose latents were sent is
    # `completed`, one whose step raised is `failed`, one whose caller left mid-way is `cancelled`.
    from contextlib import aclosing

    denoiser = Denoiser.func_or_class(str(tiny_serve_model_dir), {"latency_target_s": 60.0, "max_batch_size": 4})
    denoiser.reconfigure({"batch_size": 1, "wait_s": 0.0})  # one request per step: each step is one request's
    outcomes: list[str] = []
    steps: list[int] = []
    denoiser.metrics.count_request = outcomes.append
    denoiser.metrics.observe_step = lambda batch_size, seconds: steps.append(batch_size)

    async def run():
        async with aclosing(denoiser.denoise(dict(asking(base_request, seed=1), sent_at=time.time()))) as stream:
            assert "latents" in [event async for event in stream][-1]
        long = dict(asking(base_request, seed=2, num_inference_steps=200), sent_at=time.time())
        async with aclosing(denoiser.denoise(long)) as stream:
            async for event in stream:
                assert "step" in event  # the first progress event: the caller leaves
                break
        bad = dict(asking(base_request, seed=3), sent_at=time.time(),
                   prompt_embeds=torch.zeros(1, 4, base_request["prompt_embeds"].shape[-1] + 1))
        with pytest.raises(RuntimeError, match="denoising step failed"):
            async with aclosing(denoiser.denoise(bad)) as stream:
                async for _ in stream:
                    pass

    asyncio.run(run())
    assert outcomes == ["completed", "cancelled", "failed"]
    assert steps[:NUM_STEPS] == [1] * NUM_STEPS and 1 <= len(steps) - NUM_STEPS < 200


def test_the_serve_configs_memory_reaches_each_stage_fp8_storage_on_cpu(tiny_serve_model_dir, base_request):
    # `memory:` of the serve config (issue 45): fp8 storage, bf16 compute, on a replica without a GPU; the stages
    # sample latents close to the fp32 stage's, and decode them.
    from vidray.models.offload import compute_dtype
    from vidray.serve.stages import TextEncoder, VaeDecoder

    policy = {"latency_target_s": 60.0, "max_batch_size": 2}
    fp32 = Denoiser.func_or_class(str(tiny_serve_model_dir), policy)
    fp8 = Denoiser.func_or_class(str(tiny_serve_model_dir), policy, memory={"storage_dtype": "fp8"})
    assert {p.dtype for p in fp32.transformer.parameters()} == {torch.float32}
    assert torch.float8_e4m3fn in {p.dtype for p in fp8.transformer.parameters()}
    assert compute_dtype(fp8.transformer) == torch.bfloat16

    def latents(denoiser):
        async def run():
            async for event in denoiser.denoise(dict(base_request, seed=5, sent_at=time.time())):
                if "latents" in event:
                    return event["latents"]
        return asyncio.run(run())

    reference, stored = latents(fp32), latents(fp8)
    assert stored.dtype == torch.float32 and stored.shape == reference.shape
    assert 0 < (stored - reference).abs().mean() < 0.1 * reference.abs().mean()
    text = TextEncoder.func_or_class(str(tiny_serve_model_dir), memory={"storage_dtype": "bf16"})
    embeds, _ = text.family.encode_prompt(text.text_encoder, text.tokenizer, ["a red ball"],  # what encode() runs
                                          max_sequence_length=text.max_sequence_length, device="cpu")
    assert embeds.dtype == torch.float32 and compute_dtype(text.text_encoder) == torch.bfloat16
    decoder = VaeDecoder.func_or_class(str(tiny_serve_model_dir), memory={"storage_dtype": "bf16"})
    assert asyncio.run(decoder.decode(stored)).shape == (9, 64, 48, 3)


def test_an_offload_mode_on_a_replica_without_a_gpu_is_one_line_naming_the_mode(tiny_serve_model_dir):
    from vidray.errors import UserError

    with pytest.raises(UserError, match="^memory.offload: group needs a CUDA GPU .* use memory.offload: none"):
        Denoiser.func_or_class(str(tiny_serve_model_dir), {"latency_target_s": 60.0},
                               memory={"offload": "group"})
