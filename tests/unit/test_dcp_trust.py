"""Issue 44 part 3: loading a sharded (DCP) checkpoint never unpickles data from storage. A `.metadata` (or a
non-tensor entry) whose pickle would run code is refused as damaged, on one line, even with a manifest whose
sha256s were rewritten to match, and its payload never runs (a marker file it would create stays absent); a
checkpoint vidray wrote still loads; serving and `vidray generate` refuse `layout: dcp` and say how to export."""

from __future__ import annotations

import hashlib
import io
import json
import pickle
from pathlib import Path

import pytest
import torch

from vidray.models.dcp_reader import read_dcp_metadata
from vidray.models.export import DamagedCheckpointError, sharded_entries
from vidray.train.checkpoint import TrainState, load_checkpoint, save_sharded_checkpoint


class _Payload:
    """Unpickling it creates `marker` (what any code from storage could do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))


def _parts(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    """A real one-process sharded checkpoint (`layout: dcp`) after one AdamW step: tensors and byte entries."""
    model = _model()
    optimizer, scheduler = _parts(model)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    folder = tmp_path / "checkpoint_000001"
    save_sharded_checkpoint(folder, model=model, optimizer=optimizer, lr_scheduler=scheduler,
                            train_state=TrainState(1, 0, 2, 1, ""), job_config={"name": "t"}, rank=0, world_size=1)
    assert json.loads((folder / "manifest.json").read_text())["layout"] == "dcp"
    return folder


def _rewrite_manifest(folder: Path) -> None:
    """What an attacker with write access does: make the manifest's sizes and sha256s match the new bytes."""
    manifest = json.loads((folder / "manifest.json").read_text())
    for part, record in manifest["files"].items():
        data = (folder / part).read_bytes()
        record.update(size_bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _load(folder: Path) -> TrainState:
    model = _model()
    optimizer, scheduler = _parts(model)
    return load_checkpoint(folder, transformer=model, optimizer=optimizer, lr_scheduler=scheduler)


def test_a_real_sharded_checkpoint_still_loads_through_the_safe_reader(checkpoint):
    state = _load(checkpoint)
    assert state.step == 1
    assert set(sharded_entries(checkpoint, "model")) == {"0.weight", "0.bias", "1.weight", "1.bias"}


def test_a_hostile_metadata_with_a_matching_manifest_is_refused_and_never_runs(checkpoint, tmp_path):
    marker = tmp_path / "pwned"
    metadata = read_dcp_metadata(checkpoint / "dcp" / ".metadata")
    metadata.planner_data = _Payload(marker)  # a real metadata file, one field carrying the payload
    (checkpoint / "dcp" / ".metadata").write_bytes(pickle.dumps(metadata))
    _rewrite_manifest(checkpoint)
    for load in (_load, lambda folder: sharded_entries(folder, "model")):  # resume, and export / validation
        with pytest.raises(DamagedCheckpointError) as refused:
            load(checkpoint)
        message = str(refused.value)
        assert "\n" not in message and "dcp/.metadata is not a checkpoint vidray wrote" in message
        assert "refers to io.open" in message and "use an earlier checkpoint" in message
        assert not marker.exists()


def test_a_hostile_byte_entry_is_refused_by_weights_only_and_never_runs(checkpoint, tmp_path):
    """The optimizer's `lr` entry repointed at a pickle that would run code (the metadata itself clean)."""
    marker = tmp_path / "pwned"
    shard = checkpoint / "dcp" / "__0_0.distcp"
    blob = io.BytesIO()
    torch.save({"lr": _Payload(marker)}, blob)
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(blob.getvalue())
    metadata = read_dcp_metadata(checkpoint / "dcp" / ".metadata")
    index = next(i for i in metadata.storage_data if i.fqn.endswith("param_groups.0.lr"))
    metadata.storage_data[index].offset, metadata.storage_data[index].length = offset, len(blob.getvalue())
    (checkpoint / "dcp" / ".metadata").write_bytes(pickle.dumps(metadata))
    _rewrite_manifest(checkpoint)
    with pytest.raises(DamagedCheckpointError) as refused:
        _load(checkpoint)
    message = str(refused.value)
    assert "\n" not in message and "param_groups.0.lr" in message and "__0_0.distcp" in message
    assert "refers to io.open" in message
    assert not marker.exists()


def test_a_storage_entry_outside_the_dcp_folder_is_refused(checkpoint):
    metadata = read_dcp_metadata(checkpoint / "dcp" / ".metadata")
    next(iter(metadata.storage_data.values())).relative_path = "../train_state.json"
    (checkpoint / "dcp" / ".metadata").write_bytes(pickle.dumps(metadata))
    _rewrite_manifest(checkpoint)
    with pytest.raises(DamagedCheckpointError, match=r"points at '\.\./train_state\.json'"):
        _load(checkpoint)


def test_generate_and_serving_refuse_a_sharded_checkpoint_and_its_export_serves(tmp_path):
    """A real tiny EasyAnimate sharded checkpoint: `vidray generate`'s checks, `build_app` and `load_model` refuse
    it in one line naming `vidray export`; `vidray export` writes the safetensors pipeline, which loads with the
    checkpoint's weights."""
    from vidray.cli import main
    from vidray.config import ModelConfig, job_config_from_dict
    from vidray.generate import GenerateArgumentError, check_generate_args
    from vidray.models import get_family
    from vidray.models.export import CheckpointError, load_model
    from vidray.serve.app import ServeSettingsError, build_app

    job = {"name": "dcp", "model": {"text_encoder": "tiny_random", "max_sequence_length": 16},
           "data": {"buckets": [[5, 32, 32]]}, "scaling": {"strategy": "fsdp"}}
    transformer = get_family("easyanimate").load_diffusion_models(ModelConfig(**job["model"]), seed=0).transformer
    with torch.no_grad():
        for param in transformer.parameters():
            param.add_(0.1)
    optimizer, scheduler = _parts(transformer)
    folder = tmp_path / "run" / "checkpoint_000002"
    save_sharded_checkpoint(folder, model=transformer, optimizer=optimizer, lr_scheduler=scheduler,
                            train_state=TrainState(2, 0, 2, 1, "x"), job_config=job_config_from_dict(job).to_dict(),
                            rank=0, world_size=1)
    refusals = []
    with pytest.raises(GenerateArgumentError) as refused:
        check_generate_args(folder, "a kite", tmp_path / "out.mp4")
    refusals.append(str(refused.value))
    with pytest.raises(ServeSettingsError) as refused:
        build_app({"model_path": str(folder), "store_dir": str(tmp_path / "store"), "auth": {"disabled": True}})
    refusals.append(str(refused.value))
    with pytest.raises(CheckpointError) as refused:
        load_model(folder)
    refusals.append(str(refused.value))
    for message in refusals:
        assert "\n" not in message and "sharded (DCP)" in message, message
        assert f"vidray export {folder} OUT_DIR" in message, message
    out = tmp_path / "exported"
    assert main(["export", str(folder), str(out)]) == 0
    loaded = load_model(out)
    for name, value in transformer.state_dict().items():
        assert torch.equal(loaded.components.transformer.state_dict()[name], value), name
    check_generate_args(out, "a kite", tmp_path / "out.mp4")  # the export is what generate takes
