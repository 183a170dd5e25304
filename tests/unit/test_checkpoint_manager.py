"""CheckpointManager: one owner of a run's checkpoint names, the latest complete one, the copy into the run folder
(parts first, manifest last, retried) and fetching one back, on a local folder and on S3 (moto on 127.0.0.1)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import torch

from vidray.train import checkpoint as ckpt
from vidray.train.checkpoint import (
    MANIFEST,
    CheckpointManager,
    CheckpointUploadError,
    DamagedCheckpointError,
    TrainState,
    checkpoint_dir_name,
    checkpoint_step,
    load_checkpoint,
    save_checkpoint,
)
from vidray.train.optim import build_lr_scheduler, build_optimizer
from vidray.config import OptimConfig

OPTIM = OptimConfig(lr=1e-3, warmup_steps=2)


def model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = build_optimizer(model.parameters(), OPTIM)
    return model, optimizer, build_lr_scheduler(optimizer, OPTIM)


def snapshot(tmp_path: Path, step: int, **extra) -> Path:
    model, optimizer, scheduler = model_and_optimizer(step)
    model(torch.randn(3, 4)).square().mean().backward()
    optimizer.step()
    scheduler.step()
    return save_checkpoint(tmp_path / f"snap-{step}-{uuid.uuid4().hex[:6]}", model=model, optimizer=optimizer,
                           lr_scheduler=scheduler, train_state=TrainState(step, 0, step, 1, "sha256:x"),
                           job_config={"name": "t"}, **extra)


def test_folder_names_and_steps_round_trip():
    assert checkpoint_dir_name(200) == "checkpoint_000200"
    assert checkpoint_step("checkpoint_000200") == 200
    assert checkpoint_step("checkpoint_12345678") == 12345678  # past 6 digits the name just grows
    assert checkpoint_step("checkpoint_abc") is None and checkpoint_step("diffusers") is None


def test_latest_is_the_newest_folder_with_a_manifest_and_unfinished_ones_are_passed_over(tmp_path):
    run = tmp_path / "run"
    manager = CheckpointManager(run)
    assert manager.names() == [] and manager.latest() is None
    for step in (4, 12):
        manager.upload(snapshot(tmp_path, step), checkpoint_dir_name(step))
    (run / "checkpoint_000016").mkdir()  # a copy killed before its manifest
    (run / "checkpoint_000016" / "transformer.safetensors").write_bytes(b"partial")
    (run / "diffusers").mkdir()
    assert manager.names() == ["checkpoint_000004", "checkpoint_000012", "checkpoint_000016"]  # by step
    assert manager.latest() == "checkpoint_000012"
    assert manager.unfinished() == ["checkpoint_000016"]


def test_upload_replaces_what_an_interrupted_copy_left_and_the_copy_loads_exactly(tmp_path):
    run = tmp_path / "run"
    stale = run / "checkpoint_000008"
    stale.mkdir(parents=True)
    (stale / "optimizer.pt").write_bytes(b"half written by a killed worker")
    (stale / "leftover.bin").write_bytes(b"x")
    manager = CheckpointManager(run)
    local = snapshot(tmp_path, 8)
    manager.upload(local, "checkpoint_000008")
    assert sorted(p.name for p in stale.iterdir()) == sorted(p.name for p in local.iterdir())  # leftover gone
    manager.verify("checkpoint_000008")
    model, optimizer, scheduler = model_and_optimizer(99)
    with manager.fetch("checkpoint_000008") as folder:
        state = load_checkpoint(folder, transformer=model, optimizer=optimizer, lr_scheduler=scheduler)
    assert state.step == 8
    saved = torch.load(local / "optimizer.pt", weights_only=True)
    assert torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], saved["state"]["0.weight"]["exp_avg"])


def test_an_upload_that_keeps_failing_is_retried_then_refused_and_leaves_no_manifest(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt, "UPLOAD_BACKOFF_S", 0.01)
    blocker = tmp_path / "run"
    blocker.write_text("a file where the run folder should be")  # every try fails with OSError
    with pytest.raises(CheckpointUploadError, match=r"after 3 tries .* not complete there") as err:
        CheckpointManager(blocker).upload(snapshot(tmp_path, 2), "checkpoint_000002")
    assert "checkpoint_000002" in str(err.value)
    assert blocker.is_file()


def test_ema_and_grad_scaler_are_saved_and_restored_when_present(tmp_path):
    model, optimizer, scheduler = model_and_optimizer(1)
    ema = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    folder = save_checkpoint(tmp_path / "c", model=model, optimizer=optimizer, lr_scheduler=scheduler,
                             train_state=TrainState(1, 0, 1, 1, "h"), job_config={}, ema=ema, grad_scaler=scaler)
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["parts"][-2:] == ["ema.safetensors", "grad_scaler.pt"]
    model2, optimizer2, scheduler2 = model_and_optimizer(2)
    ema2 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    scaler2 = torch.amp.GradScaler("cpu", init_scale=2.0)
    load_checkpoint(folder, transformer=model2, optimizer=optimizer2, lr_scheduler=scheduler2, ema=ema2,
                    grad_scaler=scaler2)
    assert all(torch.equal(a, b) for a, b in zip(ema.state_dict().values(), ema2.state_dict().values()))
    assert scaler2.get_scale() == 1024.0
    (folder / "ema.safetensors").unlink()
    with pytest.raises(Exception, match="missing ema.safetensors"):
        load_checkpoint(folder, transformer=model2, optimizer=optimizer2, lr_scheduler=scheduler2)


def test_format_2_checkpoints_with_index_keyed_optimizer_state_still_load(tmp_path):
    model, optimizer, scheduler = model_and_optimizer(3)
    model(torch.randn(3, 4)).square().mean().backward()
    optimizer.step()
    folder = save_checkpoint(tmp_path / "v2", model=model, optimizer=optimizer, lr_scheduler=scheduler,
                             train_state=TrainState(1, 0, 1, 1, "h"), job_config={})
    torch.save(optimizer.state_dict(), folder / "optimizer.pt")  # what format 2 stored
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["format_version"] = 2
    manifest["files"]["optimizer.pt"] = {"size_bytes": (folder / "optimizer.pt").stat().st_size,
                                         "sha256": ckpt.file_sha256(folder / "optimizer.pt")}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    model2, optimizer2, scheduler2 = model_and_optimizer(4)
    load_checkpoint(folder, transformer=model2, optimizer=optimizer2, lr_scheduler=scheduler2)
    assert torch.equal(optimizer2.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])


def test_on_s3_the_manager_lists_uploads_verifies_by_size_and_fetches(s3_env, tmp_path):
    from vidray.storage import open_storage

    run = f"s3://vidray-test/ckpt-{uuid.uuid4().hex[:8]}/run"
    manager = CheckpointManager(run)
    for step in (2, 4):
        manager.upload(snapshot(tmp_path, step), checkpoint_dir_name(step))
    storage = open_storage(run)
    storage.write_bytes("checkpoint_000006/transformer.safetensors", b"partial")  # no manifest: unfinished
    assert manager.names() == ["checkpoint_000002", "checkpoint_000004", "checkpoint_000006"]
    assert manager.latest() == "checkpoint_000004"
    assert manager.verify("checkpoint_000004", hashes=False)["step"] == 4
    manager.verify("checkpoint_000004")  # downloads and hashes
    with manager.fetch("checkpoint_000004", parts=("train_state.json",)) as folder:
        assert json.loads((folder / "train_state.json").read_text())["step"] == 4
        assert not (folder / "transformer.safetensors").exists()
    storage.write_bytes("checkpoint_000004/optimizer.pt", b"truncated")
    with pytest.raises(DamagedCheckpointError, match=rf"{run}/checkpoint_000004: optimizer.pt is 9 bytes"):
        manager.verify("checkpoint_000004", hashes=False)


@pytest.mark.parametrize("start", ["resume_from", "restart"])
def test_a_remote_checkpoint_with_same_size_different_weights_is_refused_by_the_workers_load_naming_the_part(
        s3_env, tmp_path, monkeypatch, start):
    from vidray.storage import open_storage
    from vidray.train import loop

    run = f"s3://vidray-test/ckpt-{uuid.uuid4().hex[:8]}/run"
    manager = CheckpointManager(run)
    manager.upload(snapshot(tmp_path, 4), checkpoint_dir_name(4))
    storage = open_storage(run)
    weights = storage.read_bytes("checkpoint_000004/transformer.safetensors")
    tail = bytes(b ^ 0xFF for b in weights[-16:])  # the last tensor bytes: same size, still a valid file
    storage.write_bytes("checkpoint_000004/transformer.safetensors", weights[:-16] + tail)
    assert manager.verify("checkpoint_000004", hashes=False)["step"] == 4  # the driver's size check passes
    # The worker's load (`_resume_state`) on its first attempt (no Ray Train checkpoint yet): the driver's
    # planned checkpoint.resume_from, or the run folder's latest after a restart of the worker group.
    loop_config = ({"run_dir": run, "resume_from": f"{run}/checkpoint_000004", "start_step": 4}
                   if start == "resume_from" else {"run_dir": run, "resume_from": None, "start_step": 2})
    model, optimizer, scheduler = model_and_optimizer(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(DamagedCheckpointError) as err:
        loop._resume_state(loop_config, 0, None, transformer=model, optimizer=optimizer, lr_scheduler=scheduler)
    message = str(err.value)
    assert err.value.part == "transformer.safetensors" and "\n" not in message
    assert message.startswith(f"checkpoint {run}/checkpoint_000004: transformer.safetensors does not match the sha256")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing was loaded


@pytest.mark.parametrize("start", ["run_folder", "resume_from"])
def test_the_worker_says_which_checkpoint_it_started_from_and_at_which_step(tmp_path, capfd, start):
    """The log line of the worker's load (`_resume_state`), which users and tests/integration/test_checkpoint_faults
    read: the run folder's latest after a restart of the worker group, or the driver's checkpoint.resume_from."""
    from vidray.train import loop

    run = tmp_path / "run"
    CheckpointManager(str(run)).upload(snapshot(tmp_path, 4), checkpoint_dir_name(4))
    loop_config = ({"run_dir": str(run), "resume_from": str(run / "checkpoint_000004"), "start_step": 4}
                   if start == "resume_from" else {"run_dir": str(run), "resume_from": None, "start_step": 2})
    model, optimizer, scheduler = model_and_optimizer(0)
    state = loop._resume_state(loop_config, 0, None, transformer=model, optimizer=optimizer, lr_scheduler=scheduler)
    assert state.step == 4
    said = ("restarted from this run's checkpoint checkpoint_000004 at step 4 (the run folder's latest complete)"
            if start == "run_folder" else f"started from checkpoint {run / 'checkpoint_000004'} at step 4")
    assert f"[vidray] {said}\n" in capfd.readouterr().out
