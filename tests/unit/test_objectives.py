"""The objective as an object (issue 46, part 2): `family.objective` (`vidray.diffusion.objectives`) owns the noisy
latents, the target, the model's timesteps, the sampler's schedule and its step; `ModelFamily` forwards none of
them, and a family whose models differ in schedule (CogVideoX) gives each model its own objective."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from vidray.cards import get_card, register_card, unregister_card
from vidray.diffusion import ddim, flow_matching
from vidray.diffusion.objectives import DDIM, FlowMatching, Objective
from vidray.models.base import ModelFamily
from vidray.models.registry import FAMILIES, forget_family

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "families"))
METHODS = ("noisy_latents", "training_target", "model_timesteps", "inference_sigmas", "sampler_step")
EXPECTED = {"easyanimate": "flow_matching", "wan": "flow_matching", "cogvideox": "v_prediction",
            "animatediff": "epsilon", "toy": "flow_matching"}


def test_the_family_protocol_forwards_no_objective_method():
    assert [m for m in METHODS if hasattr(ModelFamily, m)] == []
    assert isinstance(ModelFamily.objective, FlowMatching)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_family_s_objective_is_the_one_its_card_names(name, request):
    if name == "toy":
        from toy_family import TOY_CARD

        register_card(TOY_CARD)
        request.addfinalizer(lambda: (unregister_card("toy"), forget_family("toy")))
    objective = FAMILIES[name].objective
    assert isinstance(objective, Objective) and objective.name == EXPECTED[name]
    assert isinstance(objective, FlowMatching if get_card(name).objective == "flow_matching" else DDIM)
    assert [m for m in METHODS if hasattr(FAMILIES[name], m)] == []  # no family defines one beside its objective


def test_flow_matching_is_the_flow_matching_formulas():
    g = torch.Generator().manual_seed(0)
    latents, noise, pred = (torch.randn(2, 4, 2, 4, 4, generator=g) for _ in range(3))
    sigmas, objective = torch.tensor([0.25, 0.9]), FlowMatching()
    assert torch.equal(objective.noisy_latents(latents, noise, sigmas),
                       flow_matching.add_noise(latents, noise, sigmas))
    assert torch.equal(objective.training_target(latents, noise, sigmas), noise - latents)
    assert torch.equal(objective.model_timesteps(sigmas, 1000), sigmas * 1000)
    assert torch.equal(objective.inference_sigmas(4, shift=3.0, num_train_timesteps=1000),
                       flow_matching.inference_sigmas(4, 3.0, num_train_timesteps=1000))
    assert torch.equal(objective.sampler_step(latents, pred, sigmas, sigmas - 0.25), latents - 0.25 * pred)


def test_ddim_reads_noise_levels_as_timesteps_and_names_its_owner_in_errors():
    objective = DDIM(ddim.ddim_schedule(beta_schedule="linear"), "epsilon", spacing="leading", steps_offset=1,
                     owner="the test family")
    assert objective.name == "epsilon"
    assert torch.equal(objective.model_timesteps(torch.tensor([0.0, 0.4178, 1.0]), 1000),
                       torch.tensor([0.0, 418.0, 999.0]))
    assert torch.equal((objective.inference_sigmas(4, shift=3.0, num_train_timesteps=1000) * 1000).round(),
                       torch.tensor([751.0, 501.0, 251.0, 1.0, -1.0]))
    with pytest.raises(ValueError, match=r"^flow.num_train_timesteps is 500, but the test family's DDIM schedule has "
                                         r"1000 timesteps: set flow.num_train_timesteps: 1000$"):
        objective.model_timesteps(torch.zeros(1), 500)


def test_cogvideox_gives_each_model_the_objective_of_its_own_schedule():
    from vidray.models.cogvideox import SCHEDULER_CONFIG_5B, CogVideoXFamily

    family_2b, family_5b = FAMILIES["cogvideox"], CogVideoXFamily(SCHEDULER_CONFIG_5B)
    g = torch.Generator().manual_seed(1)
    latents, noise = torch.randn(1, 16, 1, 2, 2, generator=g), torch.randn(1, 16, 1, 2, 2, generator=g)
    sigmas = torch.tensor([0.5])
    t = torch.tensor([500])
    for family, snr_shift_scale in ((family_2b, 3.0), (family_5b, 1.0)):
        schedule = ddim.ddim_schedule(beta_schedule="scaled_linear", snr_shift_scale=snr_shift_scale,
                                      rescale_betas_zero_snr=True)
        assert torch.equal(family.objective.noisy_latents(latents, noise, sigmas),
                           ddim.add_noise(latents, noise, t, schedule))
    assert not torch.equal(family_2b.objective.noisy_latents(latents, noise, sigmas),
                           family_5b.objective.noisy_latents(latents, noise, sigmas))
