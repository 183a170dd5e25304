"""Step-level (continuous) batching in the one sampler: a request that joins a running batch mid-way, or steps
next to requests of other schedules, gets the latents it gets alone (issue 8 item 2)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from vidray.config import ModelConfig  # noqa: E402
from vidray.buckets import Bucket  # noqa: E402
from vidray.diffusion.flow_matching import inference_sigmas  # noqa: E402
from vidray.inference.sampler import DenoiseState, initial_noise, sample_latents, step_states  # noqa: E402
from vidray.models import get_family  # noqa: E402
from vidray.models.text_encoder import encode_prompts  # noqa: E402

BUCKET = Bucket(5, 32, 32)
SHIFT, NUM_TRAIN_TIMESTEPS = 3.0, 1000


@pytest.fixture(scope="module")
def model():
    family = get_family("easyanimate")
    components = family.build(ModelConfig(text_encoder="tiny_random"), seed=0)
    components.transformer.eval()
    return family, components


def _embeds(components, prompt):
    return encode_prompts(components.text_encoder, components.tokenizer, [prompt], max_sequence_length=16)


def _state(family, components, prompt, seed, steps, guidance_scale=1.0):
    embeds, mask = _embeds(components, prompt)
    negative = _embeds(components, "") if guidance_scale > 1 else (None, None)
    return DenoiseState(
        latents=initial_noise(family.latent_shape(BUCKET, 1), seed),
        sigmas=inference_sigmas(steps, SHIFT, num_train_timesteps=NUM_TRAIN_TIMESTEPS),
        prompt_embeds=embeds, prompt_attention_mask=mask, guidance_scale=guidance_scale,
        negative_prompt_embeds=negative[0], negative_prompt_attention_mask=negative[1],
    )


def _alone(family, components, prompt, seed, steps, guidance_scale=1.0):
    embeds, mask = _embeds(components, prompt)
    negative = _embeds(components, "") if guidance_scale > 1 else (None, None)
    return sample_latents(
        family, components.transformer, embeds, mask, latent_shape=family.latent_shape(BUCKET, 1),
        num_inference_steps=steps, shift=SHIFT, num_train_timesteps=NUM_TRAIN_TIMESTEPS,
        guidance_scale=guidance_scale, negative_prompt_embeds=negative[0], negative_prompt_attention_mask=negative[1],
        latents=initial_noise(family.latent_shape(BUCKET, 1), seed),
    )


@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
def test_request_joining_mid_way_gets_the_latents_it_gets_alone(model, guidance_scale):
    family, components = model
    first = _state(family, components, "a red ball rolling", seed=1, steps=6, guidance_scale=guidance_scale)
    joiner_guidance = guidance_scale * 1.5 if guidance_scale > 1 else 1.0  # per-sample guidance scales
    joiner = _state(family, components, "a cat on a wall", seed=2, steps=4, guidance_scale=joiner_guidance)
    # The first request (6 steps) runs 3 steps alone, then the joiner (4 steps) arrives: they step together until
    # the first request's schedule ends; the joiner runs its last step alone.
    for _ in range(3):
        step_states(family, components.transformer, [first], num_train_timesteps=NUM_TRAIN_TIMESTEPS)
    running = [first, joiner]
    sizes = []
    while running:
        sizes.append(len(running))
        step_states(family, components.transformer, running, num_train_timesteps=NUM_TRAIN_TIMESTEPS)
        running = [state for state in running if not state.done]
    assert sizes == [2, 2, 2, 1]

    alone_first = _alone(family, components, "a red ball rolling", 1, 6, guidance_scale)
    alone_joiner = _alone(family, components, "a cat on a wall", 2, 4, joiner_guidance)
    torch.testing.assert_close(first.latents, alone_first, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(joiner.latents, alone_joiner, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(first.latents, joiner.latents)  # two different requests, not one copied


def test_states_of_different_shapes_or_guidance_are_refused_in_one_step(model):
    family, components = model
    plain = _state(family, components, "a", seed=0, steps=2)
    guided = _state(family, components, "b", seed=0, steps=2, guidance_scale=3.0)
    assert plain.batch_key() != guided.batch_key()
    with pytest.raises(ValueError, match="different batch keys"):
        step_states(family, components.transformer, [plain, guided], num_train_timesteps=NUM_TRAIN_TIMESTEPS)
    for _ in range(2):
        step_states(family, components.transformer, [plain], num_train_timesteps=NUM_TRAIN_TIMESTEPS)
    assert plain.done
    with pytest.raises(ValueError, match="finished"):
        step_states(family, components.transformer, [plain], num_train_timesteps=NUM_TRAIN_TIMESTEPS)
