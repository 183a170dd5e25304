"""Context parallel (`vidray.models.context_parallel`) on two gloo ranks on CPU, Ulysses degree 2: each family's
tiny transformer split over the two ranks gives the forward output and the loss of the same model run whole in one
process, and the two ranks' gradients summed are its gradients (each rank holds its tokens' share), for Wan (plain,
with activation checkpointing applied after, with LoRA applied before, and the two-expert wrapper), CogVideoX and
EasyAnimate; and the one-line refusals (heads or tokens that do not divide, a family without a plan, a group
larger than a node). One spawn per group of cases; the ranks write their measurements, the tests assert here."""

from __future__ import annotations

import copy
import json
import traceback
from pathlib import Path

import pytest
import torch
from tests.conftest import free_port, join_gloo, start_ranks

from vidray.buckets import Bucket
from vidray.cards import all_cards
from vidray.config import ExpertsConfig, FlowConfig, LoraConfig, ModelConfig
from vidray.models.context_parallel import (
    CONTEXT_PARALLEL_FAMILIES,
    check_context_group_in_node,
    context_parallel_mesh,
    enable_context_parallel,
)

FLOW = FlowConfig(shift=3.0)
TEXT_TOKENS = 8
WAN_CASES = ("wan", "wan_ac", "wan_lora", "wan_experts", "wan_ddp", "wan_fsdp")
JOINT_CASES = ("cogvideox", "easyanimate")


def _model_config(case: str) -> ModelConfig:
    family = case.split("_")[0]
    experts = ExpertsConfig(boundary_ratio=0.9, layout="shared") if case == "wan_experts" else None
    return ModelConfig(family=family, text_encoder="tiny_random", max_sequence_length=TEXT_TOKENS, experts=experts)


def _build(case: str):
    """(family, transformer) of a case, alike on every rank: the tiny model with every weight moved off its init
    (zero-initialised layers would give zero gradients upstream), LoRA adapters with a non-zero B for `*_lora`."""
    from vidray.models import get_family
    from vidray.models.lora import apply_lora

    cfg = _model_config(case)
    family = get_family(cfg.family)
    transformer = family.load_diffusion_models(cfg, seed=0).transformer
    with torch.no_grad():
        for i, param in enumerate(transformer.parameters()):
            param.add_(0.02 * torch.randn(param.shape, generator=torch.Generator().manual_seed(i)))
    if case.endswith("_lora"):
        apply_lora(transformer, LoraConfig(rank=4), seed=1)
        with torch.no_grad():
            for i, (name, param) in enumerate(transformer.named_parameters()):
                if ".lora_B." in name:
                    param.copy_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(100 + i)))
    return family, transformer.float().train()


def _batch(family, transformer):
    """Two samples of the family's example bucket: latents, prompt embeddings, mask, and per-sample generators."""
    config = transformer.first_expert.config if hasattr(transformer, "first_expert") else transformer.config
    g = torch.Generator().manual_seed(3)
    latents = torch.randn(family.latent_shape(Bucket(*family.example_bucket), 2), generator=g)
    text_width = config[family.card.planner.text_width_key]
    embeds = torch.randn(2, TEXT_TOKENS, text_width, generator=g)
    return latents, embeds, torch.ones(2, TEXT_TOKENS, dtype=torch.bool)


def _measure(family, model, latents, embeds, mask):
    """(forward output at timesteps 950 and 300, loss, {name: grad}) of one model. 950 and 300 fall on either side
    of a two-expert model's boundary (900), so both experts run."""
    from vidray.train.step import flow_matching_step_loss, sample_generator

    with torch.no_grad():
        out = family.predict(model, latents, torch.tensor([950.0, 300.0]), embeds, mask)
    generators = [sample_generator(0, 1, key) for key in (7, 8)]
    loss = flow_matching_step_loss(family, model, latents, embeds, mask, FLOW, generators)
    loss.backward()
    # checkpoint_wrapper adds `_checkpoint_wrapped_module` to the names (its state-dict hooks drop it, this does too)
    return out, loss.detach(), {n.replace("._checkpoint_wrapped_module", ""): p.grad
                                for n, p in model.named_parameters() if p.grad is not None}


def _compare(case: str, mesh) -> dict:
    import torch.distributed as dist

    from vidray.train.parallel import apply_activation_checkpointing, apply_fsdp, mixed_precision_policy, wrap_ddp

    family, ref = _build(case)
    cp = copy.deepcopy(ref)
    enable_context_parallel(cp, mesh, family=family.name)
    if case != "wan" and not case.endswith("_lora"):  # wan_experts: checkpoint_wrapper (no diffusers' own)
        apply_activation_checkpointing(cp, "full", family.block_lists(cp))
    blocks = family.block_lists(cp)
    if case == "wan_ddp":  # DDP and FSDP average over the group's ranks, which hold partial sums
        cp = wrap_ddp(cp, "cpu", {})
    elif case == "wan_fsdp":
        cp = apply_fsdp(cp, mesh["dp", "ring", "ulysses"]._flatten("dp_cp"), mixed_precision_policy("no"),
                        blocks=blocks[0])
    seen = []  # [video, text] tokens a rank's second block sees: half of each when split (Wan's text stays whole)
    for one in blocks:
        one[1].register_forward_pre_hook(lambda m, args, kwargs: seen.append(
            [(args[i] if len(args) > i else kwargs[name]).shape[1]
             for i, name in enumerate(("hidden_states", "encoder_hidden_states"))]), with_kwargs=True)
    batch = _batch(family, ref)
    out_ref, loss_ref, grads_ref = _measure(family, ref, *batch)
    out_cp, loss_cp, grads_cp = _measure(family, cp, *batch)
    dot = ref_sq = cp_sq = 0.0
    for name, g_ref in grads_ref.items():
        g = grads_cp.get(name, grads_cp.get("module." + name))  # DDP's names start with module.
        if g is None:
            g = torch.zeros_like(g_ref)
        elif case in ("wan_ddp", "wan_fsdp"):  # averaged over the 2 ranks by the wrapper: the sum is twice that
            g = 2 * (g.full_tensor() if hasattr(g, "full_tensor") else g)
        else:  # each rank's gradient is its tokens' share: the full one is their sum
            g = g.clone()
            dist.all_reduce(g)
        dot += (g * g_ref).sum().item()
        ref_sq += g_ref.pow(2).sum().item()
        cp_sq += g.pow(2).sum().item()
    return {"forward_max_abs_diff": (out_cp - out_ref).abs().max().item(),
            "out_max_abs": out_ref.abs().max().item(),
            "loss_rel_diff": abs(loss_cp.item() / loss_ref.item() - 1),
            "grad_cosine": dot / (ref_sq ** 0.5 * cp_sq ** 0.5),
            "grad_names": sorted(grads_ref), "cp_grad_names": sorted(n.removeprefix("module.") for n in grads_cp),
            "tokens_seen": seen, "tokens_whole": _whole_tokens(family, ref, batch[0])}


def _whole_tokens(family, model, latents) -> list[int]:
    """[video, text] tokens of the whole sample."""
    from vidray.models.context_parallel import _video_tokens

    config = model.first_expert.config if hasattr(model, "first_expert") else model.config
    shape = latents.shape if family.name != "cogvideox" else latents.permute(0, 2, 1, 3, 4).shape
    return [_video_tokens(family.name, config, torch.empty(shape, device="meta")), TEXT_TOKENS]


def _refusals(mesh) -> dict:
    """{check: the ValueError's message, or None when nothing was raised}: each runs on both ranks before any
    collective, so a refusal leaves the group usable."""
    from diffusers import WanTransformer3DModel

    from vidray.models import get_family as family_of

    _, wan = _build("wan")

    def message(call) -> str | None:
        try:
            call()
        except ValueError as err:
            return str(err)
        return None

    from diffusers.models.attention_processor import AttnProcessor2_0

    _, cogvideox = _build("cogvideox")
    _, other_processor = _build("cogvideox")
    other_processor.set_attn_processor(AttnProcessor2_0())  # calls SDPA on its own: would attend per chunk
    one_head = WanTransformer3DModel.from_config({**wan.config, "num_attention_heads": 1, "attention_head_dim": 32})
    enable_context_parallel(wan, mesh, family="wan")
    enable_context_parallel(cogvideox, mesh, family="cogvideox")
    text = torch.zeros(1, TEXT_TOKENS, wan.config.text_dim)
    return {
        "processor": message(lambda: enable_context_parallel(other_processor, mesh, family="cogvideox")),
        # 7 text tokens: joint attention splits them too
        "text_tokens": message(lambda: family_of("cogvideox").predict(
            cogvideox, torch.zeros(1, 16, 3, 4, 4), torch.tensor([500.0]), torch.zeros(1, 7, 64),
            torch.ones(1, 7, dtype=torch.bool))),
        "mesh": message(lambda: context_parallel_mesh(ulysses=3, ring=1)),
        "heads": message(lambda: enable_context_parallel(one_head, mesh, family="wan")),
        "no_plan": message(lambda: enable_context_parallel(torch.nn.Linear(2, 2), mesh, family="animatediff")),
        "twice": message(lambda: enable_context_parallel(wan, mesh, family="wan")),
        # (1, 16, 1, 6, 2) latents: 1 x 3 x 1 = 3 tokens after Wan's (1, 2, 2) patches
        "tokens": message(lambda: wan(hidden_states=torch.zeros(1, 16, 1, 6, 2), timestep=torch.tensor([500.0]),
                                      encoder_hidden_states=text, return_dict=False)),
    }


def _rank(rank: int, world: int, port: int, out_dir: str, cases: tuple[str, ...]) -> None:
    import torch.distributed as dist

    join_gloo(rank, world, port)
    results = {}
    try:
        mesh = context_parallel_mesh(ulysses=2, ring=1)
        for case in cases:
            try:
                results[case] = _refusals(mesh) if case == "refusals" else _compare(case, mesh)
            except Exception:  # noqa: BLE001 - reported to the test
                results[case] = {"error": traceback.format_exc()}
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


def _run(tmp_path: Path, cases: tuple[str, ...]) -> dict:
    start_ranks(_rank, (2, free_port(), str(tmp_path), cases), 2)
    return [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(2)]


def _assert_equal_to_one_process(ranks: list[dict], case: str) -> None:
    for rank, results in enumerate(ranks):
        got = results[case]
        assert "error" not in got, got.get("error")
        assert got["forward_max_abs_diff"] <= 1e-5 and got["out_max_abs"] > 0.1, (case, rank, got)
        assert got["loss_rel_diff"] <= 1e-5, (case, rank, got)
        assert got["grad_cosine"] >= 0.9999, (case, rank, got)
        assert got["grad_names"] and got["cp_grad_names"] == got["grad_names"], (case, rank)
        # the sequence was split: every block after the first saw half of the video, and of the text where the
        # attention is joint (Wan's text is cross-attention's keys and values: whole on every rank)
        video, text = got["tokens_whole"]
        split = [video // 2, text if case.startswith("wan") else text // 2]
        assert got["tokens_seen"] and all(seen == split for seen in got["tokens_seen"]), (case, rank, got)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Every case's measurements on both ranks, from one spawn of two gloo ranks."""
    return _run(tmp_path_factory.mktemp("cp"), (*WAN_CASES, *JOINT_CASES, "refusals"))


@pytest.mark.parametrize("case", WAN_CASES)
def test_wan_split_over_two_ranks_matches_one_process(ranks, case):
    """Forward, loss and the ranks' summed gradients of Wan under Ulysses 2 equal the unsplit model's: plain, with
    activation checkpointing applied after, with LoRA applied before (adapter gradients), both experts of the
    two-expert wrapper (checkpointed with `checkpoint_wrapper`), and under DDP and FSDP2 applied last (which average
    the ranks' partial sums: twice their gradient is the full one, so the loop scales the loss by the degree)."""
    _assert_equal_to_one_process(ranks, case)
    if case == "wan_lora":
        assert all(".lora_" in name for name in ranks[0][case]["grad_names"])
    if case == "wan_experts":
        assert {name.split(".")[0] for name in ranks[0][case]["grad_names"]} == {"transformer", "transformer_2"}


@pytest.mark.parametrize("case", JOINT_CASES)
def test_joint_attention_families_split_text_and_video_and_match_one_process(ranks, case):
    """CogVideoX and EasyAnimate (joint attention over [text; video]): vidray's plan splits both and its processors
    run diffusers' context-parallel attention; forward, loss and summed gradients equal the unsplit model's."""
    _assert_equal_to_one_process(ranks, case)


def test_refusals_are_one_line_value_errors_that_name_the_fix(ranks):
    """Checked on both ranks: a degree that does not divide the workers, heads that ulysses does not divide, a
    family without a plan, a second enable, an attention processor that would bypass the context-parallel
    attention, and at the first forward video or (joint attention) text tokens that do not divide the degree
    (instead of diffusers' bare assert inside the split hook)."""
    for results in ranks:
        got = results["refusals"]
        assert "error" not in got, got.get("error")
        assert got["mesh"] == ("parallel.context: degree 3 (ulysses 3 x ring 1) must divide the 2 workers; use a "
                               "multiple of 3 workers or another degree")
        assert got["heads"] == ("parallel.context.ulysses: 2 must divide the transformer's 1 attention heads (each "
                                "worker attends with heads / ulysses of them); pick a divisor of 1, or use ring")
        assert got["no_plan"].startswith("parallel.context: model.family animatediff has no context-parallel plan")
        assert got["twice"].startswith("enable_context_parallel: this WanTransformer3DModel is already parallel")
        assert got["tokens"] == ("parallel.context: wan's transformer got 3 video latent tokens (latents (1, 16, 1, "
                                 "6, 2)), not divisible by the context degree 2 (each worker takes an equal share); "
                                 "pick buckets whose latent tokens divide by 2")
        assert got["processor"].startswith("parallel.context: cogvideox's attention transformer_blocks.0.attn1 runs "
                                           "AttnProcessor2_0, which does not call diffusers' dispatch_attention_fn")
        assert got["text_tokens"] == ("parallel.context: cogvideox's transformer got 7 text tokens, not divisible by "
                                      "the context degree 2 (joint attention splits text with video); set "
                                      "model.max_sequence_length to a multiple of 2")
        assert all("\n" not in message for message in got.values())


def test_ring_is_refused_on_the_native_sdpa_backend_which_returns_no_log_sum_exp():
    """Checked here on one process (`enable_context_parallel` runs this check per expert with the mesh's ring size;
    a second mesh built inside the ranks made gloo's connection setup flaky on a loaded 2-core machine)."""
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    from vidray.models.context_parallel import _check_backend

    _check_backend(WanAttnProcessor(), ring=1)
    with pytest.raises(ValueError, match=r"^parallel.context.ring: 2 needs an attention backend that returns the "
                                         r"log-sum-exp; the native SDPA backend does not: set DIFFUSERS_ATTN_BACKEND"):
        _check_backend(WanAttnProcessor(), ring=2)


def test_cards_say_context_parallel_exactly_for_the_families_with_a_plan():
    assert {card.name for card in all_cards() if card.context_parallel} == set(CONTEXT_PARALLEL_FAMILIES)


def test_a_context_group_larger_than_a_node_needs_cross_node():
    check_context_group_in_node(8, 8, cross_node=False)
    check_context_group_in_node(16, 8, cross_node=True)
    with pytest.raises(ValueError, match=r"^parallel.context: degree 16 is larger than a node's 8 workers.*set "
                                         r"parallel.context.cross_node: true$"):
        check_context_group_in_node(16, 8, cross_node=False)


@pytest.mark.parametrize("family", JOINT_CASES)
def test_vidray_processors_without_a_parallel_config_are_the_stock_ones(family):
    """CogVideoX's and EasyAnimate's processors (copies of the stock ones ending in `dispatch_attention_fn`) give
    the stock transformer's output when not split, so context parallel changes nothing but where tokens live."""
    from vidray.models.context_parallel import _PROCESSORS

    fam, stock = _build(family)
    ours = copy.deepcopy(stock)
    stock_name, replacement = _PROCESSORS[family]
    attention = [m for m in ours.modules() if hasattr(m, "set_processor")]
    assert attention and all(type(m.processor).__name__ == stock_name for m in attention)
    for module in attention:
        module.set_processor(replacement())
    latents, embeds, mask = _batch(fam, stock)
    timesteps = torch.tensor([950.0, 300.0])
    with torch.no_grad():
        want = fam.predict(stock, latents, timesteps, embeds, mask)
        got = fam.predict(ours, latents, timesteps, embeds, mask)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
