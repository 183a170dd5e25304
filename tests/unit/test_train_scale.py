"""Issue 28 through the real loop (the `Worker` on 2 gloo ranks spawned in process, `train_in_process`; moved from
the integration tier, issue 43: Ray Train adds nothing these behaviours depend on): bf16 autocast, activation
checkpointing, PowerSGD compression, gradient accumulation and an EMA together, checkpointed, resumed exactly, and the EMA exported; and
LoRA on an FSDP-sharded base with a sharded EMA of its adapters, the same way."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vidray.config import load_job_config
from vidray.models.export import CheckpointError, load_model, load_transformer_state
from vidray.train.local import train_in_process

from tests.conftest import assert_same_training_state

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux", reason="spawned gloo ranks: Linux")]

SCALE = ["train.mixed_precision=bf16", "train.activation_checkpointing=every_2", "train.grad_compression=powersgd",
         "train.powersgd_rank=2", "train.grad_accumulation_steps=2", "train.ema.decay=0.9",
         "train.ema.update_every_steps=2", "export.weights=ema"]


def scale_job(shards_dir, storage, name, max_steps, *extra):
    return load_job_config(REPO / "jobs/configs/tiny_t2v.yaml", [
        f"data.shards_dir={shards_dir}", f"storage.path={storage}", f"name={name}", "model.text_encoder=tiny_random",
        "train.log_every_steps=2", "checkpoint.every_steps=3", "checkpoint.num_to_keep=null",
        f"train.max_steps={max_steps}", *SCALE, *extra])


def test_bf16_ac_powersgd_accumulation_and_ema_resume_exactly_and_export_the_ema(shards_dir, tmp_path):
    # One run straight through, and one resumed from its step-3 checkpoint (in mid-compression, mid-EMA): steps 4-6
    # must repeat the straight run's exactly.
    whole = train_in_process(scale_job(shards_dir, tmp_path, "whole", 6), world_size=2)
    second = train_in_process(scale_job(shards_dir, tmp_path, "split", 6,
                                        f"checkpoint.resume_from={whole.run_dir / 'checkpoint_000003'}"), world_size=2)
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


def _dcp_state(checkpoint: Path, tmp_path: Path) -> dict:
    """A sharded checkpoint's DCP folder as one plain state dict (`dcp_to_torch_save`), every rank's shards joined."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{checkpoint.parent.name}-{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint / "dcp", out)
    return torch.load(out, weights_only=False)


def test_fsdp_lora_run_with_ema_trains_only_adapters_checkpoints_them_sharded_resumes_exactly_and_exports(
        shards_dir, tmp_path):
    # LoRA on an FSDP-sharded base with an EMA of the adapters (sharded like them). LoRA under DDP (its
    # adapter.safetensors checkpoint) is the same loop with `prepare_model`: tests/unit/test_lora.py, and the EMA
    # under DDP the test above.
    lora = ["model.lora.rank=4", "train.activation_checkpointing=full", "scaling.strategy=fsdp",
            "train.ema.decay=0.9", "export.weights=ema"]

    def job(name, max_steps, *extra):
        return load_job_config(REPO / "jobs/configs/tiny_t2v.yaml", [
            f"data.shards_dir={shards_dir}", f"storage.path={tmp_path}", f"name={name}",
            "model.text_encoder=tiny_random", "train.log_every_steps=2", "checkpoint.every_steps=2",
            "checkpoint.num_to_keep=null", f"train.max_steps={max_steps}", *lora, *extra])

    whole = train_in_process(job("whole", 4), world_size=2)
    resumed = train_in_process(job("resumed", 4, f"checkpoint.resume_from={whole.run_dir / 'checkpoint_000002'}"),
                               world_size=2)
    assert resumed.first_step == 3
    expected = dict((int(s), v) for s, v in whole.losses)
    assert [(int(s), v) for s, v in resumed.losses] == [(s, expected[s]) for s in (3, 4)]
    reference = whole.run_dir / "checkpoint_000004"
    manifest = json.loads((reference / "manifest.json").read_text())
    assert manifest["layout"] == "dcp" and manifest["lora"]["rank"] == 4 and manifest["ema"] is True
    saved, again = _dcp_state(reference, tmp_path), _dcp_state(Path(resumed.checkpoint_path), tmp_path)
    adapters = saved["model"]
    assert adapters and all(".lora_A." in k or ".lora_B." in k for k in adapters)  # no base weight
    assert_same_state(again, saved)  # adapters, their optimizer state and the EMA: bitwise
    # The export: the stock base pipeline plus lora/ (diffusers' and peft's files) holding the EMA's adapters.
    export = Path(whole.diffusers_dir)
    assert (export / "model_index.json").is_file()
    assert {"pytorch_lora_weights.safetensors", "adapter_config.json", "adapter_model.safetensors"} <= {
        p.name for p in (export / "lora").iterdir()}
    exported = load_file(export / "lora" / "adapter_model.safetensors")
    averages = {k.removeprefix("module.params.").replace("__", ".").replace(".default", ""): v
                for k, v in saved["ema"].items() if k != "n_averaged"}
    for name, value in averages.items():
        assert torch.equal(exported[f"base_model.model.{name}"], value), name
    assert any(not torch.equal(averages[k], adapters[k.replace(".weight", ".default.weight")]) for k in averages)
    # The sharded LoRA checkpoint as the validator and `vidray export` read it: the base with its adapters merged.
    served = load_model(reference, components=("transformer",), allow_sharded=True).components.transformer.state_dict()
    base = {}
    for path in (export / "transformer").glob("*.safetensors"):
        base.update(load_file(path))
    layer = "transformer_blocks.0.attn1.to_q"
    a, b = adapters[f"{layer}.lora_A.default.weight"], adapters[f"{layer}.lora_B.default.weight"]
    assert b.abs().max() > 0  # trained
    torch.testing.assert_close(served[f"{layer}.weight"], base[f"{layer}.weight"] + b @ a, rtol=1e-5, atol=1e-6)
    with pytest.raises(CheckpointError, match="holds LoRA adapters only"):
        load_transformer_state(reference)


def assert_same_state(a, b, where: str = "state") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            assert_same_state(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)
