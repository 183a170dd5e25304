"""Adapter-only LoRA export (issue 45): a LoRA run on a pretrained base exports its adapters (`lora/`) and a
reference to the base (`base_model.json`: location + fingerprint), never a copy of it; `load_model` / `vidray
generate` / serving find and check the base and merge the adapters; stock diffusers loads it as
`WanPipeline.from_pretrained(base)` + `load_lora_weights(export/lora)` and renders vidray's frames; a base that is
gone, changed, a hub id or an unreadable S3 URI is one line naming base_model.json; `vidray export --merge-lora`
writes the merged folder tensor by tensor, equal to the in-memory merge."""

from __future__ import annotations

import json
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from vidray.config import FlowConfig, job_config_from_dict  # noqa: E402
from vidray.buckets import Bucket  # noqa: E402
from vidray.inference.sampler import generate_video  # noqa: E402
from vidray.generate import GenerateArgumentError, check_generate_args  # noqa: E402
from vidray.models import get_family  # noqa: E402
from vidray.models.base import Components  # noqa: E402
from vidray.models.export import (  # noqa: E402
    BASE_REF,
    JOB_FILE,
    LORA_DIR,
    BaseModelError,
    base_fingerprint,
    export_checkpoint,
    export_pipeline,
    inspect_model,
    load_model,
    lora_export_base,
    write_job_file,
)
from vidray.models.lora import apply_lora, has_lora  # noqa: E402
from vidray.models.merge import MergeError, export_merged  # noqa: E402

FAMILY = get_family("wan")
FLOW = FlowConfig(shift=3.0)
BUCKET = Bucket(9, 32, 32)
MAX_SEQUENCE_LENGTH = 16
PROMPTS = ["a red ball bouncing"]


def _job(base) -> dict:
    return {"name": "lora-on-base", "model": {"family": "wan", "text_encoder": "tiny_random", "init": "pretrained",
                                              "pretrained_path": str(base), "max_sequence_length": MAX_SEQUENCE_LENGTH,
                                              "lora": {"rank": 4, "alpha": 8.0}},
            "data": {"buckets": [list(BUCKET)]}, "flow": {"shift": FLOW.shift}}


def _adapted(job):
    """The run's transformer: the base from its folder, adapters with a visible effect (B starts at zero)."""
    transformer = apply_lora(FAMILY.load_diffusion_models(job.model, seed=0).transformer, job.model.lora, seed=0)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(1)
        for name, param in transformer.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return transformer.eval()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(base folder, the LoRA run's job, its transformer, its adapter-only export)."""
    root = tmp_path_factory.mktemp("lora-export")
    base_model = job_config_from_dict({"name": "b", "model": {"family": "wan", "text_encoder": "tiny_random"}}).model
    base = FAMILY.save_pipeline(FAMILY.build(base_model, seed=0), root / "base", FLOW)
    job = job_config_from_dict(_job(base))
    transformer = _adapted(job)
    out = export_pipeline(FAMILY, Components(transformer=transformer, vae=None, text_encoder=None, tokenizer=None),
                          root / "diffusers", FLOW, base=lora_export_base(job))
    write_job_file(out, job)
    return base, job, transformer, out


def _moved(run, tmp_path, base: str):
    """A copy of the export whose base_model.json names `base`."""
    _, _, _, out = run
    copy = shutil.copytree(out, tmp_path / "export")
    record = json.loads((copy / BASE_REF).read_text())
    (copy / BASE_REF).write_text(json.dumps({**record, "base": base}))
    return copy


def test_a_lora_run_on_a_pretrained_base_exports_its_adapters_and_a_reference_never_the_base(run):
    base, job, _, out = run
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert files == [BASE_REF, "lora/adapter_config.json", "lora/adapter_model.safetensors",
                     "lora/pytorch_lora_weights.safetensors", JOB_FILE]
    record = json.loads((out / BASE_REF).read_text())
    assert record["format"] == 1 and record["base"] == str(base.resolve())
    assert record["sha256"] == base_fingerprint(base)["sha256"]
    assert "header_sha256" in record["files"]["transformer/diffusion_pytorch_model.safetensors"]
    assert "sha256" in record["files"]["model_index.json"] and "sha256" in record["files"]["transformer/config.json"]
    export_bytes = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    base_bytes = sum(p.stat().st_size for p in (base / "transformer").rglob("*.safetensors"))
    assert export_bytes < base_bytes / 2  # adapters (both formats, rank 4 of a 2-block model): no base weight
    info = inspect_model(out)
    assert info.path == base and info.adapters == out and info.job.model.lora is not None
    # A run cannot start from adapters alone: one line naming the base and the merge command.
    from vidray.errors import UserError
    from vidray.train.trainer import warn_if_lora_export

    with pytest.raises(UserError, match=rf"is an adapter-only LoRA export \(its base is {base.resolve()}\): start "
                                        r"from that base.*vidray export --merge-lora"):
        warn_if_lora_export(job_config_from_dict(_job(out)))
    # init: random has no base folder: the export is where its base is written (today's layout), said in
    # lora_export_base; so is a run with its own VAE (model.vae_path).
    assert lora_export_base(job_config_from_dict({**_job(base), "model": {**_job(base)["model"], "init": "random",
                                                                          "pretrained_path": None}})) is None


def test_stock_diffusers_base_plus_load_lora_weights_renders_vidray_generates_frames(run):
    from diffusers import WanPipeline

    base, _, _, out = run
    model = load_model(out)  # what vidray generate and serving load: base + adapters merged
    assert not has_lora(model.components.transformer)
    ours = generate_video(model.family, model.components, PROMPTS, BUCKET, flow=model.flow, num_inference_steps=2,
                          max_sequence_length=MAX_SEQUENCE_LENGTH, seed=3)
    pipe = WanPipeline.from_pretrained(base, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    kwargs = dict(prompt=PROMPTS, num_frames=BUCKET.num_frames, height=BUCKET.height, width=BUCKET.width,
                  num_inference_steps=2, guidance_scale=1.0, max_sequence_length=MAX_SEQUENCE_LENGTH, output_type="np")
    plain = pipe(generator=torch.Generator().manual_seed(3), **kwargs).frames
    pipe.load_lora_weights(out / LORA_DIR)
    stock = pipe(generator=torch.Generator().manual_seed(3), **kwargs).frames
    assert np.abs(ours.astype(int) - (stock * 255).round().astype(int)).max() <= 1
    assert np.abs(ours.astype(int) - (plain * 255).round().astype(int)).max() > 8  # the adapters change the video
    check_generate_args(out, "a cat", out.parent / "x.mp4")  # vidray generate takes the export as --model


def test_a_moved_base_loads_and_a_changed_gone_hub_or_unreadable_s3_base_is_one_line(run, tmp_path, monkeypatch):
    base, _, transformer, _ = run
    moved_base = shutil.copytree(base, tmp_path / "moved-base")
    export = _moved(run, tmp_path, str(moved_base))
    merged = load_model(export, components=("transformer",)).components.transformer  # the base moved: fine
    reference = load_model(run[3], components=("transformer",)).components.transformer
    for key, value in reference.state_dict().items():
        assert torch.equal(merged.state_dict()[key], value), key
    config = json.loads((moved_base / "transformer/config.json").read_text())
    (moved_base / "transformer/config.json").write_text(json.dumps({**config, "num_layers": 3}))
    ref = str(export / BASE_REF)
    with pytest.raises(BaseModelError, match=rf"^{ref}: base {moved_base} no longer matches .*\(transformer/config.json "
                                             r"differs\); restore that base"):
        load_model(export)
    with pytest.raises(GenerateArgumentError, match=r"^--model: .* no longer matches the one these adapters"):
        check_generate_args(export, "a cat", tmp_path / "x.mp4")
    cases = {str(tmp_path / "gone"): r"the base folder .*gone is gone; set \"base\" in that file",
             "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": r"is a hub id, and nothing loads from a hub here: download it",
             "s3://vidray-test/base": r"base model s3://vidray-test/base cannot be read .*credentials"}
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")  # nothing listens there
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setattr("vidray.storage.S3_MAX_ATTEMPTS", 1)
    for i, (where, message) in enumerate(cases.items()):
        export = _moved(run, tmp_path / str(i), where)
        with pytest.raises(BaseModelError, match=rf"^{export / BASE_REF}: .*{message}") as err:
            inspect_model(export)
        assert "\n" not in str(err.value)


def test_the_serve_app_takes_the_export_as_model_path_and_refuses_a_changed_base_at_build(run, tmp_path, monkeypatch):
    from vidray.serve.app import ServeSettingsError, build_app

    monkeypatch.setenv("VIDRAY_API_TOKEN", "a-token-of-at-least-16-chars")
    base, _, _, out = run
    build_app({"model_path": str(out), "store_dir": str(tmp_path / "store")})
    moved_base = shutil.copytree(base, tmp_path / "moved-base")
    export = _moved(run, tmp_path, str(moved_base))
    (moved_base / "model_index.json").write_text((moved_base / "model_index.json").read_text() + " ")
    with pytest.raises(ServeSettingsError, match=r"^model_path: .*base_model.json: .*\(model_index.json differs\)"):
        build_app({"model_path": str(export), "store_dir": str(tmp_path / "store")})


def test_the_merged_export_streamed_tensor_by_tensor_equals_the_in_memory_merge(run, tmp_path):
    from diffusers import WanTransformer3DModel

    _, _, transformer, out = run
    merged_dir = export_merged(out, tmp_path / "merged", max_shard_bytes=40_000)  # several shards
    shards = sorted((merged_dir / "transformer").glob("*.safetensors"))
    index = json.loads((merged_dir / "transformer/diffusion_pytorch_model.safetensors.index.json").read_text())
    assert len(shards) > 2 and set(index["weight_map"].values()) == {p.name for p in shards}
    assert all(p.stat().st_size <= 40_000 + 4096 for p in shards[:-1])  # a shard: its tensors and its header
    assert not (merged_dir / LORA_DIR).exists() and (merged_dir / JOB_FILE).is_file()
    streamed = WanTransformer3DModel.from_pretrained(merged_dir / "transformer").state_dict()
    in_memory = load_model(out, components=("transformer",)).components.transformer.state_dict()  # peft's merge
    assert streamed.keys() == in_memory.keys()
    for key, value in in_memory.items():
        torch.testing.assert_close(streamed[key], value, atol=1e-6, rtol=1e-5, msg=key)
    base_state = WanTransformer3DModel.from_pretrained(run[0] / "transformer").state_dict()
    assert not torch.equal(streamed["blocks.0.attn1.to_q.weight"], base_state["blocks.0.attn1.to_q.weight"])
    assert torch.equal(streamed["blocks.0.ffn.net.0.proj.weight"], base_state["blocks.0.ffn.net.0.proj.weight"])
    loaded = load_model(merged_dir)  # a plain pipeline folder: nothing left to merge, the same model
    for key, value in in_memory.items():
        torch.testing.assert_close(loaded.components.transformer.state_dict()[key], value, atol=1e-6, rtol=1e-5)
    with pytest.raises(MergeError, match="exists; give a new folder"):
        export_merged(out, merged_dir)
    with pytest.raises(MergeError, match="holds no LoRA adapters"):
        export_merged(merged_dir, tmp_path / "again")


def test_a_lora_checkpoint_exports_adapter_only_and_merges_from_its_pretrained_base(run, tmp_path):
    from vidray.models.lora import adapter_state_dict
    from vidray.train.checkpoint import TrainState, save_checkpoint
    from vidray.train.optim import build_lr_scheduler, build_optimizer

    base, job, transformer, out = run
    optimizer = build_optimizer([p for p in transformer.parameters() if p.requires_grad], job.optim)
    checkpoint = save_checkpoint(tmp_path / "checkpoint_000001", model=transformer, optimizer=optimizer,
                                 lr_scheduler=build_lr_scheduler(optimizer, job.optim), train_state=TrainState(1, 0, 1, 1, "sha256:abc"),
                                 job_config=job.to_dict())
    exported = export_checkpoint(checkpoint, tmp_path / "export")
    assert (exported / BASE_REF).is_file() and not (exported / "transformer").exists()
    assert json.loads((exported / BASE_REF).read_text())["base"] == str(base.resolve())
    from vidray.cli import main

    from_checkpoint = export_merged(checkpoint, tmp_path / "merged-ckpt")
    assert main(["export", "--merge-lora", str(out), str(tmp_path / "merged-export")]) == 0
    from_export = tmp_path / "merged-export"
    from safetensors.torch import load_file

    a = load_file(str(from_checkpoint / "transformer/diffusion_pytorch_model.safetensors"))
    b = load_file(str(from_export / "transformer/diffusion_pytorch_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert adapter_state_dict(transformer)  # the run's transformer keeps its adapters


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp"])
def test_the_end_of_a_lora_run_on_a_pretrained_base_gathers_and_writes_only_the_adapters(shards_dir, tmp_path,
                                                                                         strategy):
    """Through the real loop (2 gloo ranks, FSDP-sharded base): the export is `lora/` + base_model.json + the job
    file, and loads as the base with the checkpoint's adapters merged (what `vidray export` of it gives)."""
    from pathlib import Path

    from vidray.config import ModelConfig, load_job_config
    from vidray.models.export import load_adapter_state
    from vidray.train.local import train_in_process

    repo = Path(__file__).resolve().parents[2]
    family = get_family("easyanimate")
    base = family.save_pipeline(family.build(ModelConfig(text_encoder="tiny_random"), seed=0), tmp_path / "base",
                                FLOW)
    job = load_job_config(repo / "jobs/configs/tiny_t2v.yaml", [
        f"data.shards_dir={shards_dir}", f"storage.path={tmp_path / 'runs'}", "name=lora-base", "model.init=pretrained",
        f"model.pretrained_path={base}", "model.lora.rank=4", f"scaling.strategy={strategy}", "train.max_steps=2",
        "checkpoint.every_steps=2", "train.log_every_steps=1"])
    result = train_in_process(job, world_size=2)
    out = Path(result.diffusers_dir)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        BASE_REF, "lora/adapter_config.json", "lora/adapter_model.safetensors", "lora/pytorch_lora_weights.safetensors",
        JOB_FILE]
    assert json.loads((out / BASE_REF).read_text())["base"] == str(base.resolve())
    from safetensors.torch import load_file

    exported = load_file(str(out / LORA_DIR / "adapter_model.safetensors"))
    saved = load_adapter_state(result.run_dir / "checkpoint_000002")
    assert {f"base_model.model.{k}" for k in saved} <= set(exported)
    assert all(torch.equal(exported[f"base_model.model.{k}"], v) for k, v in saved.items())
    assert any(v.abs().max() > 0 for k, v in saved.items() if ".lora_B." in k)  # trained
    merged = load_model(out, components=("transformer",)).components.transformer.state_dict()
    from_checkpoint = load_model(result.run_dir / "checkpoint_000002", components=("transformer",),
                                 allow_sharded=True).components.transformer.state_dict()
    for key, value in from_checkpoint.items():
        torch.testing.assert_close(merged[key], value, atol=1e-6, rtol=1e-5, msg=key)


def test_a_two_expert_adapter_export_from_the_adapters_alone_loads_in_stock_diffusers_vidray_and_merges(tmp_path):
    """Wan 2.2 A14B's layout: `export_adapters` (what the end of a run writes from the gathered adapters alone)
    gives `lora/` + `lora_2/` + base_model.json; the stock pipeline from the base with both folders loaded, vidray's
    load_model and the streamed merged export all compute what the adapted experts do."""
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel

    from vidray.models.export import export_adapters
    from vidray.models.lora import adapter_state_dict

    raw = {"family": "wan", "text_encoder": "tiny_random", "max_sequence_length": 8, "i2v": {},
           "experts": {"boundary_ratio": 0.9}}
    base_model = job_config_from_dict({"name": "b", "model": raw, "data": {"buckets": [[5, 32, 32]]}}).model
    base = FAMILY.save_pipeline(FAMILY.build(base_model, seed=0), tmp_path / "base", FLOW)
    job = job_config_from_dict({"name": "experts-lora", "model": {**raw, "init": "pretrained",
                                                                  "pretrained_path": str(base), "lora": {"rank": 4}},
                                "data": {"buckets": [[5, 32, 32]]}, "flow": {"shift": FLOW.shift}})
    two = _adapted(job)
    out = export_adapters(adapter_state_dict(two), job.model.lora, WanTransformer3DModel, tmp_path / "diffusers",
                          lora_export_base(job), experts=True)
    write_job_file(out, job)
    assert sorted(p.name for p in out.iterdir()) == [BASE_REF, "lora", "lora_2", JOB_FILE]
    pipe = WanImageToVideoPipeline.from_pretrained(base, local_files_only=True)
    pipe.load_lora_weights(out / "lora")
    pipe.load_lora_weights(out / "lora_2", load_into_transformer_2=True)
    loaded = load_model(out, components=("transformer",)).components.transformer
    merged = export_merged(out, tmp_path / "merged")
    streamed = {attribute: WanTransformer3DModel.from_pretrained(merged / attribute).eval()
                for attribute in ("transformer", "transformer_2")}
    generator = torch.Generator().manual_seed(2)
    inputs = {"hidden_states": torch.randn(1, two.config.in_channels, 3, 8, 8, generator=generator),
              "encoder_hidden_states": torch.randn(1, 8, two.config.text_dim, generator=generator),
              "return_dict": False}
    with torch.no_grad():
        for attribute, stock, timestep in (("transformer", pipe.transformer, 950.0),
                                           ("transformer_2", pipe.transformer_2, 300.0)):
            t = torch.tensor([timestep])
            trained = two(timestep=t, **inputs)[0]
            for name, result in (("stock", stock(timestep=t, **inputs)[0]),
                                 ("load_model", loaded(timestep=t, **inputs)[0]),
                                 ("merged", streamed[attribute](timestep=t, **inputs)[0])):
                torch.testing.assert_close(result, trained, atol=1e-5, rtol=1e-4, msg=f"{attribute} {name}")
