"""The planner's memory modes (`vidray.train.plan`: frozen storage fp32/bf16/fp8, block swap, activation offload,
FSDP2 CPU offload;
`vidray.plan_inference`: generation's storage x offload) on the seeds' scenarios, through the shipped configs and
`vidray plan` (exit 0 when something fits, 1 when nothing does), and the fp8 storage against a measured CPU step.
No Ray, no weights: the large models are built on the meta device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vidray.cli import main
from vidray.config import load_job_config
from vidray.buckets import Bucket
from vidray.errors import UserError
from vidray.models.presets import get_preset
from vidray.plan_inference import check_generation_fits, check_inference_fits, plan_inference
from vidray.train.plan import (HEADROOM, HOST_HEADROOM, MemoryMode, Strategy, check_fits, count_model,
                               estimate_memory, frozen_bytes, job_mode, plan_job)

ROOT = Path(__file__).resolve().parents[2]
A14B = str(ROOT / "jobs/configs/wan22_a14b_lora_2x24gb.yaml")
EA_LORA = str(ROOT / "jobs/configs/easyanimate_v5_7b_lora_24gb.yaml")
WAN_FULL = str(ROOT / "jobs/configs/wan21_14b_full_8x80gb.yaml")
GIB = 2**30


def _plan(capsys, *argv: str) -> tuple[int, str]:
    code = main(["plan", *argv])
    return code, capsys.readouterr().out


def test_a14b_lora_81x480x832_on_two_24gib_gpus_fits_one_expert_per_gpu_with_activation_offload(capsys):
    """The seeds' two-4090 setup at the issue's 81x480x832 (21 x 30 x 52 = 32,760 video tokens): each GPU holds one
    expert (layout groups), its frozen base in fp8 with the last blocks swapped to pinned host memory, its adapters,
    and with `memory.activation_offload` the checkpointed blocks' inputs (40 x 32,760 x 5120 x 2 bytes = 12.5 GiB)
    and the token-wide tensors saved outside the blocks in pinned host memory: what the device keeps is the
    recomputed block (9.0 GiB), its backward's temporaries and the resident weights."""
    code, out = _plan(capsys, A14B, "--preset", "wan2.2-a14b", "--gpu-memory", "24GiB", "--host-memory", "64GiB")
    assert code == 0, out
    picked = next(line for line in out.splitlines() if line.startswith("picked:"))
    assert picked.startswith("picked: lora+AC bf16, fp8 frozen, swap 18, act offload: 21.5 GiB per GPU, 20.0 GiB "
                             "pinned host memory per rank"), picked
    assert "memory.storage_dtype=fp8 memory.block_swap=18 memory.activation_offload=true" in picked
    assert "each worker holds one expert" in out and "its group of 1 GPU(s)" in out
    # The same command line as the (its tiny config, the preset, the bucket on the command line).
    code, out = _plan(capsys, str(ROOT / "jobs/configs/wan_i2v_tiny.yaml"), "--preset", "wan2.2-a14b", "--frames",
                      "81", "--height", "480", "--width", "832", "--gpus", "2", "--gpu-memory", "24GiB",
                      "--host-memory", "64GiB")
    assert code == 0 and "memory.activation_offload=true" in out, out
    job = load_job_config(A14B)
    assert tuple(job.data.buckets[0]) == (81, 480, 832)
    report = plan_job(job, gpu_memory_bytes=24 * GIB, num_gpus=2, preset=get_preset("wan2.2-a14b"),
                      host_memory=64 * GIB)
    chosen, counts = report.chosen, report.counts
    n, tokens, dim = chosen.mode.block_swap, 32_760, 5120
    assert chosen.mode == MemoryMode("fp8", block_swap=n, activation_offload=True)
    # host: the swapped blocks' fp8 bytes + every block's bf16 input + what the layers outside the blocks save over
    # the video tokens (the patch embedding's fp32 output, 3 D bf16 for LoRA) and the text tokens (fp32)
    swapped = sum(frozen_bytes(counts, "fp8", i) for i in range(40 - n, 40))
    activations = 40 * tokens * dim * 2 + tokens * (dim * 4 + 3 * dim * 2) + 512 * dim * 4
    assert chosen.host_bytes == swapped + activations
    # The device no longer holds the inputs: without the offload the same swap peaks in the top block's backward
    # with the 39 blocks' inputs below it on the device, 12.2 GiB more at least.
    plain = estimate_memory(report.preset, counts, chosen.strategy, bucket=report.bucket, batch_size=1,
                            text_tokens=512, num_gpus=1, mode=MemoryMode("fp8", block_swap=n))
    assert plain.peak_bytes - chosen.peak_bytes > 39 * tokens * dim * 2 and not plain.peak_bytes < 0.9 * 24 * GIB
    # The choice is expressible as the job's own keys: the shipped config asks for exactly the picked mode.
    assert job_mode(job) == chosen.mode
    assert check_fits(job, 24 * GIB, 2, host_memory=64 * GIB, preset=get_preset("wan2.2-a14b")).requested.fits
    # Two ranks' pinned bytes must fit the node: on a 48 GiB node (33.6 GiB for pinned memory) it is refused.
    with pytest.raises(UserError) as err:
        check_fits(job, 24 * GIB, 2, host_memory=48 * GIB, preset=get_preset("wan2.2-a14b"))
    assert "pinned host memory per rank" in str(err.value) and "\n" not in str(err.value)


def test_a14b_at_81x480x832_is_refused_on_16_gib_by_honest_counting_saying_what_would_fit(capsys):
    """On 2 x 16 GiB (14.4 GiB budget) nothing fits: with activation offload and 39 of 40 blocks swapped one
    expert's step still holds the recomputed block (LoRA: 8.4 GiB + 0.65 GiB of bf16 weight copies), its backward's
    temporaries (32,760 x (2 x 13,824 x 2 + 6 x 5120 x 2) = 3.6 GiB) and the resident weights: 14.6 GiB, GPUs of
    16.2 GiB or more; and that mode pins 26.8 GiB per rank, which a 64 GiB node cannot give two ranks, where the
    least is block swap alone at 28.2 GiB (the count before activation offload existed)."""
    args = (A14B, "--preset", "wan2.2-a14b", "--gpus", "2", "--gpu-memory", "16GiB")
    code, out = _plan(capsys, *args, "--host-memory", "128GiB")
    assert code == 1, out
    picked = next(line for line in out.splitlines() if line.startswith("picked:"))
    assert picked.startswith("picked: none fits: the least is lora+AC bf16, fp8 frozen, swap 39, act offload at "
                             "14.6 GiB"), picked
    assert "fits GPUs of 16.2 GiB or more" in picked and "memory.activation_offload=true" in picked
    code, out = _plan(capsys, *args, "--host-memory", "64GiB")
    assert code == 1, out
    picked = next(line for line in out.splitlines() if line.startswith("picked:"))
    assert picked.startswith("picked: none fits: the least is lora+AC bf16, fp8 frozen, swap 39 at 28.2 GiB"), picked
    assert "fits GPUs of 31.3 GiB or more" in picked and "memory.block_swap=39" in picked
    with pytest.raises(UserError) as err:
        check_fits(load_job_config(A14B), 16 * GIB, 2, host_memory=128 * GIB, preset=get_preset("wan2.2-a14b"))
    message = str(err.value)
    assert "\n" not in message and "the least is lora+AC bf16, fp8 frozen, swap 39, act offload" in message


def test_activation_offload_needs_activation_checkpointing_in_the_planner():
    preset = get_preset("wan2.1-14b")
    with pytest.raises(ValueError, match="activation offload needs activation checkpointing"):
        estimate_memory(preset, count_model(preset), Strategy("lora", False, "bf16"), bucket=Bucket(49, 480, 832),
                        batch_size=1, text_tokens=512, mode=MemoryMode("fp8", activation_offload=True))
    assert MemoryMode("fp8", block_swap=3).transfer_rank < MemoryMode("fp8", activation_offload=True).transfer_rank


def test_easyanimate_7b_generation_and_lora_fit_one_24gib_gpu(capsys):
    """The seeds' EasyAnimateV5-7b row: 49x576x1008 generation on a 24 GiB card with fp8 storage (their qfloat8) and
    model offload fits, and so does fp8 without offload here; bf16 without offload (the 8.3 B Qwen2-VL text
    encoder alone is 15.4 GiB) does not. The LoRA run fits one 24 GiB GPU with fp8 + block swap."""
    code, out = _plan(capsys, "--inference", "--preset", "easyanimate-v5-7b", "--frames", "49", "--height", "576",
                      "--width", "1008", "--gpu-memory", "24GiB", "--host-memory", "64GiB")
    assert code == 0, out
    report = plan_inference(get_preset("easyanimate-v5-7b"), bucket=Bucket(49, 576, 1008),
                            gpu_memory_bytes=24 * GIB, host_memory_bytes=64 * GIB)
    rows = {(e.storage, e.offload): e for e in report.estimates}
    assert rows["fp8", "model"].fits and not rows["bf16", "none"].fits
    assert rows["fp8", "model"].device_bytes < rows["fp8", "none"].device_bytes
    assert rows["bf16", "none"].host_bytes == 0 and rows["fp8", "model"].host_bytes > 0
    code, out = _plan(capsys, EA_LORA, "--preset", "easyanimate-v5-7b", "--gpu-memory", "24GiB",
                      "--host-memory", "64GiB")
    assert code == 0 and "picked: lora+AC bf16, fp8 frozen, swap" in out, out
    assert job_mode(load_job_config(EA_LORA)) == plan_job(
        load_job_config(EA_LORA), gpu_memory_bytes=24 * GIB, num_gpus=1, preset=get_preset("easyanimate-v5-7b"),
        host_memory=64 * GIB).chosen.mode


def test_wan21_14b_full_fine_tuning_at_720p_on_8x80gib_fits_with_context_parallel_or_activation_offload(capsys):
    """Full fine-tuning stays full fine-tuning: at 81x720x1280 (75,600 tokens) FSDP2 + AC fits with the sample split
    over 2 ranks (context parallel, ranked before any offload: 57.5 GiB per GPU), or with the checkpointed blocks'
    inputs in host memory (activation offload, what the shipped config asks: 66.0 GiB per GPU). FSDP2's CPU offload
    alone needs 72.1 GiB, 0.1 GiB over the 72.0 GiB budget: refused, honestly."""
    code, out = _plan(capsys, WAN_FULL, "--preset", "wan2.1-14b", "--gpu-memory", "80GiB", "--host-memory", "1TiB")
    assert code == 0, out
    assert "picked: fsdp+AC bf16, bf16 frozen, cp 2" in out and "parallel.context.ulysses=2" in out
    job = load_job_config(WAN_FULL)
    assert job.data.buckets[0] == Bucket(81, 720, 1280)
    report = plan_job(job, gpu_memory_bytes=80 * GIB, num_gpus=8, preset=get_preset("wan2.1-14b"),
                      host_memory=2**40)
    assert report.chosen.mode == MemoryMode("bf16", ulysses=2)
    assert report.chosen.strategy == Strategy("fsdp", True, "bf16")
    assert job_mode(job) == MemoryMode("bf16", activation_offload=True)
    own = check_fits(job, 80 * GIB, 8, host_memory=2**40, preset=get_preset("wan2.1-14b")).requested
    assert own.fits and own.mode == job_mode(job) and 65.9 * GIB < own.peak_bytes < 66.1 * GIB
    offload = next(e for e in report.estimates if e.strategy == Strategy("fsdp", True, "bf16")
                   and e.mode == MemoryMode("bf16", fsdp_cpu_offload=True))
    assert 0.9 * 80 * GIB < offload.peak_bytes < 0.9 * 80 * GIB + 0.2 * GIB and not offload.fits
    p = report.counts.total
    assert offload.host_bytes == pytest.approx((4 * p + 4 * p + 8 * p) / 8, rel=0.01)
    # The same plan on a node whose host memory cannot pin 8 ranks' shards is refused on the host.
    small = plan_job(job, gpu_memory_bytes=80 * GIB, num_gpus=8, preset=get_preset("wan2.1-14b"),
                     host_memory=128 * GIB)
    for row in (e for e in small.estimates if e.strategy.activation_checkpointing
                and (e.mode.fsdp_cpu_offload or e.mode.activation_offload) and "lora" not in e.strategy.kind):
        assert not row.fits_host and 8 * row.host_bytes > (1 - HOST_HEADROOM) * 128 * GIB, row.name
    with pytest.raises(UserError) as err:
        check_fits(job, 80 * GIB, 8, host_memory=128 * GIB, preset=get_preset("wan2.1-14b"))
    assert "pinned host memory per rank" in str(err.value) and "\n" not in str(err.value)


def test_block_swap_moves_the_swapped_blocks_to_the_host_and_keeps_two_in_flight():
    preset = get_preset("wan2.1-14b")
    counts = count_model(preset)
    kwargs = dict(bucket=Bucket(49, 480, 832), batch_size=1, text_tokens=512)
    strategy = Strategy("lora", True, "bf16")
    fp8 = estimate_memory(preset, counts, strategy, mode=MemoryMode("fp8"), **kwargs)
    swap = estimate_memory(preset, counts, strategy, mode=MemoryMode("fp8", block_swap=20), **kwargs)
    block = frozen_bytes(counts, "fp8", 39)
    assert swap.host_bytes == 20 * block and fp8.parameters - swap.parameters == 18 * block
    assert fp8.peak_bytes - swap.peak_bytes == 18 * block
    bf16 = estimate_memory(preset, counts, strategy, mode=MemoryMode("bf16"), **kwargs)
    assert bf16.parameters - 4 * counts.lora_parameters == 2 * counts.total
    with pytest.raises(ValueError, match="block swap applies to the frozen base of lora"):
        estimate_memory(preset, counts, Strategy("ddp", True, "bf16"), mode=MemoryMode("bf16", block_swap=4),
                        **kwargs)


def test_check_inference_fits_refuses_in_one_line_naming_the_mode_that_fits(tmp_path):
    preset = get_preset("easyanimate-v5-7b")
    bucket = Bucket(49, 576, 1008)
    with pytest.raises(UserError) as err:
        check_inference_fits(preset, bucket=bucket, gpu_memory_bytes=24 * GIB)
    message = str(err.value)
    assert "\n" not in message and message.startswith("predicted out of memory: generating 49x576x1008")
    assert "memory.storage_dtype=fp8 memory.offload=none fits" in message and "--offload none" in message
    assert check_inference_fits(preset, bucket=bucket, gpu_memory_bytes=24 * GIB, storage="fp8",
                                offload="model").fits
    with pytest.raises(UserError, match="for a GPU of"):
        check_inference_fits(preset, bucket=bucket, gpu_memory_bytes=4 * GIB)
    # On CPU nothing is checked (and nothing is read: the folder does not exist).
    assert check_generation_fits(tmp_path / "absent", bucket, "cpu") is None


def test_vidray_plan_inference_on_a_folder_and_bad_input(capsys, tmp_path):
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(
        '{"_class_name": "WanTransformer3DModel", "num_layers": 2, "num_attention_heads": 2, '
        '"attention_head_dim": 16, "ffn_dim": 64, "text_dim": 64, "in_channels": 16, "out_channels": 16}')
    code, out = _plan(capsys, "--inference", str(tmp_path), "--frames", "9", "--height", "64", "--width", "64",
                      "--gpu-memory", "1GiB")
    assert code == 0 and "picked: bf16 storage, offload none" in out, out
    assert main(["plan", "--inference", "--preset", "wan-tiny"]) == 2
    assert "needs the video size" in capsys.readouterr().err
    assert main(["plan"]) == 2 and "needs a job config" in capsys.readouterr().err


@pytest.mark.parametrize("storage", ["bf16", "fp8"])
def test_a_lora_step_on_a_bf16_or_fp8_stored_base_is_planned_within_15_percent(storage):
    """fp8 storage as `vidray.models.storage` applies it (frozen weights bf16, then diffusers' layerwise casting
    to float8_e4m3fn with bf16 compute; the adapters fp32): the measured step holds a bf16 copy of every castable
    weight until the backward, which the plan counts (`benchmarks/_memory_planner.py` measures the medium preset)."""
    from diffusers import EasyAnimateTransformer3DModel
    from vidray.models.storage import apply_storage_dtype
    from peft import LoraConfig, inject_adapter_in_model

    from vidray.train.memory import measure_training_step
    from vidray.train.plan import lora_targets

    torch.set_num_threads(1)
    preset = get_preset("tiny")
    torch.manual_seed(0)
    model = EasyAnimateTransformer3DModel(**preset.config)
    model.requires_grad_(False)
    inject_adapter_in_model(LoraConfig(r=8, lora_alpha=8, target_modules=list(lora_targets("easyanimate"))), model)
    apply_storage_dtype(model, storage, "cpu")  # bf16, or fp8 through diffusers' layerwise casting
    model.train()

    def inputs():
        return dict(hidden_states=torch.randn(2, 16, 3, 8, 8), timestep=torch.rand(2) * 1000,
                    encoder_hidden_states=torch.randn(2, 32, 384))

    measured = measure_training_step(model, inputs, autocast_dtype=torch.bfloat16)
    planned = estimate_memory(preset, count_model(preset, lora_rank=8), Strategy("lora", False, "bf16"),
                              bucket=Bucket(9, 64, 64), batch_size=2, text_tokens=32, mode=MemoryMode(storage))
    assert 0.85 <= planned.peak_bytes / measured.peak_bytes <= 1.15, (planned, measured)
    assert planned.parameters < estimate_memory(preset, count_model(preset, lora_rank=8),
                                                Strategy("lora", False, "bf16"), bucket=Bucket(9, 64, 64),
                                                batch_size=2, text_tokens=32).parameters


def test_headroom_constants_are_the_documented_ones():
    assert HEADROOM == 0.10 and HOST_HEADROOM == 0.30


def _serve_config(path, tmp_path, limits: str, **args: str) -> None:
    """Write a serve config at `path` whose app has a missing model, `limits` and the other `args` (YAML flow
    values): what `vidray plan --inference` reads of one."""
    lines = "".join(f"      {key}: {value}\n" for key, value in args.items())
    path.write_text(f"""applications:
  - name: vidray
    import_path: vidray.serve.app:build_app
    args:
      model_path: {tmp_path}/no-model
      limits: {limits}
{lines}""")


@pytest.mark.parametrize("memory, fits", [("{storage_dtype: fp8, offload: model}", True),
                                          ("{storage_dtype: auto, offload: none}", False)])
def test_plan_inference_of_a_serve_config_checks_its_own_memory_section(capsys, tmp_path, memory, fits):
    """`vidray plan --inference serve_config.yaml`: the limits' largest video (49x576x1008 here) of EasyAnimateV5-7b
    on one 24 GiB GPU; the seeds' fp8 + model offload row fits, bf16 without offload does not (exit 1)."""
    config = tmp_path / "serve_config.yaml"
    _serve_config(config, tmp_path, "{max_num_frames: 49, max_height: 576, max_width: 1008}", memory=memory)
    code, out = _plan(capsys, "--inference", str(config), "--preset", "easyanimate-v5-7b", "--gpu-memory", "24GiB",
                      "--host-memory", "64GiB")
    assert "49x576x1008" in out.replace(" ", "") or "49 x 576 x 1008" in out, out
    assert code == (0 if fits else 1), out
    assert "the serve config's memory" in out and (" fits" if fits else "does not fit") in out.splitlines()[-1]
    code = main(["plan", "--inference", str(config), "--gpu-memory", "24GiB"])  # no folder, no --preset
    assert code == 2 and "is not a diffusers folder here: give --preset" in capsys.readouterr().err


def test_context_parallel_divides_the_denoising_step_so_a_request_too_large_for_cfg_parallel_alone_fits():
    """Wan2.1-14B at 81x720x1280 with guidance on 50 GiB GPUs (45 GiB usable): 57.7 GiB on one GPU, 47.6 GiB a GPU
    with the guidance branches on 2 GPUs (CFG parallel), and on 4 GPUs (2 branches x context degree 2) each GPU's
    denoising step is over half the video tokens: it fits. The components are whole on every GPU, so on 40 GiB GPUs
    it does not fit even split, and the one-line refusal names the split and its context degree."""
    preset, bucket = get_preset("wan2.1-14b"), Bucket(81, 720, 1280)
    with pytest.raises(UserError, match="one guidance branch a GPU\\) needs 47.6 GiB"):
        check_inference_fits(preset, bucket=bucket, gpu_memory_bytes=50 * GIB, cfg=2)
    cfg_only = plan_inference(preset, bucket=bucket, gpu_memory_bytes=50 * GIB, cfg=2).estimates[0]
    split = check_inference_fits(preset, bucket=bucket, gpu_memory_bytes=50 * GIB, cfg=2, context=2)
    assert (split.storage, split.offload) == (cfg_only.storage, cfg_only.offload) == ("bf16", "none")
    assert split.components == cfg_only.components  # each rank holds the whole transformer
    # half of the tokens a GPU (Wan's text stays whole: cross-attention); the 4 fp32 latents are whole on every GPU
    assert 0.49 * cfg_only.denoise_bytes < split.denoise_bytes < 0.51 * cfg_only.denoise_bytes
    assert split.device_bytes <= 0.9 * 50 * GIB < cfg_only.device_bytes
    # Without guidance the sequence split alone does it (vidray generate --gpus 2 --guidance-scale 1).
    with pytest.raises(UserError):
        check_inference_fits(preset, bucket=bucket, gpu_memory_bytes=50 * GIB, guidance=False)
    assert check_inference_fits(preset, bucket=bucket, gpu_memory_bytes=50 * GIB, guidance=False, context=2).fits
    with pytest.raises(UserError) as err:
        check_inference_fits(preset, bucket=bucket, gpu_memory_bytes=40 * GIB, cfg=2, context=2)
    message = str(err.value)
    assert "\n" not in message and "on each of 4 GPUs (one guidance branch a GPU; the sequence split over 2 GPUs: " \
        "context degree 2) needs 42.7 GiB on the GPU, over 36.0 GiB" in message, message
    assert message.endswith("--storage-dtype fp8 --offload none --gpus 4"), message  # the mode that fits, split
    with pytest.raises(ValueError, match="context .* must be >= 1"):
        plan_inference(preset, bucket=bucket, gpu_memory_bytes=50 * GIB, context=0)


def test_a_joint_attention_family_splits_its_text_tokens_too():
    """EasyAnimate's text goes through every block beside the video (`text_in_blocks`), and its context-parallel
    plan splits both: at degree 2 the step's token-wide terms halve; the prompt embeddings and latents stay whole."""
    from vidray.train.plan import local_tokens, sequence_lengths

    preset, bucket = get_preset("easyanimate-v5-7b"), Bucket(49, 576, 1008)
    n_video, _ = sequence_lengths(preset, bucket)
    assert local_tokens("easyanimate", n_video, 226, 2) == (n_video // 2, 113)
    assert local_tokens("wan", n_video, 512, 2) == (n_video // 2, 512)
    assert local_tokens("wan", 7, 512, 2) == (4, 512)  # rounded up: the most one rank holds
    whole, half = (plan_inference(preset, bucket=bucket, gpu_memory_bytes=80 * GIB, context=c).estimates[0]
                   for c in (1, 2))
    assert 0.49 * whole.denoise_bytes < half.denoise_bytes < 0.51 * whole.denoise_bytes


@pytest.mark.parametrize("denoiser, gpus, header", [
    ("{}", None, None), ("{gpus: 2}", None, None), ("{gpus: 2, cfg_parallel: false}", None, None),
    ("{gpus: 4}", None, "CFG parallel (batch 1 per GPU), the sequence split over 2 GPUs (context degree 2)"),
    ("{gpus: 4, cfg_parallel: false}", None, "CFG (batch 2), the sequence split over 4 GPUs (context degree 4)"),
    ("{}", "4", "CFG parallel (batch 1 per GPU), the sequence split over 2 GPUs (context degree 2)")])
def test_plan_inference_of_a_serve_config_splits_as_its_denoiser_replica_does(capsys, tmp_path, denoiser, gpus,
                                                                               header):
    """`vidray plan --inference serve_config.yaml` on 50 GiB GPUs plans each GPU of the config's Denoiser replica:
    Wan2.1-14B's 81x720x1280 with guidance does not fit bf16 without offload on 1 GPU, nor on 2 (one branch a GPU
    with CFG parallel; both branches over half the sequence without), and fits on 4 (2 branches x context degree 2;
    or, with `cfg_parallel: false`, both branches over a quarter of the sequence). `--gpus` overrides the config."""
    config = tmp_path / "serve_config.yaml"
    _serve_config(config, tmp_path, "{max_num_frames: 81, max_height: 720, max_width: 1280}",
                  memory="{storage_dtype: auto, offload: none}", denoiser=denoiser)
    code, out = _plan(capsys, "--inference", str(config), "--preset", "wan2.1-14b", "--gpu-memory", "50GiB",
                      "--host-memory", "256GiB", *(["--gpus", gpus] if gpus else []))
    assert code == (0 if header else 1), out
    if header:
        assert header in out.splitlines()[0], out
