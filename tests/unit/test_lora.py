"""LoRA (`model.lora`, `vidray.models.lora`) on the tiny real EasyAnimate transformer: only adapters train, the base
stays bitwise equal; checkpoints hold only the adapters and refuse a model that does not match; the export is the
base pipeline plus `lora/`, which a stock `EasyAnimatePipeline` loads through peft and then gives the latents of
vidray's sampler with the adapters merged; `vidray generate --lora` merges a LoRA before sampling."""

from __future__ import annotations

import json
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from diffusers import EasyAnimatePipeline  # noqa: E402
from peft import PeftModel, get_peft_model_state_dict, inject_adapter_in_model, set_peft_model_state_dict  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from vidray.config import (  # noqa: E402
    RESUME_FIXED,
    RESUME_RULES,
    ConfigError,
    FlowConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    diff_for_resume,
    job_config_from_dict,
    load_job_config,
)
from vidray.buckets import Bucket  # noqa: E402
from vidray.inference.sampler import sample_latents  # noqa: E402
from vidray.errors import UserError  # noqa: E402
from vidray.generate import GenerateArgumentError, check_generate_args, generate_to_file  # noqa: E402
from vidray.models import get_family  # noqa: E402
from vidray.models.base import Components  # noqa: E402
from vidray.models.formats import DIFFUSERS_LORA_WEIGHTS, LORA_DIR, PEFT_CONFIG, PEFT_WEIGHTS  # noqa: E402
from vidray.models.export import (  # noqa: E402
    ADAPTER_PART,
    export_pipeline,
    load_model,
    lora_path_problem,
    write_job_file,
)
from vidray.models.lora import (  # noqa: E402
    LoraLoadError,
    adapter_state_dict,
    apply_lora,
    check_lora_targets,
    has_lora,
    load_adapter_state_dict,
    load_lora_into,
    lora_summary,
    lora_target_names,
    merge_lora,
    read_lora_weights,
    save_lora_weights,
)
from vidray.models.text_encoder import encode_prompts  # noqa: E402
from vidray.train.checkpoint import (  # noqa: E402
    CheckpointError,
    TrainState,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from vidray.train.optim import build_lr_scheduler, build_optimizer  # noqa: E402
from vidray.train.step import flow_matching_step_loss  # noqa: E402

FAMILY = get_family("easyanimate")
LORA = LoraConfig(rank=4, alpha=8.0)
OPTIM = OptimConfig(lr=3e-3, weight_decay=0.0)
FLOW = FlowConfig(shift=3.0)
BUCKET = Bucket(5, 32, 32)
MAX_SEQUENCE_LENGTH = 16
PROMPTS = ["a red ball bouncing", "waves on a beach"]
JOB = {
    "name": "tiny-lora",
    "model": {"text_encoder": "tiny_random", "max_sequence_length": MAX_SEQUENCE_LENGTH,
              "lora": {"rank": 4, "alpha": 8.0}},
    "data": {"buckets": [[5, 32, 32]]},
    "flow": {"shift": 3.0},
    "optim": {"lr": 3e-3, "weight_decay": 0.0},
}


def base_transformer(seed: int = 0) -> torch.nn.Module:
    return FAMILY.load_diffusion_models(ModelConfig(text_encoder="tiny_random"), seed=seed).transformer


def batch(seed: int = 0, batch_size: int = 2):
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(FAMILY.latent_shape(BUCKET, batch_size), generator=g)
    prompt_embeds = torch.randn(batch_size, 6, 64, generator=g)  # tiny_random's hidden size is 64
    return latents, prompt_embeds, torch.ones(batch_size, 6, dtype=torch.bool)


def train_steps(transformer, optimizer, scheduler, num_steps: int, first_step: int = 1) -> list[float]:
    losses = []
    for step in range(first_step, first_step + num_steps):
        latents, prompt_embeds, mask = batch(step)
        loss = flow_matching_step_loss(FAMILY, transformer, latents, prompt_embeds, mask, FLOW,
                                       torch.Generator().manual_seed(step))
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def lora_run(steps: int = 4, seed: int = 0):
    """A tiny LoRA run: base (seed 0) + adapters (seed `seed`), trained `steps` AdamW steps."""
    transformer = apply_lora(base_transformer(), LORA, seed=seed)
    optimizer = build_optimizer(transformer.parameters(), OPTIM)
    scheduler = build_lr_scheduler(optimizer, OPTIM)
    train_steps(transformer, optimizer, scheduler, steps)
    return transformer, optimizer, scheduler


def predict(transformer, seed: int = 7) -> torch.Tensor:
    latents, prompt_embeds, mask = batch(seed)
    with torch.no_grad():
        return FAMILY.predict(transformer.eval(), latents, torch.full((2,), 500.0), prompt_embeds, mask)


# -- config ------------------------------------------------------------------------------------------------------


def test_lora_section_defaults_to_attention_projections_and_null_is_full_fine_tuning():
    assert load_job_config(None).model.lora is None
    lora = load_job_config(None, ["model.lora={rank: 8}"]).model.lora
    assert lora == LoraConfig(rank=8) and lora.target_modules == ["to_q", "to_k", "to_v", "to_out.0"]
    assert lora.lora_alpha == 8.0 and LoraConfig(rank=8, alpha=4).lora_alpha == 4.0


@pytest.mark.parametrize("override, message", [
    ("model.lora.rank=0", "model.lora.rank must be >= 1, got 0"),
    ("model.lora={rank: -3}", "model.lora.rank must be >= 1, got -3"),
    ("model.lora={alpha: 0}", "model.lora.alpha must be > 0 or null (= rank), got 0"),
    ("model.lora={dropout: 1.0}", "model.lora.dropout must be in [0, 1), got 1.0"),
    ("model.lora={dropout: -0.1}", "model.lora.dropout must be in [0, 1), got -0.1"),
    ("model.lora={target_modules: []}", "model.lora.target_modules is empty"),
    ("model.lora={rank: true}", "model.lora.rank: true is a boolean, not a number"),
    ("model.lora={rnk: 4}", "unknown key 'model.lora.rnk'; valid: rank, alpha, dropout, target_modules"),
])
def test_bad_lora_values_are_refused_at_load_naming_the_dotted_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_job_config(None, [override])
    assert message in str(err.value)


def test_model_lora_is_fixed_for_the_run_and_turning_it_on_or_off_is_a_resume_change():
    assert RESUME_RULES["model.lora"] == RESUME_FIXED
    full, lora = job_config_from_dict({}), job_config_from_dict({"model": {"lora": {"rank": 4}}})
    assert set(diff_for_resume(full.to_dict(), lora).fixed) == {"model.lora"}
    assert set(diff_for_resume(lora.to_dict(), full).fixed) == {"model.lora"}
    rank8 = job_config_from_dict({"model": {"lora": {"rank": 8}}})
    assert diff_for_resume(lora.to_dict(), rank8).fixed["model.lora"][0]["rank"] == 4
    assert not diff_for_resume(lora.to_dict(), lora).fixed


# -- apply, train, merge ------------------------------------------------------------------------------------------


def test_an_unknown_target_module_is_refused_listing_the_layers_that_exist():
    transformer = base_transformer()
    with pytest.raises(UserError) as err:
        apply_lora(transformer, LoraConfig(target_modules=["to_q", "to_qkv"]))
    message = str(err.value)
    assert message.startswith("model.lora.target_modules: 'to_qkv' matches no layer")
    for name in ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "to_add_out", "proj_out"):
        assert name in message and name in lora_target_names(transformer)
    assert not has_lora(transformer) and all(p.requires_grad for p in transformer.parameters())  # left untouched
    with torch.device("meta"):  # the same check on a model that holds no memory (a driver-side check)
        meta = FAMILY.load_diffusion_models(ModelConfig(text_encoder="tiny_random"), seed=0).transformer
    assert next(meta.parameters()).is_meta
    with pytest.raises(UserError, match="'to_qkv' matches no layer"):
        check_lora_targets(meta, LoraConfig(target_modules=["to_qkv"]))
    check_lora_targets(meta, LoraConfig())


def test_only_adapters_train_and_the_base_stays_bitwise_equal():
    transformer = base_transformer()
    base = {k: v.clone() for k, v in transformer.state_dict().items()}
    before = predict(transformer)
    apply_lora(transformer, LORA, seed=0)
    assert torch.equal(predict(transformer), before)  # B = 0: the adapted model starts as the base
    trainable = {n for n, p in transformer.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable} == {"to_q", "to_k", "to_v", "0"}
    counts = lora_summary(transformer)
    print(f"\nLoRA rank {LORA.rank}: trainable {counts['trainable']} of {counts['total']} parameters "
          f"({counts['trainable'] / counts['total']:.4%})")
    assert counts["trainable"] == counts["adapter"] and counts["trainable"] / counts["total"] < 0.02

    optimizer = build_optimizer(transformer.parameters(), OPTIM)
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) == counts["trainable"]
    adapters = adapter_state_dict(transformer)
    losses = train_steps(transformer, optimizer, build_lr_scheduler(optimizer, OPTIM), 4)
    assert all(np.isfinite(losses))
    after = adapter_state_dict(transformer)
    assert all(not torch.equal(adapters[k], after[k]) for k in adapters if ".lora_B." in k)  # every B moved
    with torch.no_grad():
        for name, param in transformer.named_parameters():
            if not param.requires_grad:
                key = name.replace(".base_layer.", ".")
                assert torch.equal(param, base[key]), name  # bitwise
    assert not torch.allclose(predict(transformer), before, atol=1e-4)


def test_adapter_state_dict_names_tensors_as_peft_does():
    transformer, _, _ = lora_run(steps=1)
    ours, peft_state = adapter_state_dict(transformer), get_peft_model_state_dict(transformer)
    assert ours.keys() == peft_state.keys()
    assert all(torch.equal(ours[k], peft_state[k]) for k in ours)
    assert ours["transformer_blocks.0.attn1.to_q.lora_A.weight"].shape == (4, 128)
    assert ours["transformer_blocks.0.attn1.to_q.lora_B.weight"].shape == (128, 4)


def test_merged_model_computes_what_the_adapted_one_does():
    transformer, _, _ = lora_run()
    adapted = predict(transformer)
    merge_lora(transformer)
    assert not has_lora(transformer)
    assert set(transformer.state_dict()) == set(base_transformer().state_dict())  # a stock module again
    torch.testing.assert_close(predict(transformer), adapted, atol=1e-5, rtol=1e-5)


def test_apply_lora_under_a_seed_is_reproducible_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a = adapter_state_dict(apply_lora(base_transformer(), LORA, seed=5))
    assert torch.equal(torch.rand(3), expected)
    b = adapter_state_dict(apply_lora(base_transformer(), LORA, seed=5))
    assert all(torch.equal(a[k], b[k]) for k in a)


# -- checkpoints ---------------------------------------------------------------------------------------------------


def save(directory, transformer, optimizer, scheduler, step=4, job=JOB):
    return save_checkpoint(directory, model=transformer, optimizer=optimizer, lr_scheduler=scheduler,
                           train_state=TrainState(step, 0, step, 1, "sha256:abc"), job_config=job)


def test_a_lora_checkpoint_holds_only_the_adapters_and_resumes_exactly(tmp_path):
    transformer, optimizer, scheduler = lora_run(steps=4)
    save(tmp_path / "lora", transformer, optimizer, scheduler)
    manifest = verify_checkpoint(tmp_path / "lora")
    assert manifest["parts"][0] == ADAPTER_PART and not (tmp_path / "lora" / "transformer.safetensors").exists()
    assert manifest["lora"] == {"rank": 4, "alpha": 8.0, "dropout": 0.0,
                                "target_modules": ["to_k", "to_out.0", "to_q", "to_v"]}

    full = base_transformer()
    full_optimizer = build_optimizer(full.parameters(), OPTIM)
    full_scheduler = build_lr_scheduler(full_optimizer, OPTIM)
    train_steps(full, full_optimizer, full_scheduler, 1)
    save(tmp_path / "full", full, full_optimizer, full_scheduler, job={"name": "full"})
    sizes = {kind: {part: (tmp_path / kind / part).stat().st_size
                    for part in (ADAPTER_PART, "transformer.safetensors", "optimizer.pt")
                    if (tmp_path / kind / part).exists()} for kind in ("lora", "full")}
    lora_bytes = sum(p.stat().st_size for p in (tmp_path / "lora").iterdir())
    full_bytes = sum(p.stat().st_size for p in (tmp_path / "full").iterdir())
    print(f"\ncheckpoint bytes: LoRA {lora_bytes} ({sizes['lora']}), full {full_bytes} ({sizes['full']}): "
          f"{lora_bytes / full_bytes:.4f}")
    assert sizes["lora"][ADAPTER_PART] < 0.02 * sizes["full"]["transformer.safetensors"]
    assert lora_bytes < 0.05 * full_bytes

    # Resume: the base from the model init, other adapter draws, then the checkpoint: the same run continues.
    resumed = apply_lora(base_transformer(), LORA, seed=99)
    resumed_optimizer = build_optimizer(resumed.parameters(), OPTIM)
    resumed_scheduler = build_lr_scheduler(resumed_optimizer, OPTIM)
    state = load_checkpoint(tmp_path / "lora", transformer=resumed, optimizer=resumed_optimizer,
                            lr_scheduler=resumed_scheduler)
    assert state.step == 4
    expected, got = adapter_state_dict(transformer), adapter_state_dict(resumed)
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    more = train_steps(transformer, optimizer, scheduler, 2, first_step=5)
    assert train_steps(resumed, resumed_optimizer, resumed_scheduler, 2, first_step=5) == more
    assert all(torch.equal(a, b) for a, b in zip(transformer.state_dict().values(), resumed.state_dict().values()))


def test_a_lora_checkpoint_is_refused_for_a_model_without_model_lora(tmp_path):
    save(tmp_path / "c", *lora_run(steps=1))
    full = base_transformer()
    optimizer = build_optimizer(full.parameters(), OPTIM)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path / "c", transformer=full, optimizer=optimizer,
                        lr_scheduler=build_lr_scheduler(optimizer, OPTIM))
    assert "holds LoRA adapters only" in str(err.value) and "this run has no model.lora" in str(err.value)
    assert err.value.part == ADAPTER_PART and isinstance(err.value, UserError)


def test_a_full_checkpoint_is_refused_for_a_lora_model(tmp_path):
    full = base_transformer()
    optimizer = build_optimizer(full.parameters(), OPTIM)
    scheduler = build_lr_scheduler(optimizer, OPTIM)
    save(tmp_path / "c", full, optimizer, scheduler, job={"name": "full"})
    lora = apply_lora(base_transformer(), LORA, seed=0)
    lora_optimizer = build_optimizer(lora.parameters(), OPTIM)
    with pytest.raises(CheckpointError, match=r"holds the full transformer .* but this run has model.lora set"):
        load_checkpoint(tmp_path / "c", transformer=lora, optimizer=lora_optimizer,
                        lr_scheduler=build_lr_scheduler(lora_optimizer, OPTIM))


def test_a_lora_checkpoint_of_another_rank_is_refused_naming_model_lora(tmp_path):
    save(tmp_path / "c", *lora_run(steps=1))
    other = apply_lora(base_transformer(), LoraConfig(rank=8), seed=0)
    optimizer = build_optimizer(other.parameters(), OPTIM)
    with pytest.raises(CheckpointError, match=r"adapter.safetensors does not fit this model .*of another shape.*"
                                              r"model.lora must match .*'rank': 4"):
        load_checkpoint(tmp_path / "c", transformer=other, optimizer=optimizer,
                        lr_scheduler=build_lr_scheduler(optimizer, OPTIM))


def test_load_adapter_state_dict_names_missing_and_unexpected_keys():
    transformer = apply_lora(base_transformer(), LORA, seed=0)
    state = adapter_state_dict(transformer)
    state.pop("transformer_blocks.0.attn1.to_q.lora_A.weight")
    state["transformer_blocks.0.attn1.to_z.lora_A.weight"] = torch.zeros(4, 128)
    with pytest.raises(ValueError, match=r"1 missing \(transformer_blocks.0.attn1.to_q.lora_A.weight\); "
                                         r"1 unexpected \(transformer_blocks.0.attn1.to_z.lora_A.weight\)"):
        load_adapter_state_dict(transformer, state)


# -- export, stock pipeline, generate ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A trained tiny LoRA run exported as the loop exports it: base pipeline + lora/ + vidray_job.yaml."""
    transformer, _, _ = lora_run(steps=6)
    encoders = FAMILY.build_encoders(ModelConfig(text_encoder="tiny_random"), seed=0)
    components = Components(transformer=transformer.eval(), vae=encoders.vae, text_encoder=encoders.text_encoder,
                            tokenizer=encoders.tokenizer)
    out_dir = export_pipeline(FAMILY, components, tmp_path_factory.mktemp("export") / "diffusers", FLOW)
    write_job_file(out_dir, job_config_from_dict(JOB))
    return components, out_dir


def test_export_writes_the_base_pipeline_and_the_adapters_in_both_formats(exported):
    components, out_dir = exported
    assert has_lora(components.transformer)  # the run's transformer keeps its adapters after the export
    files = sorted(p.name for p in (out_dir / LORA_DIR).iterdir())
    assert files == sorted([DIFFUSERS_LORA_WEIGHTS, PEFT_CONFIG, PEFT_WEIGHTS])
    pipe = EasyAnimatePipeline.from_pretrained(out_dir, local_files_only=True)
    assert set(pipe.transformer.state_dict()) == set(base_transformer().state_dict())  # stock keys, the base's
    for key, value in base_transformer().state_dict().items():
        assert torch.equal(pipe.transformer.state_dict()[key], value), key
    with safe_open(str(out_dir / LORA_DIR / DIFFUSERS_LORA_WEIGHTS), framework="pt") as f:
        keys, metadata = list(f.keys()), json.loads(f.metadata()["lora_adapter_metadata"])
    assert all(k.startswith("transformer.transformer_blocks.") and ".lora_" in k for k in keys)
    assert metadata["transformer.r"] == 4 and metadata["transformer.lora_alpha"] == 8.0
    config = json.loads((out_dir / LORA_DIR / PEFT_CONFIG).read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4


def stock_and_vidray_latents(out_dir, guidance_scale: float, load_adapters):
    model = load_model(out_dir)  # vidray: base + the export's adapters merged
    assert not has_lora(model.components.transformer)
    pipe = EasyAnimatePipeline.from_pretrained(out_dir, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    load_adapters(pipe)
    embeds, mask = encode_prompts(model.components.text_encoder, model.components.tokenizer, PROMPTS,
                                  max_sequence_length=MAX_SEQUENCE_LENGTH)
    negative, negative_mask = encode_prompts(model.components.text_encoder, model.components.tokenizer, ["", ""],
                                             max_sequence_length=MAX_SEQUENCE_LENGTH)
    ours = sample_latents(
        FAMILY, model.components.transformer, embeds, mask, latent_shape=FAMILY.latent_shape(BUCKET, 2),
        num_inference_steps=3, shift=FLOW.shift, num_train_timesteps=FLOW.num_train_timesteps,
        guidance_scale=guidance_scale, negative_prompt_embeds=negative, negative_prompt_attention_mask=negative_mask,
        generator=torch.Generator().manual_seed(5),
    )
    stock = pipe(
        prompt_embeds=embeds, prompt_attention_mask=mask, negative_prompt_embeds=negative,
        negative_prompt_attention_mask=negative_mask, num_frames=BUCKET.num_frames, height=BUCKET.height,
        width=BUCKET.width, num_inference_steps=3, guidance_scale=guidance_scale,
        generator=torch.Generator().manual_seed(5), output_type="latent",
    ).frames
    return ours, stock


@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
def test_stock_pipeline_with_the_exported_lora_via_peft_gives_vidrays_merged_latents(exported, guidance_scale):
    _, out_dir = exported
    ours, stock = stock_and_vidray_latents(
        out_dir, guidance_scale, lambda pipe: PeftModel.from_pretrained(pipe.transformer, out_dir / LORA_DIR))
    torch.testing.assert_close(ours, stock, atol=1e-5, rtol=1e-5)
    base = EasyAnimatePipeline.from_pretrained(out_dir, local_files_only=True)  # no adapters: other latents
    base.set_progress_bar_config(disable=True)
    embeds, mask = encode_prompts(base.text_encoder, base.tokenizer, PROMPTS, max_sequence_length=MAX_SEQUENCE_LENGTH)
    without = base(prompt_embeds=embeds, prompt_attention_mask=mask, num_frames=BUCKET.num_frames,
                   height=BUCKET.height, width=BUCKET.width, num_inference_steps=3, guidance_scale=1.0,
                   generator=torch.Generator().manual_seed(5), output_type="latent").frames
    if guidance_scale == 1.0:
        assert (without - stock).abs().max() > 1e-3


def test_the_diffusers_format_file_loads_with_peft_and_diffusers_readers(exported):
    """The diffusers-format file as diffusers' training scripts reload it into a transformer: read with a stock
    LoRA loader's `lora_state_dict` (WanLoraLoaderMixin: EasyAnimate has none), config from the metadata, then
    `inject_adapter_in_model` + `set_peft_model_state_dict`."""
    from diffusers.loaders import WanLoraLoaderMixin
    from peft import LoraConfig as PeftLoraConfig

    _, out_dir = exported
    state, metadata = WanLoraLoaderMixin.lora_state_dict(out_dir / LORA_DIR, return_lora_metadata=True)
    state = {k.removeprefix("transformer."): v for k, v in state.items()}
    config = {k.removeprefix("transformer."): v for k, v in metadata.items()}

    def load(pipe):
        inject_adapter_in_model(PeftLoraConfig(r=config["r"], lora_alpha=config["lora_alpha"],
                                               target_modules=config["target_modules"]), pipe.transformer)
        result = set_peft_model_state_dict(pipe.transformer, state)
        assert not result.unexpected_keys

    ours, stock = stock_and_vidray_latents(out_dir, 1.0, load)
    torch.testing.assert_close(ours, stock, atol=1e-5, rtol=1e-5)


def test_read_lora_weights_reads_both_formats_alike(exported):
    _, out_dir = exported
    diffusers_config, diffusers_state = read_lora_weights(out_dir / LORA_DIR)
    peft_config, peft_state = read_lora_weights(out_dir / LORA_DIR / PEFT_WEIGHTS)
    assert diffusers_state.keys() == peft_state.keys()
    assert all(torch.equal(diffusers_state[k], peft_state[k]) for k in peft_state)
    assert (diffusers_config.r, diffusers_config.lora_alpha) == (peft_config.r, peft_config.lora_alpha) == (4, 8.0)


def test_load_lora_into_refuses_a_lora_of_another_model_naming_the_path(exported, tmp_path):
    _, out_dir = exported
    transformer = base_transformer()
    save_lora_weights(apply_lora(torch.nn.Sequential(torch.nn.Linear(4, 4)), LoraConfig(target_modules=["0"])),
                      tmp_path / "other")
    before = {k: v.clone() for k, v in transformer.state_dict().items()}
    with pytest.raises(LoraLoadError, match=str(tmp_path / "other")):
        load_lora_into(transformer, tmp_path / "other")
    assert not has_lora(transformer)
    assert all(torch.equal(before[k], v) for k, v in transformer.state_dict().items())  # left as it was
    with pytest.raises(LoraLoadError, match="holds neither pytorch_lora_weights.safetensors"):
        load_lora_into(transformer, tmp_path)


def test_generate_with_lora_on_the_base_export_equals_generating_from_the_lora_export(exported, tmp_path):
    """`vidray generate --model <base> --lora <run>/diffusers/lora` samples what the LoRA run's own export does."""
    from vidray.data.video import decode_mp4

    _, out_dir = exported
    base_dir = tmp_path / "base"
    shutil.copytree(out_dir, base_dir, ignore=shutil.ignore_patterns(LORA_DIR))
    kwargs = dict(bucket=BUCKET, num_inference_steps=2, seed=3)
    with_lora = generate_to_file(base_dir, "a red ball", tmp_path / "a.mp4", lora=out_dir / LORA_DIR, **kwargs)
    own = generate_to_file(out_dir, "a red ball", tmp_path / "b.mp4", **kwargs)
    plain = generate_to_file(base_dir, "a red ball", tmp_path / "c.mp4", **kwargs)
    frames = [decode_mp4(p.read_bytes()) for p in (with_lora, own, plain)]
    assert np.array_equal(frames[0], frames[1])
    assert not np.array_equal(frames[0], frames[2])


def test_generate_refuses_a_bad_lora_path_before_loading_weights(exported, tmp_path):
    _, out_dir = exported
    with pytest.raises(GenerateArgumentError, match=r"--lora .*nope does not exist"):
        check_generate_args(out_dir, "a cat", tmp_path / "x.mp4", lora=tmp_path / "nope")
    assert "give " + str(out_dir / LORA_DIR) in lora_path_problem(out_dir)  # the export itself: names its lora/
    assert lora_path_problem(out_dir / LORA_DIR) is None
    assert "URI" in lora_path_problem("s3://bucket/lora")


def test_load_model_of_a_lora_checkpoint_merges_its_adapters_into_the_base(tmp_path):
    transformer, optimizer, scheduler = lora_run(steps=3)
    save(tmp_path / "checkpoint_000003", transformer, optimizer, scheduler)
    model = load_model(tmp_path / "checkpoint_000003")
    assert not has_lora(model.components.transformer)
    torch.testing.assert_close(predict(model.components.transformer), predict(transformer), atol=1e-5, rtol=1e-5)


def test_serve_config_lora_path_is_checked_at_build_and_merged_by_the_denoiser(exported, tmp_path, monkeypatch):
    from vidray.serve.app import ServeSettingsError, build_app
    from vidray.serve.stages import _load

    components, out_dir = exported
    base_dir = tmp_path / "base"
    shutil.copytree(out_dir, base_dir, ignore=shutil.ignore_patterns(LORA_DIR))
    monkeypatch.setenv("VIDRAY_API_TOKEN", "a-token-of-at-least-16-chars")
    args = {"model_path": str(base_dir), "store_dir": str(tmp_path / "store")}
    with pytest.raises(ServeSettingsError, match=r"lora_path: .*missing does not exist"):
        build_app({**args, "lora_path": str(tmp_path / "missing")})
    app = build_app({**args, "lora_path": str(out_dir / LORA_DIR)})
    denoiser = app._bound_deployment.init_args[3]._bound_deployment
    assert denoiser.name == "Denoiser" and denoiser.init_args[2] == str(out_dir / LORA_DIR)
    merged = _load(str(base_dir), "transformer", str(out_dir / LORA_DIR)).components.transformer
    torch.testing.assert_close(predict(merged), predict(components.transformer), atol=1e-5, rtol=1e-5)


def test_in_the_loops_order_the_no_grad_probe_sees_only_adapters_and_ddp_checkpoints_them(tmp_path):
    """The loop's order: build -> apply_lora -> freeze the probe's no-grad parameters -> optimizer -> DDP. With
    `to_add_out` targeted, the last block's (whose text output is unused) adapters get no gradient: the probe
    finds them, and the checkpoint of the DDP-wrapped model still holds every adapter, named without `module.`."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    transformer = apply_lora(base_transformer(), LoraConfig(rank=2, target_modules=["to_q", "to_add_out"]), seed=0)
    no_grad = FAMILY.no_grad_parameter_names(transformer)
    assert no_grad and all(".lora_" in n for n in no_grad)
    assert {n.split(".attn1.")[0] for n in no_grad} == {"transformer_blocks.2"}
    for name, param in transformer.named_parameters():
        if name in no_grad:
            param.requires_grad_(False)
    optimizer = build_optimizer(transformer.parameters(), OPTIM)
    scheduler = build_lr_scheduler(optimizer, OPTIM)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = DistributedDataParallel(transformer)
        train_steps(model, optimizer, scheduler, 2)
        save(tmp_path / "c", model, optimizer, scheduler)
    finally:
        dist.destroy_process_group()
    saved = adapter_state_dict(transformer)
    on_disk = load_file(str(tmp_path / "c" / ADAPTER_PART))
    assert on_disk.keys() == saved.keys() and all(torch.equal(on_disk[k], saved[k]) for k in saved)
    assert any(k.startswith("transformer_blocks.2.attn1.to_add_out.lora_") for k in on_disk)
