"""Generation over several processes (issue 47, part 2; `vidray.inference.parallel`): CFG parallel on 2 gloo
processes against one process, on tiny random Wan and EasyAnimate models, through the sampler and through
`vidray generate --processes 2`; the one-line errors for what cannot run; the inference plan's per-GPU batch of 1
under CFG parallel; context parallel (Wan without guidance: the sequence split over 2 processes) against one process
through the CLI."""

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from vidray.buckets import Bucket  # noqa: E402
from vidray.cli import main  # noqa: E402
from vidray.compare import video_psnr  # noqa: E402
from vidray.config import FlowConfig, ModelConfig, job_config_from_dict  # noqa: E402
from vidray.data.video import decode_mp4  # noqa: E402
from vidray.errors import UserError  # noqa: E402
from vidray.generate import generate_to_file, load_model, write_job_file  # noqa: E402
from vidray.inference.parallel import generation_degrees, run_ranks  # noqa: E402
from vidray.inference.sampler import generate_video  # noqa: E402
from vidray.models import get_family  # noqa: E402
from vidray.models.presets import get_preset  # noqa: E402
from vidray.plan_inference import check_inference_fits, format_inference_report, plan_inference  # noqa: E402
from tests.conftest import free_port, join_gloo, start_ranks  # noqa: E402

pytestmark = pytest.mark.slow

FAMILIES = ("wan", "easyanimate")
BUCKET = Bucket(5, 32, 32)
PROMPT = "a red ball bouncing"
STEPS = 3
GUIDANCE = 4.0
SEED = 7
MAX_SEQUENCE_LENGTH = 16
GIB = 2**30


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """{family: a tiny random model exported as a run exports it (diffusers folder + vidray_job.yaml)}."""
    folders = {}
    for name in FAMILIES:
        family = get_family(name)
        model = {"family": name, "text_encoder": "tiny_random", "max_sequence_length": MAX_SEQUENCE_LENGTH}
        components = family.build(ModelConfig(**model), seed=0)
        folder = family.save_pipeline(components, tmp_path_factory.mktemp(name) / "diffusers", FlowConfig(shift=3.0))
        write_job_file(folder, job_config_from_dict({
            "name": f"tiny-{name}", "model": model,
            "data": {"buckets": [list(BUCKET)]}, "flow": {"shift": 3.0}}))
        folders[name] = folder
    return folders


def _generate(model_dir: Path, parallel=None) -> tuple[np.ndarray | None, torch.Tensor, list[int]]:
    """(frames (1, F, H, W, 3) uint8 or None off rank 0, the last step's latents, the batch size of every
    transformer call) of the test's prompt with guidance."""
    model = load_model(model_dir)
    batches, latents = [], []
    model.components.transformer.register_forward_pre_hook(lambda _m, args, kwargs: batches.append(
        int((args[0] if args else kwargs["hidden_states"]).shape[0])), with_kwargs=True)
    frames = generate_video(model.family, model.components, [PROMPT], BUCKET, flow=model.flow,
                            num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                            max_sequence_length=model.max_sequence_length, seed=SEED,
                            callback=lambda i, sigma, x: latents.append(x.clone()), parallel=parallel)
    return frames, latents[-1], batches


def _cfg_parallel_rank(rank: int, port: int, folders: dict[str, str], out: str) -> None:
    """A rank of the 2-process run: each family's video with CFG parallel; saves its latents and batch sizes, and
    rank 0 its frames."""
    from vidray.inference.parallel import setup_generation_parallel

    join_gloo(rank, 2, port)
    try:
        parallel = setup_generation_parallel(2, rank, guidance=True, device_type="cpu", family_name="wan")
        for name, folder in folders.items():
            frames, latents, batches = _generate(Path(folder), parallel)
            torch.save({"frames": frames, "latents": latents, "batches": batches, "cfg_rank": parallel.cfg_rank},
                       Path(out) / f"{name}.{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def two_process_runs(models, tmp_path_factory) -> dict[str, list[dict]]:
    """{family: [rank 0's, rank 1's] saved results} of one 2-process gloo run over both families."""
    out = tmp_path_factory.mktemp("ranks")
    start_ranks(_cfg_parallel_rank, (free_port(), {k: str(v) for k, v in models.items()}, str(out)), 2)
    return {name: [torch.load(out / f"{name}.{rank}.pt", weights_only=False) for rank in range(2)]
            for name in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_cfg_parallel_on_two_processes_gives_the_one_process_video_with_one_branch_per_rank(
        family, models, two_process_runs):
    torch.set_num_threads(1)
    frames, latents, batches = _generate(models[family])
    ranks = two_process_runs[family]
    assert batches == [2] * STEPS  # one process: [uncond, cond] in one call
    assert [r["batches"] for r in ranks] == [[1] * STEPS] * 2  # CFG parallel: one branch a rank
    assert [r["cfg_rank"] for r in ranks] == [0, 1]
    assert ranks[1]["frames"] is None  # only rank 0 decodes
    assert torch.equal(ranks[0]["latents"], ranks[1]["latents"])  # every rank steps the same latents
    torch.testing.assert_close(ranks[0]["latents"], latents, rtol=0, atol=1e-4)
    assert video_psnr(ranks[0]["frames"], frames) >= 40.0


def _video(path: Path) -> np.ndarray:
    return decode_mp4(path.read_bytes())


def test_cli_generate_on_two_processes_writes_the_one_process_video(models, tmp_path, capsys):
    torch.set_num_threads(1)
    args = ["--prompt", PROMPT, "--guidance-scale", str(GUIDANCE), "--num-inference-steps", str(STEPS),
            "--seed", str(SEED), "--crf", "0"]
    one = generate_to_file(models["wan"], PROMPT, tmp_path / "one.mp4", guidance_scale=GUIDANCE,
                           num_inference_steps=STEPS, seed=SEED, crf=0)
    assert main(["generate", "--model", str(models["wan"]), "--output", str(tmp_path / "two.mp4"), *args,
                 "--processes", "2"]) == 0
    assert f"wrote {tmp_path / 'two.mp4'}" in capsys.readouterr().out
    assert video_psnr(_video(tmp_path / "two.mp4"), _video(one)) >= 40.0


def test_cli_generate_without_guidance_splits_the_sequence_over_two_processes_and_writes_the_one_process_video(
        models, tmp_path):
    torch.set_num_threads(1)
    args = ["--prompt", PROMPT, "--guidance-scale", "1", "--num-inference-steps", str(STEPS), "--seed", str(SEED),
            "--crf", "0"]
    one = generate_to_file(models["wan"], PROMPT, tmp_path / "one.mp4", guidance_scale=1.0,
                           num_inference_steps=STEPS, seed=SEED, crf=0)
    assert main(["generate", "--model", str(models["wan"]), "--output", str(tmp_path / "two.mp4"), *args,
                 "--processes", "2"]) == 0
    assert generation_degrees(2, guidance=False) == (1, 2)  # what the CLI's ranks set up: no CFG, cp 2
    assert video_psnr(_video(tmp_path / "two.mp4"), _video(one)) >= 40.0


def _raise_in_rank_one(rank: int, device) -> None:
    if rank == 1:
        raise UserError("rank 1 refused its input")
    torch.distributed.barrier()  # rank 0 waits for rank 1, which never comes: stopped when rank 1 fails


def test_a_user_error_in_one_rank_stops_all_and_is_raised_as_one_user_error():
    with pytest.raises(UserError, match="^rank 1 refused its input$"):
        run_ranks(_raise_in_rank_one, (), 2, backend="gloo")


@pytest.mark.parametrize(("flags", "family", "message"), [
    (["--gpus", "2"], "wan", "--gpus 2: only 0 CUDA GPUs visible here"),
    (["--gpus", "2", "--processes", "2"], "wan", "--gpus 2 and --processes 2: give one"),
    (["--processes", "0"], "wan", "--processes must be an integer >= 1, got 0"),
])
def test_a_process_count_that_cannot_run_is_one_line_before_any_process_starts(flags, family, message, models,
                                                                               tmp_path, capsys):
    if flags[0] == "--gpus" and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has 2 GPUs")
    assert main(["generate", "--model", str(models[family]), "--prompt", PROMPT, "--output",
                 str(tmp_path / "out.mp4"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"vidray generate: error: {message}") and "\n" not in err, err
    assert not (tmp_path / "out.mp4").exists()


@pytest.mark.parametrize(("world_size", "guidance", "message"), [
    (3, True, "--gpus 3 is odd, so the two guidance branches cannot each get half of the ranks, and all 3 would split "
              "each video's sequence (context parallel), which the animatediff family does not support"),
    (4, True, "--gpus 4 with guidance puts the two guidance branches on 2 ranks each split over 2 (context parallel), "
              "which the animatediff family does not support"),
    (2, False, "--gpus 2 without guidance (--guidance-scale 1) splits each video's sequence over 2 ranks (context "
               "parallel), which the animatediff family does not support"),
])
def test_a_family_without_context_parallel_is_refused_what_would_split_its_sequence(world_size, guidance, message):
    from vidray.inference.parallel import generation_parallel_problem

    assert generation_parallel_problem(world_size, guidance=guidance, family_name="animatediff").startswith(message)
    assert generation_parallel_problem(2, guidance=True, family_name="animatediff") is None  # CFG parallel alone
    assert generation_parallel_problem(world_size, guidance=guidance, family_name="easyanimate") is None


def test_cfg_parallel_halves_the_denoising_batch_so_a_refused_generation_fits_on_two_gpus():
    preset, bucket = get_preset("wan2.1-14b"), Bucket(81, 720, 1280)
    with pytest.raises(UserError, match=r"vidray generate --gpus 2: [0-9.]+ GiB per GPU\)$"):
        check_inference_fits(preset, bucket=bucket, gpu_memory_bytes=56 * GIB)
    split = check_inference_fits(preset, bucket=bucket, gpu_memory_bytes=56 * GIB, cfg=2)
    whole = plan_inference(preset, bucket=bucket, gpu_memory_bytes=56 * GIB).estimates[0]
    assert (split.storage, split.offload) == (whole.storage, whole.offload) == ("bf16", "none")
    assert split.denoise_bytes < 0.51 * whole.denoise_bytes  # batch 1, not 2 (the latents stay whole)
    assert split.device_bytes < 0.9 * 56 * GIB < whole.device_bytes
    report = plan_inference(preset, bucket=bucket, gpu_memory_bytes=56 * GIB, cfg=2)
    assert "CFG parallel (batch 1 per GPU)" in format_inference_report(report).splitlines()[0]
