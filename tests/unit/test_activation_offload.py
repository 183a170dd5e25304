"""`memory.activation_offload` (`vidray.train.step.ActivationOffload`): the training step's forward under
save-on-CPU hooks. Under non-reentrant activation checkpointing, torch 2.13 saves each checkpointed block's inputs
outside the checkpoint's own hooks (so the offload hooks take them) and the block's internals inside them (so they
are recomputed on the device, never packed): checked here on CPU with the tiny EasyAnimate transformer, by counting
what the hooks pack, and by the loss and gradients being bitwise those of the same step without the offload."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from vidray.config import ConfigError, FlowConfig, ModelConfig, load_job_config  # noqa: E402
from vidray.buckets import Bucket  # noqa: E402
from vidray.models import get_family  # noqa: E402
from vidray.train.parallel import apply_activation_checkpointing  # noqa: E402
from vidray.train.step import ActivationOffload, flow_matching_step_loss, step_generator  # noqa: E402

BUCKET = Bucket(5, 32, 32)  # latents (B, 16, 2, 4, 4): 2 x 2 x 2 = 8 video tokens a sample
FLOW = FlowConfig()
BATCH, TEXT = 2, 6


def _step(setting: str, offload: ActivationOffload | None) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """One forward + backward of a fresh tiny transformer (seed 0) with `train.activation_checkpointing` setting:
    (loss, gradients by name, number of blocks)."""
    family = get_family("easyanimate")
    transformer = family.build(ModelConfig(text_encoder="tiny_random"), seed=0).transformer
    transformer.train()
    apply_activation_checkpointing(transformer, setting, family.block_lists(transformer))
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(family.latent_shape(BUCKET, BATCH), generator=g)
    prompt_embeds = torch.randn(BATCH, TEXT, transformer.config.text_embed_dim, generator=g)
    mask = torch.ones(BATCH, TEXT, dtype=torch.bool)
    loss = flow_matching_step_loss(family, transformer, latents, prompt_embeds, mask, FLOW, step_generator(3, 7, 1),
                                   activation_offload=offload)
    loss.backward()
    grads = {n: p.grad for n, p in transformer.named_parameters() if p.grad is not None}
    return loss.detach(), grads, len(transformer.transformer_blocks)


@pytest.mark.parametrize("setting", ["full", "every_2"])
def test_offload_packs_the_checkpointed_inputs_and_leaves_loss_and_gradients_bitwise_equal(setting):
    loss, grads, num_blocks = _step(setting, None)
    offload = ActivationOffload(pin_memory=False)
    loss_off, grads_off, _ = _step(setting, offload)
    assert torch.equal(loss, loss_off)
    assert grads.keys() == grads_off.keys() and len(grads) > 0
    assert all(torch.equal(grads[n], grads_off[n]) for n in grads)
    # The hooks were applied to the forward: what it saves went through them (a forward outside them packs 0).
    assert offload.packed_tensors > 0
    # Each checkpointed block's inputs are packed: its residual stream over video + text tokens, fp32.
    family = get_family("easyanimate")
    transformer = family.build(ModelConfig(text_encoder="tiny_random"), seed=0).transformer
    dim = transformer.config.num_attention_heads * transformer.config.attention_head_dim
    checkpointed = num_blocks if setting == "full" else len(range(0, num_blocks, 2))
    tokens = 2 * (32 // 16) * (32 // 16)
    assert offload.packed_bytes >= checkpointed * BATCH * (tokens + TEXT) * dim * 4


def test_the_checkpointed_blocks_internals_are_recomputed_not_packed():
    """With AC the hooks get the blocks' inputs and what lies outside them; without AC every saved tensor: the
    checkpoint's own hooks keep the blocks' internals (recomputed in the backward, on the device)."""
    with_ac, without_ac = ActivationOffload(), ActivationOffload()
    _step("full", with_ac)
    _step("none", without_ac)
    assert 0 < with_ac.packed_bytes < without_ac.packed_bytes / 2
    with_ac.reset()
    assert with_ac.packed_tensors == with_ac.packed_bytes == 0


def test_activation_offload_needs_activation_checkpointing_and_a_dit_run():
    with pytest.raises(ConfigError) as err:
        load_job_config(None, ["memory.activation_offload=true"])
    assert "set train.activation_checkpointing: full" in str(err.value) and "\n" not in str(err.value).strip()
    job = load_job_config(None, ["memory.activation_offload=true", "train.activation_checkpointing=every_2"])
    assert job.memory.activation_offload
    with pytest.raises(ConfigError, match="applies to the DiT's forward, not train.objective: vae"):
        load_job_config(None, ["memory.activation_offload=true", "train.activation_checkpointing=full",
                               "train.objective=vae"])
