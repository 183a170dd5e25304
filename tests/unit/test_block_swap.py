"""`memory.block_swap` (`vidray.train.block_swap`) on CPU: the same hooks as on CUDA with the device copy a clone
(no stream): losses and LoRA gradients bitwise those of the unswapped model, with activation checkpointing
recomputing each swapped block in the backward; the refusals (block count, config)."""

from __future__ import annotations

import copy

import pytest
import torch

from vidray.config import FlowConfig, LoraConfig, ModelConfig, job_config_from_dict
from vidray.buckets import Bucket
from vidray.models import get_family
from vidray.models.lora import apply_lora
from vidray.train.block_swap import apply_block_swap
from vidray.train.parallel import apply_activation_checkpointing
from vidray.train.step import flow_matching_step_loss

CPU = torch.device("cpu")
FLOW = FlowConfig(shift=3.0)
BUCKET = Bucket(5, 32, 32)


def lora_model(family: str = "easyanimate"):
    fam = get_family(family)
    transformer = fam.load_diffusion_models(ModelConfig(family=family, text_encoder="tiny_random"), seed=0).transformer
    transformer = apply_lora(transformer, LoraConfig(rank=4, alpha=8.0), seed=1)
    for name, param in transformer.named_parameters():  # give B a value: every adapter then gets a gradient
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02, generator=torch.Generator().manual_seed(len(name)))
    return fam, transformer


def loss_and_grads(fam, model):
    g = torch.Generator().manual_seed(3)
    latents = torch.randn(fam.latent_shape(BUCKET, 2), generator=g)
    prompt_embeds, mask = torch.randn(2, 6, 64, generator=g), torch.ones(2, 6, dtype=torch.bool)
    loss = flow_matching_step_loss(fam, model, latents, prompt_embeds, mask, FLOW, torch.Generator().manual_seed(5))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["easyanimate", "wan"])
def test_block_swap_is_bitwise_the_unswapped_model(family):
    fam, plain = lora_model(family)
    swapped = copy.deepcopy(plain)
    blocks = fam.block_lists(swapped)
    count = len(blocks[0])
    swaps = apply_block_swap(swapped, blocks, count - 1, CPU)
    assert swaps[0].host_bytes() > 0 and swaps[0].first_swapped == 1
    onloads = []
    last = blocks[0][count - 1]
    last.register_forward_pre_hook(lambda m, a: onloads.append(  # after the swap's own pre-hook
        all(p.data_ptr() != host.data_ptr() for p, host in swaps[0].swapped[count - 1].params)))
    for model in (plain, swapped):
        apply_activation_checkpointing(model, "full", fam.block_lists(model))
    want, got = loss_and_grads(fam, plain), loss_and_grads(fam, swapped)
    assert torch.equal(want[0], got[0])
    assert want[1].keys() == got[1].keys() and any(".lora_A." in n for n in got[1])
    for name in want[1]:
        assert torch.equal(want[1][name], got[1][name]), name
    # forward + the backward's recomputation each brought the block's weights in; after them it points at the host
    assert onloads == [True, True]
    assert all(p.data_ptr() == host.data_ptr() for p, host in swaps[0].swapped[count - 1].params)


def test_block_swap_refuses_the_whole_block_list():
    fam, transformer = lora_model()
    count = len(fam.block_lists(transformer)[0])
    with pytest.raises(ValueError, match=rf"^memory.block_swap: {count} must be in 1..{count - 1}: the model has "
                                         rf"{count} transformer blocks"):
        apply_block_swap(transformer, fam.block_lists(transformer), count, CPU)


def test_config_needs_activation_checkpointing():
    job = {"model": {"lora": {"rank": 4}}, "scaling": {"use_gpu": True}, "memory": {"block_swap": 2}}
    with pytest.raises(ValueError, match="memory.block_swap: 2 needs train.activation_checkpointing: full"):
        job_config_from_dict(job)
    job["train"] = {"activation_checkpointing": "full"}
    assert job_config_from_dict(job).memory.block_swap == 2


def test_the_gpu_memory_rows_script_runs_its_block_swap_row_on_cpu():
    """tests/gpu/memory_rows.py cannot rot between GPU loans: its CPU smoke run trains the same first loss with and
    without the swap, and its CUDA figures are misses that say so."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
    import memory_rows

    figures = memory_rows.block_swap_rows("cpu", steps=2)
    assert figures["block_swap_same_loss"]["value"] is True
    assert figures["block_swap_host_bytes"]["value"] > 0
    assert figures["block_swap_step_time_over_resident"]["miss"].startswith("no CUDA")
