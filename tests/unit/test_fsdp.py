"""Issue 28 item 3 with the real tiny transformer over gloo (1 and 2 processes): FSDP2 (`fully_shard` per block,
then the root) trains like the unsharded model with a global gradient norm, gradient accumulation through
`gradient_sync`; sharded (DCP) checkpoints save, upload manifest-last, verify and load on 1 and 2 processes (and
into a plain model) with equal weights; a full (DDP) checkpoint loads into an FSDP model; a pretrained folder
loads shard by shard into a meta-device model; and the config refuses what FSDP does not support. LoRA, EMA and
fp16 under FSDP: `test_fsdp_adapters.py`."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tests.conftest import free_port, join_gloo, start_ranks

from vidray.config import ConfigError, FlowConfig, JobConfig, ModelConfig, job_config_from_dict
from vidray.models.registry import get_family
from vidray.train.checkpoint import (
    CheckpointManager,
    DamagedCheckpointError,
    IncompleteCheckpointError,
    TrainState,
    load_checkpoint,
    load_transformer_state,
    save_checkpoint,
    save_sharded_checkpoint,
    start_sharded_checkpoint,
    verify_checkpoint,
)
from vidray.train.parallel import (
    apply_fsdp,
    device_mesh,
    full_model_for_export,
    gradient_sync,
    is_sharded,
    load_sharded_from_safetensors,
    mixed_precision_policy,
)
from vidray.train.step import flow_matching_step_loss, non_finite_parameters, step_generator

FAMILY = get_family("easyanimate")
MODEL = ModelConfig(text_encoder="tiny_random")
FLOW = FlowConfig()
NAME = "checkpoint_000002"
TEXT_DIM = FAMILY.load_diffusion_models(MODEL, seed=0).transformer.config.text_embed_dim


def _transformer(seed: int = 0) -> torch.nn.Module:
    transformer = FAMILY.load_diffusion_models(MODEL, seed=seed).transformer
    _freeze_unused(transformer)
    return transformer


def _freeze_unused(transformer: torch.nn.Module) -> None:
    no_grad = set(FAMILY.no_grad_parameter_names(transformer))
    for name, param in transformer.named_parameters():
        param.requires_grad_(name not in no_grad)


def _batch(seed: int, batch_size: int = 2):
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(batch_size, 16, 3, 8, 8, generator=g)
    prompt_embeds = torch.randn(batch_size, 8, TEXT_DIM, generator=g)
    return latents, prompt_embeds, torch.ones(batch_size, 8, dtype=torch.bool)


def _loss(model, batch, step: int) -> torch.Tensor:
    latents, prompt_embeds, mask = batch
    return flow_matching_step_loss(FAMILY, model, latents, prompt_embeds, mask, FLOW, step_generator(0, step, 0))


def _optimizer(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)


def _lr_scheduler(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def _data_seed(step: int, micro: int, rank: int, per_rank: bool) -> int:
    return 1000 * step + 10 * micro + (rank if per_rank else 0)


def _train_steps(model, optimizer, steps: range, rank: int, world: int, per_rank: bool) -> list[list[float]]:
    """[loss of rank 0's micro-batches summed, global grad norm] per step; 2 micro-batches per step."""
    out = []
    for step in steps:
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for micro in range(2):
            with gradient_sync(model, micro == 1):
                loss = _loss(model, _batch(_data_seed(step, micro, rank, per_rank)), step) / 2
                loss.backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        optimizer.step()
        out.append([total, float(norm)])
    return out


def _full_state(model) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # cloned: on one process the full tensors can share storage with the parameters that go on training
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.clone() for k, v in state.items()}


def _sharded(seed: int = 0, strategy: str = "fsdp", shard_group_size: int | None = None):
    transformer = _transformer(seed)
    mesh = device_mesh(strategy, shard_group_size=shard_group_size, device_type="cpu")
    apply_fsdp(transformer, mesh, mixed_precision_policy("no"))
    return transformer


def _worker(rank: int, world: int, port: int, task: str, tmp: str) -> None:
    join_gloo(rank, world, port)
    tmp_path = Path(tmp)
    result: dict = {}
    try:
        if task.startswith("train"):  # train (fsdp), train_hsdp (groups of 1: replicated), train_hsdp2 (groups of 2)
            strategy, group = {"train": ("fsdp", None), "train_hsdp": ("hsdp", 1), "train_hsdp2": ("hsdp", 2)}[task]
            model = _sharded(strategy=strategy, shard_group_size=group)
            assert is_sharded(model)
            result["steps"] = _train_steps(model, _optimizer(model), range(1, 4), rank, world, per_rank=True)
            result["weights"] = _full_state(model)
            result["mesh"] = tuple(next(model.parameters()).device_mesh.shape)  # (replicas, shards) for hsdp
        elif task == "save_async":  # dcp.async_save: steps 3 and 4 train while the step-2 state is written
            model = _sharded()
            optimizer = _optimizer(model)
            _train_steps(model, optimizer, range(1, 3), rank, world, per_rank=False)
            local = tmp_path / f"snapshot-rank{rank}"
            with ThreadPoolExecutor(max_workers=1) as executor:
                started = start_sharded_checkpoint(
                    local, model=model, optimizer=optimizer, lr_scheduler=_lr_scheduler(optimizer),
                    train_state=TrainState(2, 0, 4, world, ""), job_config={"name": "t"}, rank=rank,
                    world_size=world, process_group=dist.new_group(backend="gloo"), executor=executor)
                result["weights"] = _full_state(model)
                result["steps"] = _train_steps(model, optimizer, range(3, 5), rank, world, per_rank=False)
                started.finish()
            CheckpointManager(tmp_path / "run").upload_shard(local, NAME)
            dist.barrier()
        elif task == "save":
            model = _sharded()
            optimizer = _optimizer(model)
            _train_steps(model, optimizer, range(1, 3), rank, world, per_rank=False)
            local = tmp_path / f"snapshot-rank{rank}"  # every rank its own folder, as on separate nodes
            save_sharded_checkpoint(local, model=model, optimizer=optimizer, lr_scheduler=_lr_scheduler(optimizer),
                                    train_state=TrainState(2, 0, 4, world, ""), job_config={"name": "t"},
                                    rank=rank, world_size=world)
            if rank == 0:
                assert json.loads((local / "manifest.json").read_text())["layout"] == "dcp"
            else:
                assert not (local / "manifest.json").exists()
            CheckpointManager(tmp_path / "run").upload_shard(local, NAME)
            dist.barrier()
            result["weights"] = _full_state(model)
            result["steps"] = _train_steps(model, optimizer, range(3, 5), rank, world, per_rank=False)
        elif task in ("load", "load_full"):
            model = _sharded(seed=1)  # other initial weights: the checkpoint must replace them all
            optimizer = _optimizer(model)
            state = load_checkpoint(tmp_path / "run" / NAME, transformer=model, optimizer=optimizer,
                                    lr_scheduler=_lr_scheduler(optimizer))
            result["step"] = state.step
            result["weights"] = _full_state(model)
            result["steps"] = _train_steps(model, optimizer, range(3, 5), rank, world, per_rank=False)
            result["non_finite"] = non_finite_parameters(model)
        elif task == "load_plain":  # scaling.strategy fsdp -> ddp: a sharded checkpoint into replicated models
            model = _transformer(seed=1)
            optimizer = _optimizer(model)
            load_checkpoint(tmp_path / "run" / NAME, transformer=model, optimizer=optimizer,
                            lr_scheduler=_lr_scheduler(optimizer))
            states = [None] * world
            dist.all_gather_object(states, {k: v.clone() for k, v in model.state_dict().items()})
            result["weights_per_rank"] = states
        elif task == "meta":
            cfg = ModelConfig(text_encoder="tiny_random", init="pretrained", pretrained_path=str(tmp_path / "pretrained"))
            built = FAMILY.load_diffusion_models(cfg, seed=0, meta=True)
            model, folder = built.transformer, built.weights_folder
            assert next(model.parameters()).is_meta
            _freeze_unused_like(model)
            apply_fsdp(model, device_mesh("fsdp", device_type="cpu"), mixed_precision_policy("no"))
            result["loaded"] = load_sharded_from_safetensors(model, folder, device="cpu")
            full = full_model_for_export(model, model,
                                         lambda: FAMILY.load_diffusion_models(MODEL, seed=5).transformer, rank)
            if rank == 0:
                result["weights"] = full.state_dict()
                result["probe"] = FAMILY.probe_loss(full, full).item()
        else:
            raise ValueError(task)
    finally:
        if rank == 0:
            torch.save(result, tmp_path / f"{task}-{world}.pt")
        dist.destroy_process_group()


def _freeze_unused_like(model: torch.nn.Module) -> None:
    """The reference model's frozen names (a meta model has no values to probe with)."""
    frozen = {n for n, p in _transformer().named_parameters() if not p.requires_grad}
    for name, param in model.named_parameters():
        param.requires_grad_(name not in frozen)



def _run(task: str, world: int, tmp_path: Path) -> dict:
    start_ranks(_worker, (world, free_port(), task, str(tmp_path)), world)
    return torch.load(tmp_path / f"{task}-{world}.pt", weights_only=False)


def _reference_steps(per_rank_world: int) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """The same 3 steps unsharded in this process: each micro-batch's loss the mean over the ranks' batches."""
    torch.set_num_threads(1)
    model = _transformer()
    optimizer = _optimizer(model)
    out = []
    for step in range(1, 4):
        optimizer.zero_grad(set_to_none=True)
        rank0 = 0.0
        for micro in range(2):
            losses = [_loss(model, _batch(_data_seed(step, micro, r, True)), step) / 2 for r in range(per_rank_world)]
            (sum(losses) / per_rank_world).backward()
            rank0 += losses[0].item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        out.append([rank0, float(norm)])
    return out, model.state_dict()


@pytest.mark.parametrize("task,world", [("train", 2), ("train_hsdp", 2), ("train_hsdp2", 4)],
                         ids=["fsdp-2", "hsdp-2-groups-of-1", "hsdp-2-groups-of-2"])
@pytest.mark.slow
def test_fsdp_trains_like_the_unsharded_model_with_a_global_grad_norm_and_accumulation(task, world, tmp_path):
    """HSDP with 2 groups of 2 (4 ranks): each shard group holds the model once, the gradients are averaged over
    the groups too; every case matches the unsharded model's steps over the same `world` batches."""
    got = _run(task, world, tmp_path)
    assert got["mesh"] == {"train": (2,), "train_hsdp": (2, 1), "train_hsdp2": (2, 2)}[task]
    want, weights = _reference_steps(world)
    for (loss, norm), (ref_loss, ref_norm) in zip(got["steps"], want, strict=True):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert norm == pytest.approx(ref_norm, rel=1e-4)  # the norm of the whole gradient, not of a shard
    assert got["steps"][-1][0] < got["steps"][0][0] * 1.5  # it trains (and did not blow up)
    for name, value in weights.items():
        torch.testing.assert_close(got["weights"][name], value, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("save", ["save", "save_async"])
def test_sharded_checkpoint_saves_manifest_last_and_resumes_on_1_2_and_4_processes_and_in_a_plain_model(save, tmp_path):
    """`save_async` trains steps 3 and 4 while the step-2 checkpoint is written (dcp.async_save): what loads is
    the step-2 state all the same, and training from it repeats those steps exactly."""
    saved = _run(save, 2, tmp_path)
    folder = tmp_path / "run" / NAME
    manifest = verify_checkpoint(folder)  # every rank's file: size and sha256
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp", "train_state.json"} <= set(manifest["parts"])
    assert set(manifest["files"]) == set(manifest["parts"])
    # DCP reshards on load: the same weights on any process count (4: once, for the synchronous save)
    for world in (2, 1, 4) if save == "save" else (2, 1):
        loaded = _run("load", world, tmp_path)
        assert loaded["step"] == 2 and loaded["non_finite"] == []
        for name, value in saved["weights"].items():
            assert torch.equal(loaded["weights"][name], value), (world, name)
        # every rank trains the same data here, so any world size takes the same steps
        if world == 2:
            assert loaded["steps"] == saved["steps"]  # exact at the same world size
        else:
            for (a, b), (c, d) in zip(loaded["steps"], saved["steps"], strict=True):
                assert a == pytest.approx(c, rel=1e-5) and b == pytest.approx(d, rel=1e-4)
    # into plain (replicated, DDP-style) models on 2 processes: every rank holds all of it
    for state in _run("load_plain", 2, tmp_path)["weights_per_rank"]:
        for name, value in saved["weights"].items():
            assert torch.equal(state[name], value), name
    # into a plain (unsharded, DDP-style) model without a process group, and as the serving path reads it
    plain = _transformer(seed=1)
    optimizer = _optimizer(plain)
    load_checkpoint(folder, transformer=plain, optimizer=optimizer, lr_scheduler=_lr_scheduler(optimizer))
    served = load_transformer_state(folder)
    for name, value in saved["weights"].items():
        assert torch.equal(plain.state_dict()[name], value), name
        assert torch.equal(served[name], value), name


@pytest.mark.slow
def test_a_damaged_or_unfinished_shard_is_refused_naming_the_file(tmp_path):
    _run("save", 2, tmp_path)
    folder = tmp_path / "run" / NAME
    shard = folder / "dcp" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DamagedCheckpointError, match=r"dcp/__1_0.distcp does not match the sha256"):
        verify_checkpoint(folder)
    (folder / "manifest.json").unlink()
    assert CheckpointManager(tmp_path / "run").latest() is None
    with pytest.raises(IncompleteCheckpointError, match="has no manifest.json"):
        verify_checkpoint(folder)


@pytest.mark.slow
def test_rank0_upload_writes_the_manifest_only_after_every_rank_s_files_arrive(tmp_path):
    _run("save", 2, tmp_path)
    run = CheckpointManager(tmp_path / "late")
    done = threading.Event()

    def rank0():
        run.upload_shard(tmp_path / "snapshot-rank0", NAME, wait_s=30)
        done.set()

    thread = threading.Thread(target=rank0)
    thread.start()
    thread.join(1.0)
    assert not done.is_set() and not run.is_complete(NAME)  # rank 1's shard is not there yet
    run.upload_shard(tmp_path / "snapshot-rank1", NAME)
    thread.join(30)
    assert done.is_set() and run.latest() == NAME
    verify_checkpoint(tmp_path / "late" / NAME)
    # a rank that never uploads: rank 0 gives up, the checkpoint stays incomplete
    lonely = CheckpointManager(tmp_path / "lonely")
    with pytest.raises(Exception, match="did not reach"):
        lonely.upload_shard(tmp_path / "snapshot-rank0", NAME, wait_s=0.3)
    assert lonely.latest() is None


@pytest.mark.slow
def test_a_full_ddp_checkpoint_loads_into_an_fsdp_model(tmp_path):
    torch.set_num_threads(1)
    model = _transformer()
    optimizer = _optimizer(model)
    _train_steps(model, optimizer, range(1, 3), 0, 1, per_rank=False)
    save_checkpoint(tmp_path / "run" / NAME, model=model, optimizer=optimizer, lr_scheduler=_lr_scheduler(optimizer),
                    train_state=TrainState(2, 0, 4, 1, ""), job_config={"name": "t"})
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    steps = _train_steps(model, optimizer, range(3, 5), 0, 1, per_rank=False)
    loaded = _run("load_full", 2, tmp_path)
    for name, value in weights.items():
        assert torch.equal(loaded["weights"][name], value), name
    for (a, b), (c, d) in zip(loaded["steps"], steps, strict=True):
        assert a == pytest.approx(c, rel=1e-5) and b == pytest.approx(d, rel=1e-4)


def test_a_pretrained_folder_loads_shard_by_shard_into_a_meta_model(tmp_path):
    reference = FAMILY.load_diffusion_models(MODEL, seed=3).transformer
    reference.save_pretrained(tmp_path / "pretrained", max_shard_size="200KB")  # several safetensors files
    assert len(list((tmp_path / "pretrained").glob("*.safetensors"))) > 1
    got = _run("meta", 2, tmp_path)
    state = reference.state_dict()
    assert got["loaded"] == len(state)
    for name, value in state.items():
        assert torch.equal(got["weights"][name], value), name
    assert got["probe"] == pytest.approx(FAMILY.probe_loss(reference, reference).item(), rel=1e-6)


def _job(**scaling) -> dict:
    return {"name": "t", "data": {"shards_dir": "/tmp/x"}, "scaling": {"num_workers": 4, **scaling}}


@pytest.mark.parametrize("scaling, train, message", [
    ({"strategy": "hsdp"}, {}, r"scaling.strategy: hsdp needs scaling.shard_group_size"),
    ({"strategy": "hsdp", "shard_group_size": 3}, {}, r"scaling.shard_group_size=3 must divide the worker count"),
    ({"shard_group_size": 2}, {}, r"scaling.shard_group_size is for scaling.strategy: hsdp only"),
    ({"strategy": "fsdp"}, {"grad_compression": "fp16"}, r"train.grad_compression: fp16 .*reduce_dtype"),
    ({"strategy": "zero3"}, {}, r"scaling.strategy"),
    ({"strategy": "fsdp"}, {"mixed_precision": "fp16"}, r"fp16 needs CUDA"),  # on CPU, as under DDP
])
def test_bad_strategy_settings_are_refused_at_load_with_the_dotted_key(scaling, train, message):
    raw = _job(**scaling)
    raw["train"] = train
    with pytest.raises((ConfigError, ValueError), match=message):
        job_config_from_dict(raw)


def test_fsdp_with_one_worker_and_hsdp_with_a_dividing_group_are_fine():
    assert job_config_from_dict({**_job(strategy="fsdp"), "scaling": {"num_workers": 1, "strategy": "fsdp"}})
    # LoRA and an EMA are sharded like the weights (tests/unit/test_fsdp_adapters.py)
    both = job_config_from_dict({**_job(strategy="fsdp"), "model": {"lora": {"rank": 4}},
                                 "train": {"ema": {"decay": 0.99}}})
    assert both.model.lora.rank == 4 and both.train.ema.decay == 0.99
    job = job_config_from_dict(_job(strategy="hsdp", shard_group_size=2))
    assert isinstance(job, JobConfig) and job.scaling.shard_group_size == 2 and job.scaling.reshard_after_forward
