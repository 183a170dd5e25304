"""Checkpoints: a round trip restores state exactly; an incomplete or damaged folder is refused, naming it and the
file; a resumed job's optim section takes effect over the restored optimizer and lr schedule."""

from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path

import pytest
import torch

from vidray.config import OptimConfig
from vidray.errors import UserError
from vidray.train.checkpoint import (
    FORMAT_VERSION,
    MANIFEST,
    CheckpointError,
    DamagedCheckpointError,
    IncompleteCheckpointError,
    TrainState,
    load_checkpoint,
    read_train_state,
    save_checkpoint,
    verify_checkpoint,
)
from vidray.train.optim import apply_optim_config, build_lr_scheduler, build_optimizer

OLD_OPTIM = OptimConfig(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01, eps=1e-8, warmup_steps=4)


def trained(steps: int = 3, optim: OptimConfig = OLD_OPTIM, seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = build_optimizer(model.parameters(), optim)
    scheduler = build_lr_scheduler(optimizer, optim)
    for _ in range(steps):
        model(torch.randn(3, 4)).square().mean().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return model, optimizer, scheduler


def write(directory: Path, steps: int = 3) -> Path:
    model, optimizer, scheduler = trained(steps)
    return save_checkpoint(directory, model=model, optimizer=optimizer,
                           lr_scheduler=scheduler, train_state=TrainState(steps, 0, steps - 1, 2, "sha256:abc"),
                           job_config={"optim": {"lr": 1e-3}})


def fresh(optim: OptimConfig = OLD_OPTIM):
    model, optimizer, scheduler = trained(0, optim, seed=1)
    return model, optimizer, scheduler


def test_round_trip_restores_weights_optimizer_and_schedule_exactly(tmp_path):
    model, optimizer, scheduler = trained(3)
    save_checkpoint(tmp_path / "c", model=model, optimizer=optimizer, lr_scheduler=scheduler,
                    train_state=TrainState(3, 0, 2, 2, "sha256:abc"), job_config={})
    model2, optimizer2, scheduler2 = fresh()
    state = load_checkpoint(tmp_path / "c", transformer=model2, optimizer=optimizer2, lr_scheduler=scheduler2)
    assert state == TrainState(3, 0, 2, 2, "sha256:abc")
    for (name, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    for a, b in zip(optimizer.state.values(), optimizer2.state.values(), strict=True):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    assert scheduler2.last_epoch == scheduler.last_epoch == 3
    assert scheduler2.get_last_lr() == scheduler.get_last_lr()
    manifest = json.loads((tmp_path / "c" / MANIFEST).read_text())
    assert manifest["format_version"] == FORMAT_VERSION == 3
    assert manifest["parts"] == ["transformer.safetensors", "optimizer.pt", "lr_scheduler.pt", "train_state.json", "config.yaml"]
    saved_optimizer = torch.load(tmp_path / "c" / "optimizer.pt", weights_only=True)
    assert set(saved_optimizer["state"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}  # by parameter name
    recorded = manifest["files"]["transformer.safetensors"]
    assert recorded["size_bytes"] == (tmp_path / "c" / "transformer.safetensors").stat().st_size


def refused(directory: Path, error_type: type, part: str) -> CheckpointError:
    model, optimizer, scheduler = fresh()
    with pytest.raises(error_type) as err:
        load_checkpoint(directory, transformer=model, optimizer=optimizer, lr_scheduler=scheduler)
    assert str(directory) in str(err.value)
    assert part in str(err.value)
    assert err.value.part == part and err.value.directory == str(directory)
    assert isinstance(err.value, UserError)  # the CLI prints it as one line
    return err.value


def test_missing_manifest_is_refused_as_unfinished(tmp_path):
    directory = write(tmp_path / "c")
    (directory / MANIFEST).unlink()
    assert "not finished" in str(refused(directory, IncompleteCheckpointError, MANIFEST))


def test_missing_part_is_refused(tmp_path):
    directory = write(tmp_path / "c")
    (directory / "optimizer.pt").unlink()
    refused(directory, IncompleteCheckpointError, "optimizer.pt")


def test_truncated_part_is_refused_with_both_sizes(tmp_path):
    directory = write(tmp_path / "c")
    path = directory / "transformer.safetensors"
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[: size // 2])
    err = refused(directory, DamagedCheckpointError, "transformer.safetensors")
    assert f"{size // 2} bytes but {size} were written" in str(err)


def test_flipped_byte_is_refused_by_its_hash(tmp_path):
    directory = write(tmp_path / "c")
    path = directory / "transformer.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # same size, one weight byte changed: safetensors would load it silently
    path.write_bytes(bytes(data))
    assert "sha256" in str(refused(directory, DamagedCheckpointError, "transformer.safetensors"))


def test_unknown_format_version_is_refused(tmp_path):
    directory = write(tmp_path / "c")
    manifest = json.loads((directory / MANIFEST).read_text())
    (directory / MANIFEST).write_text(json.dumps({**manifest, "format_version": 99}))
    assert "format_version 99" in str(refused(directory, CheckpointError, MANIFEST))


def test_format_1_checkpoint_loads_with_a_warning_and_presence_check_only(tmp_path):
    directory = write(tmp_path / "c")
    (directory / MANIFEST).write_text(json.dumps({"format_version": 1, "parts": [], "step": 3}))
    model, optimizer, scheduler = fresh()
    with pytest.warns(UserWarning, match="format 1"):
        assert load_checkpoint(directory, transformer=model, optimizer=optimizer, lr_scheduler=scheduler).step == 3
    (directory / "lr_scheduler.pt").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        refused(directory, IncompleteCheckpointError, "lr_scheduler.pt")


def test_a_checkpoint_of_another_model_is_refused_naming_the_folder(tmp_path):
    directory = write(tmp_path / "c")
    other = torch.nn.Linear(4, 2)
    optimizer = build_optimizer(other.parameters(), OLD_OPTIM)
    with pytest.raises(CheckpointError, match=r"does not fit this model.*model\.\*") as err:
        load_checkpoint(directory, transformer=other, optimizer=optimizer,
                        lr_scheduler=build_lr_scheduler(optimizer, OLD_OPTIM))
    assert str(directory) in str(err.value)


def test_checkpoint_errors_survive_pickling_from_a_worker(tmp_path):
    err = DamagedCheckpointError("checkpoint x: y is damaged", tmp_path, "transformer.safetensors")
    back = pickle.loads(pickle.dumps(err))
    assert (type(back), str(back), back.directory, back.part) == (type(err), str(err), str(tmp_path), err.part)


def test_read_train_state_names_an_unreadable_part(tmp_path):
    directory = write(tmp_path / "c")
    (directory / "train_state.json").write_text("{not json")
    with pytest.raises(DamagedCheckpointError, match="train_state.json cannot be read"):
        read_train_state(directory)
    with pytest.raises(DamagedCheckpointError, match="train_state.json"):
        verify_checkpoint(directory)


@pytest.mark.parametrize("key,new", [
    ("lr", 1e-5), ("betas", (0.5, 0.9)), ("weight_decay", 0.2), ("eps", 1e-6), ("warmup_steps", 20),
])
def test_every_optim_key_changed_on_resume_takes_effect_over_the_restored_state(tmp_path, key, new):
    """optim.* are changeable on resume: after loading the checkpoint (step 3, lr 1e-3, warmup 4), the resumed
    job's value is what the optimizer uses; the restored scheduler would otherwise keep lr 1e-3 * 3/4."""
    directory = write(tmp_path / "c", steps=3)
    new_optim = OptimConfig(**{**OLD_OPTIM.__dict__, key: new})
    model, optimizer, scheduler = fresh()
    load_checkpoint(directory, transformer=model, optimizer=optimizer, lr_scheduler=scheduler)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * 3 / 4)  # the checkpoint's schedule
    scheduler = apply_optim_config(optimizer, new_optim, step=3)
    group = optimizer.param_groups[0]
    expected_lr = new_optim.lr * min(1.0, 3 / new_optim.warmup_steps)
    assert group["lr"] == pytest.approx(expected_lr)
    assert scheduler.get_last_lr()[0] == pytest.approx(expected_lr)
    assert scheduler.last_epoch == 3
    assert tuple(group["betas"]) == tuple(new_optim.betas)
    assert group["weight_decay"] == new_optim.weight_decay and group["eps"] == new_optim.eps
    # The next optimizer step uses it: one more scheduler step follows the new schedule.
    model(torch.randn(3, 4)).square().mean().backward()
    optimizer.step()
    scheduler.step()
    assert scheduler.get_last_lr()[0] == pytest.approx(new_optim.lr * min(1.0, 4 / new_optim.warmup_steps))
    assert len(optimizer.state) == len(list(model.parameters()))  # Adam moments were kept


def test_unchanged_optim_on_resume_continues_the_schedule_exactly(tmp_path):
    directory = write(tmp_path / "c", steps=3)
    model, optimizer, scheduler = fresh()
    load_checkpoint(directory, transformer=model, optimizer=optimizer, lr_scheduler=scheduler)
    restored = scheduler.get_last_lr()
    assert apply_optim_config(optimizer, OLD_OPTIM, step=3).get_last_lr() == pytest.approx(restored)


def test_a_diffusers_export_given_as_checkpoint_is_named_and_the_run_checkpoints_listed(tmp_path):
    run = tmp_path / "run"
    write(run / "checkpoint_000004")
    write(run / "checkpoint_000008")
    (run / "checkpoint_000009").mkdir()  # unfinished: not offered
    export = run / "diffusers"
    export.mkdir()
    (export / "model_index.json").write_text("{}")
    message = str(refused(export, IncompleteCheckpointError, MANIFEST))
    assert "is a diffusers export (model_index.json, no manifest.json), not a checkpoint" in message
    assert "checkpoint_000004, checkpoint_000008)" in message and "checkpoint_000009" not in message
    assert "not finished" not in message


def test_train_state_without_dataset_hash_reads_back_and_compares_the_index_hash(tmp_path):
    from vidray.train.checkpoint import dataset_mismatch, read_train_state

    directory = write(tmp_path / "c")  # written as before dataset hashes: index_hash only
    state = read_train_state(directory)
    assert (state.dataset_hash, state.num_samples) == ("", None)
    assert dataset_mismatch(state, tmp_path, {"content_hash": "sha256:abc", "num_samples": 6}) is None
    assert "predates dataset hashes" in dataset_mismatch(state, tmp_path, {"content_hash": "sha256:new"})


def test_a_parameter_that_never_stepped_resumes_without_optimizer_state_and_the_next_steps_are_exact(tmp_path):
    """An expert no sample has reached yet (`model.experts`) has no AdamW state in the checkpoint; resumed, it must
    not get torch's fresh step-1 state (a non-strict load makes one), or its first update is biased."""
    import copy

    class Pair(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer, self.transformer_2 = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)

    def step(model, optimizer, which):
        optimizer.zero_grad(set_to_none=True)
        getattr(model, which)(torch.ones(2, 3)).pow(2).sum().backward()
        optimizer.step()

    torch.manual_seed(0)
    straight = Pair()
    initial = copy.deepcopy(straight)
    optimizer = torch.optim.AdamW(straight.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    step(straight, optimizer, "transformer_2")  # step 1: only the low expert has samples
    folder = save_checkpoint(tmp_path / "checkpoint_000001", model=straight, optimizer=optimizer,
                             lr_scheduler=scheduler, train_state=TrainState(1, 0, 1, 1, ""), job_config={})
    step(straight, optimizer, "transformer")  # step 2: the high expert's first update
    resumed = copy.deepcopy(initial)
    resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    load_checkpoint(folder, transformer=resumed, optimizer=resumed_optimizer,
                    lr_scheduler=torch.optim.lr_scheduler.LambdaLR(resumed_optimizer, lambda _: 1.0))
    assert all(p not in resumed_optimizer.state for p in resumed.transformer.parameters())
    step(resumed, resumed_optimizer, "transformer")
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
