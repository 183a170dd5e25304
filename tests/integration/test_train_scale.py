"""Issue 28 through the real loop (2 Ray Train workers, gloo): bf16 autocast, activation checkpointing, PowerSGD
compression, gradient accumulation and an EMA together, checkpointed, resumed exactly, and the EMA exported."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vidray.config import load_job_config
from vidray.train.trainer import run_training

from tests.integration.conftest import assert_same_training_state

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration

SCALE = ["train.mixed_precision=bf16", "train.activation_checkpointing=every_2", "train.grad_compression=powersgd",
         "train.powersgd_rank=2", "train.grad_accumulation_steps=2", "train.ema.decay=0.9",
         "train.ema.update_every_steps=2", "export.weights=ema"]


def scale_job(shards_dir, storage, name, max_steps, *extra):
    return load_job_config(REPO / "jobs/configs/tiny_t2v.yaml", [
        f"data.shards_dir={shards_dir}", f"storage.path={storage}", f"name={name}", "model.text_encoder=tiny_random",
        "train.log_every_steps=2", "checkpoint.every_steps=3", "checkpoint.num_to_keep=null",
        f"train.max_steps={max_steps}", *SCALE, *extra])


def test_bf16_ac_powersgd_accumulation_and_ema_resume_exactly_and_export_the_ema(local_ray, shards_dir, tmp_path):
    # One run straight through, and one resumed from its step-3 checkpoint (in mid-compression, mid-EMA): steps 4-6
    # must repeat the straight run's exactly.
    whole = run_training(scale_job(shards_dir, tmp_path, "whole", 6))
    second = run_training(scale_job(shards_dir, tmp_path, "split", 6,
                                    f"checkpoint.resume_from={whole.run_dir / 'checkpoint_000003'}"))
    assert second.first_step == 4
    expected = dict((int(s), v) for s, v in whole.losses)
    assert [int(s) for s, _ in second.losses] == [4, 5, 6]
    for step, loss in second.losses:
        assert loss == expected[int(step)], step
    assert_same_training_state(second.checkpoint_path, whole.run_dir / "checkpoint_000006")
    resumed, reference = Path(second.checkpoint_path), whole.run_dir / "checkpoint_000006"
    for part in ("ema.safetensors",):
        a, b = load_file(resumed / part), load_file(reference / part)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part
    hooks = [torch.load(d / "comm_hook.pt", weights_only=True) for d in (resumed, reference)]
    assert hooks[0]["kind"] == "powersgd" and len(hooks[0]["per_rank"]) == 2
    assert hooks[0]["per_rank"][1]["iter"] == hooks[1]["per_rank"][1]["iter"] > 2  # compressing since step 2
    for rank in range(2):
        for key, value in hooks[1]["per_rank"][rank]["error_dict"].items():
            assert torch.equal(hooks[0]["per_rank"][rank]["error_dict"][key], value)

    # The export holds the EMA (export.weights: ema), not the trained weights: 3 updates at decay 0.9 differ.
    ema = {k.removeprefix("module.params.").replace("__", "."): v
           for k, v in load_file(reference / "ema.safetensors").items() if k != "n_averaged"}
    trained = load_file(reference / "transformer.safetensors")
    exported = {}
    for path in (Path(whole.diffusers_dir) / "transformer").glob("*.safetensors"):
        exported.update(load_file(path))
    assert ema.keys() < exported.keys()  # the trainable parameters (the frozen ones are their own average)
    assert all(torch.equal(exported[k], ema[k]) for k in ema)
    assert any(not torch.equal(trained[k], ema[k]) for k in ema)


def test_lora_run_trains_only_adapters_checkpoints_them_resumes_exactly_and_exports_base_plus_lora(
        local_ray, shards_dir, tmp_path):
    lora = ["model.lora.rank=4", "train.activation_checkpointing=full"]

    def job(name, max_steps, *extra):
        return load_job_config(REPO / "jobs/configs/tiny_t2v.yaml", [
            f"data.shards_dir={shards_dir}", f"storage.path={tmp_path}", f"name={name}",
            "model.text_encoder=tiny_random", "train.log_every_steps=2", "checkpoint.every_steps=2",
            "checkpoint.num_to_keep=null", f"train.max_steps={max_steps}", *lora, *extra])

    whole = run_training(job("whole", 4))
    resumed = run_training(job("resumed", 4, f"checkpoint.resume_from={whole.run_dir / 'checkpoint_000002'}"))
    assert resumed.first_step == 3
    expected = dict((int(s), v) for s, v in whole.losses)
    assert [(int(s), v) for s, v in resumed.losses] == [(s, expected[s]) for s in (3, 4)]
    reference = whole.run_dir / "checkpoint_000004"
    parts = {p.name for p in reference.iterdir()}
    assert "adapter.safetensors" in parts and "transformer.safetensors" not in parts
    adapters, again = load_file(reference / "adapter.safetensors"), load_file(Path(resumed.checkpoint_path) / "adapter.safetensors")
    assert adapters and all(".lora_A." in k or ".lora_B." in k for k in adapters)
    assert adapters.keys() == again.keys() and all(torch.equal(adapters[k], again[k]) for k in adapters)
    # The export: the stock base pipeline plus lora/ (diffusers' and peft's files).
    export = Path(whole.diffusers_dir)
    assert (export / "model_index.json").is_file()
    assert {"pytorch_lora_weights.safetensors", "adapter_config.json", "adapter_model.safetensors"} <= {
        p.name for p in (export / "lora").iterdir()}
