"""Wan 2.2 A14B's two experts as two worker groups (issue 29, `model.experts` layout groups): each expert draws its
training sigmas from its side of the boundary only, with the distribution of the whole range conditioned on it;
and on two gloo processes (one per expert; how ranks split by their nodes' labels: `test_expert_config.py`) each
trains its own expert over its own group, the log window gives each expert's loss, a sharded checkpoint holds both
experts under `TwoExperts`' names (loaded back by each rank, and as one `TwoExperts` in one process), and rank 0
gathers both for the export; on four (two per expert) each expert is sharded with FSDP over its own group, trains
as one process would, resumes, and loads its own subfolder of a pretrained folder on the meta device."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from tests.conftest import free_port, join_gloo, start_ranks

from vidray.config import ExpertsConfig, FlowConfig, ModelConfig
from vidray.buckets import Bucket
from vidray.diffusion.flow_matching import sample_sigmas
from vidray.models.experts import EXPERTS, ExpertSlot, TwoExperts, expert_sigma_range
from vidray.models.registry import get_family
from vidray.train.checkpoint import CheckpointManager, TrainState, load_checkpoint, save_sharded_checkpoint
from vidray.train.expert_groups import ExpertGroups, form_expert_groups, full_expert_state, gather_experts_to_rank0
from vidray.train.parallel import _load_pretrained_shards, apply_fsdp, mixed_precision_policy
from vidray.train.step import flow_matching_step_loss, sample_generator
from vidray.train.window import ClosedWindow, LogWindow, step_line

FAMILY = get_family("wan")
MODEL = ModelConfig(family="wan", text_encoder="tiny_random", max_sequence_length=8,
                    experts=ExpertsConfig(boundary_ratio=0.9))
FLOW = FlowConfig(sigma_sampling="logit_normal", shift=5.0)
NAME = "checkpoint_000002"


@pytest.mark.parametrize("flow", [FlowConfig(sigma_sampling="uniform", shift=1.0),
                                  FlowConfig(sigma_sampling="logit_normal", shift=5.0),
                                  FlowConfig(sigma_sampling="logit_normal", logit_mean=0.5, logit_std=0.7, shift=3.0)],
                         ids=["uniform", "logit_normal_shift5", "logit_normal_shifted_mean"])
@pytest.mark.parametrize("expert", EXPERTS)
def test_an_experts_sigmas_follow_the_whole_ranges_distribution_conditioned_on_its_side(flow, expert):
    lo, hi = expert_sigma_range(expert, 0.9)
    whole = sample_sigmas(400_000, flow, generator=torch.Generator().manual_seed(0))
    side = whole[(whole >= lo) & (whole <= hi)]
    drawn = sample_sigmas(40_000, flow, generator=torch.Generator().manual_seed(1), sigma_range=(lo, hi))
    assert drawn.dtype == torch.float32 and drawn.shape == (40_000,)
    assert bool(((drawn >= lo) & (drawn <= hi)).all())
    q = torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95], dtype=torch.float64)
    torch.testing.assert_close(torch.quantile(drawn.double(), q), torch.quantile(side.double(), q), atol=4e-3, rtol=0)
    again = sample_sigmas(8, flow, generator=torch.Generator().manual_seed(1), sigma_range=(lo, hi))
    assert torch.equal(again, drawn[:8])  # one generator, one draw per sample: the same sigmas again


@pytest.mark.parametrize("expert", EXPERTS)
def test_every_timestep_an_expert_trains_on_is_one_the_sampler_routes_to_it(expert):
    sigmas = sample_sigmas(100_000, FLOW, generator=torch.Generator().manual_seed(2),
                           sigma_range=expert_sigma_range(expert, 0.9))
    timesteps = FAMILY.objective.model_timesteps(sigmas, 1000)
    high = timesteps >= 0.9 * 1000  # TwoExperts.high_noise: the stock pipelines' per-step rule
    assert bool(high.all()) if expert == "high" else not bool(high.any())


def test_a_sigma_range_outside_the_unit_interval_or_empty_is_refused():
    for bad in [(0.5, 0.5), (0.6, 0.4), (-0.1, 0.5), (0.5, 1.5)]:
        with pytest.raises(ValueError, match="sigma_range must satisfy 0 <= lo < hi <= 1"):
            sample_sigmas(2, FLOW, sigma_range=bad)
    with pytest.raises(ValueError, match="boundary_ratio must be a number in"):
        expert_sigma_range("high", 1.0)


def _expert(expert: str, seed: int) -> ExpertSlot:
    return ExpertSlot(FAMILY.load_diffusion_models(MODEL, seed=seed, expert=expert).transformer, expert)


def _train(model, transformer, optimizer, groups, steps: range) -> list[float]:
    """Steps of one micro-batch per rank: the sample keys are the step's, alike on every rank (both experts train
    the same samples, each on its side of the boundary)."""
    bucket = Bucket(*FAMILY.example_bucket)
    text_dim = transformer.config.text_dim
    losses = []
    for step in steps:
        data = torch.Generator().manual_seed(step)
        latents = torch.randn(FAMILY.latent_shape(bucket, 2), generator=data)
        embeds = torch.randn(2, MODEL.max_sequence_length, text_dim, generator=data)
        mask = torch.ones(2, MODEL.max_sequence_length, dtype=torch.bool)
        generators = [sample_generator(0, step, key) for key in (step, step + 100)]
        optimizer.zero_grad(set_to_none=True)
        loss = flow_matching_step_loss(FAMILY, model, latents, embeds, mask, FLOW, generators,
                                       loss_weights=torch.full((2,), 0.5), sigma_range=groups.sigma_range)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


@contextlib.contextmanager
def expert_rank(rank: int, world: int, port: int, out: Path) -> Iterator[tuple[ExpertGroups, dict]]:
    """In a rank `start_ranks` started: the gloo group, this rank's `ExpertGroups` (no node labels: the experts
    split in rank order; boundary 0.9) and a result dict, which rank 0 saves to `out` at the end whatever happens
    (the test reads it); then the process group is destroyed."""
    join_gloo(rank, world, port)
    result: dict = {}
    try:
        yield form_expert_groups(rank, world, {}, {}, 0.9), result
    finally:
        if rank == 0:
            torch.save(result, out)
        dist.destroy_process_group()


def _worker(rank: int, world: int, port: int, tmp: str) -> None:
    tmp_path = Path(tmp)
    with expert_rank(rank, world, port, tmp_path / "result.pt") as (groups, result):
        transformer = _expert(groups.expert, seed=0)
        model = torch.nn.parallel.DistributedDataParallel(transformer, process_group=groups.group)
        optimizer = torch.optim.AdamW(transformer.parameters(), lr=1e-3)
        lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        window = LogWindow(world, expert=groups.expert, expert_sizes={e: len(r) for e, r in groups.ranks.items()})
        for loss in _train(model, transformer, optimizer, groups, range(1, 3)):
            window.add(loss, torch.zeros(()), 1e-3, [0, 0.0, 0.0, 0.0])
        closed = window.close(2, epoch=0, lr_now=1e-3, step_time_s=1.0,
                              data={"data_wait_fraction": 0.0, **{f"{s}_busy_fraction": 0.0 for s in
                                                                  ("decode", "vae", "text", "dit")}})
        local = tmp_path / f"snapshot-rank{rank}"  # every rank its own folder, as on separate nodes
        save_sharded_checkpoint(local, model=transformer, optimizer=optimizer, lr_scheduler=lr_scheduler,
                                train_state=TrainState(2, 0, 4, world, ""), job_config={"name": "t"}, rank=rank,
                                world_size=world, optimizer_key=groups.optimizer_key)
        CheckpointManager(tmp_path / "run").upload_shard(local, NAME)
        dist.barrier()
        after = _train(model, transformer, optimizer, groups, range(3, 5))
        # A fresh expert of other initial weights resumes from the checkpoint and takes the same steps 3 and 4.
        fresh = _expert(groups.expert, seed=1)
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
        state = load_checkpoint(tmp_path / "run" / NAME, transformer=fresh, optimizer=fresh_optimizer,
                                lr_scheduler=torch.optim.lr_scheduler.LambdaLR(fresh_optimizer, lambda step: 1.0),
                                optimizer_key=groups.optimizer_key)
        resumed = _train(torch.nn.parallel.DistributedDataParallel(fresh, process_group=groups.group), fresh,
                         fresh_optimizer, groups, range(3, 5))
        everyone = [None] * world
        dist.all_gather_object(everyone, {"expert": groups.expert, "ranks": groups.ranks, "step": state.step,
                                          "after": [x.item() for x in after], "resumed": [x.item() for x in resumed],
                                          "window": {e: v["loss"] for e, v in closed.experts.items()},
                                          "loss": closed.losses,
                                          "weights": {k: v.clone() for k, v in transformer.state_dict().items()}})
        result["ranks"] = everyone
        result["gathered"] = gather_experts_to_rank0(groups, transformer.state_dict())


@pytest.mark.slow
def test_two_ranks_train_one_expert_each_resume_from_one_checkpoint_and_gather_both_for_the_export(tmp_path):
    start_ranks(_worker, (2, free_port(), str(tmp_path)), 2)
    result = torch.load(tmp_path / "result.pt", weights_only=False)
    high, low = result["ranks"]
    assert (high["expert"], low["expert"]) == ("high", "low") and high["ranks"] == {"high": [0], "low": [1]}
    for rank in (high, low):
        assert rank["step"] == 2 and rank["resumed"] == pytest.approx(rank["after"], abs=1e-6)
    # The window's mean over ranks and each expert's own loss, as every rank sees them.
    assert high["window"] == low["window"] and set(high["window"]) == {"high", "low"}
    assert high["loss"] == pytest.approx([(a + b) / 2 for a, b in zip(high["window"]["high"], high["window"]["low"])])
    # One sharded checkpoint holds both experts under TwoExperts' names: one process loads it as a TwoExperts.
    two = FAMILY.load_diffusion_models(MODEL, seed=3).transformer
    assert isinstance(two, TwoExperts)
    from vidray.models.export import sharded_entries

    saved = sharded_entries(tmp_path / "run" / NAME, "model")
    assert set(saved) == set(two.state_dict())
    two.load_state_dict(saved, strict=True)
    assert set(high["weights"]) | set(low["weights"]) == set(saved)
    assert all(name.startswith("transformer.") for name in high["weights"])
    # Rank 0 gets both experts' final weights, each from its own rank.
    gathered = result["gathered"]
    assert set(gathered) == set(saved)
    for rank in (high, low):
        for name, tensor in rank["weights"].items():
            assert torch.equal(gathered[name], tensor), name
    two.load_state_dict(gathered, strict=True)


def test_the_step_line_shows_each_experts_loss_after_the_mean_and_the_lr_the_step_used():
    # A fresh-user trial: the per-expert losses were only in TensorBoard, and the line's lr was the next step's.
    metrics = {"step": 1, "loss": 1.5379, "step_time_s": 0.1, "lr": 2e-4, "loss_high": 1.5227, "loss_low": 1.5532}
    closed = ClosedWindow(1, [1.5379], [1.0], [1e-4], metrics, (0.0, 0.0, 0.1),
                          {"high": {"loss": [1.5227], "grad_norm": [1.0]},
                           "low": {"loss": [1.5532], "grad_norm": [1.0]}})
    data = {"data_wait_fraction": 0.0, **{f"{s}_busy_fraction": 0.5 for s in ("decode", "vae", "text", "dit")},
            **{k: 0.0 for k in ("hot_hits", "hot_misses", "warm_hits", "warm_misses", "decode_clips", "latent_hits",
                                "latent_misses", "bytes_fetched")}}
    line = step_line(closed, max_steps=6, data=data, prefetch_lead=1)
    assert line.startswith("step 1/6 loss 1.5379 high 1.5227 low 1.5532 step_time 0.100 s") and " lr 1.00e-04 " in line


def _trainable_expert(expert: str, seed: int) -> ExpertSlot:
    """`_expert` with the parameters no gradient reaches frozen, as the training loop sets it up."""
    slot = _expert(expert, seed)
    no_grad = set(FAMILY.no_grad_parameter_names(slot))
    for name, param in slot.named_parameters():
        param.requires_grad_(name not in no_grad)
    return slot


def _fsdp_expert(groups, mesh, seed: int):
    slot = _trainable_expert(groups.expert, seed)
    return apply_fsdp(slot, mesh, mixed_precision_policy("no"), blocks=FAMILY.block_lists(slot)[0])


def _fsdp_worker(rank: int, world: int, port: int, tmp: str) -> None:
    tmp_path = Path(tmp)
    with expert_rank(rank, world, port, tmp_path / "fsdp.pt") as (groups, result):
        mesh = groups.shard_mesh("cpu")
        slot = _fsdp_expert(groups, mesh, seed=0)
        optimizer = torch.optim.AdamW([p for p in slot.parameters() if p.requires_grad], lr=1e-3)
        lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        first = [x.item() for x in _train(slot, slot, optimizer, groups, range(1, 3))]
        local = tmp_path / f"snapshot-rank{rank}"
        save_sharded_checkpoint(local, model=slot, optimizer=optimizer, lr_scheduler=lr_scheduler,
                                train_state=TrainState(2, 0, 4, world, ""), job_config={"name": "t"}, rank=rank,
                                world_size=world, optimizer_key=groups.optimizer_key)
        CheckpointManager(tmp_path / "run").upload_shard(local, NAME)
        dist.barrier()
        after = [x.item() for x in _train(slot, slot, optimizer, groups, range(3, 5))]
        fresh = _fsdp_expert(groups, mesh, seed=1)
        fresh_optimizer = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-3)
        load_checkpoint(tmp_path / "run" / NAME, transformer=fresh, optimizer=fresh_optimizer,
                        lr_scheduler=torch.optim.lr_scheduler.LambdaLR(fresh_optimizer, lambda step: 1.0),
                        optimizer_key=groups.optimizer_key)
        resumed = [x.item() for x in _train(fresh, fresh, fresh_optimizer, groups, range(3, 5))]
        gathered = gather_experts_to_rank0(groups, full_expert_state(slot.state_dict()))
        # A pretrained two-expert folder: each group reads its own expert's subfolder into a meta-device expert.
        cfg = ModelConfig(family="wan", text_encoder="tiny_random", max_sequence_length=8, init="pretrained",
                          pretrained_path=str(tmp_path / "pretrained"), experts=ExpertsConfig(boundary_ratio=0.9))
        built = FAMILY.load_diffusion_models(cfg, seed=0, expert=groups.expert, meta=True)
        meta, folder = built.transformer, built.weights_folder
        loaded = apply_fsdp(ExpertSlot(meta, groups.expert), mesh, mixed_precision_policy("no"),
                            blocks=FAMILY.block_lists(ExpertSlot(meta, groups.expert))[0])
        _load_pretrained_shards(loaded, folder, device=torch.device("cpu"), seed=0,
                                restore_buffers=FAMILY.restore_buffers)
        pretrained = gather_experts_to_rank0(groups, full_expert_state(loaded.state_dict()))
        everyone = [None] * world
        dist.all_gather_object(everyone, {"expert": groups.expert, "first": first, "after": after,
                                          "resumed": resumed})
        result.update(ranks=everyone, gathered=gathered, pretrained=pretrained)


@pytest.mark.slow
def test_each_expert_shards_over_its_own_group_trains_as_one_process_resumes_and_loads_its_pretrained_folder(
        tmp_path):
    """`scaling.strategy: fsdp` with two expert groups of two ranks each: each expert is sharded over its group
    alone (the "shard" row of an (expert, shard) mesh), trains the steps one unsharded process takes on the same
    batches, resumes from a DCP checkpoint, and rank 0 gathers both experts in full; a pretrained Wan 2.2 A14B
    folder loads expert by expert into meta-device experts, each group reading its own subfolder."""
    torch.set_num_threads(1)
    components = FAMILY.build(MODEL, seed=5)
    FAMILY.save_pipeline(components, tmp_path / "pretrained", FLOW)
    start_ranks(_fsdp_worker, (4, free_port(), str(tmp_path)), 4)
    result = torch.load(tmp_path / "fsdp.pt", weights_only=False)
    assert [r["expert"] for r in result["ranks"]] == ["high", "high", "low", "low"]
    reference = {}
    for expert in EXPERTS:
        slot = _trainable_expert(expert, seed=0)
        optimizer = torch.optim.AdamW([p for p in slot.parameters() if p.requires_grad], lr=1e-3)
        side = SimpleNamespace(sigma_range=expert_sigma_range(expert, 0.9))
        losses = [x.item() for x in _train(slot, slot, optimizer, side, range(1, 5))]
        reference.update({name: tensor for name, tensor in slot.state_dict().items()})
        for rank in (r for r in result["ranks"] if r["expert"] == expert):
            assert rank["first"] + rank["after"] == pytest.approx(losses, abs=1e-5), expert
            assert rank["resumed"] == pytest.approx(rank["after"], abs=1e-6), expert
    alone = FAMILY.load_diffusion_models(MODEL, seed=0).transformer
    assert set(result["gathered"]) == set(reference) == set(alone.state_dict())
    for name, tensor in reference.items():
        torch.testing.assert_close(result["gathered"][name], tensor, atol=1e-5, rtol=1e-4, msg=name)
    two = components.transformer  # the pretrained folder's TwoExperts
    for name, tensor in two.state_dict().items():
        assert torch.equal(result["pretrained"][name], tensor), name
