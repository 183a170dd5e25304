"""`vidray train-vae`'s parts in-process with the tiny VAE and real clips (`vidray.train.vae`, `vidray.compare`,
`model.vae_path`): the VAE job a config becomes, what it refuses in one line, the loss and its per-sample noise, a
few steps that lower it, the saved folder a DiT job loads, PSNR and the side-by-side pictures."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from vidray.config import ConfigError, ModelConfig, VAETrainingConfig, load_job_config
from vidray.buckets import Bucket
from vidray.data.video import decode_mp4, probe_media, read_clip
from vidray.models import get_family
from vidray.models.easyanimate import load_vae_folder
from vidray.train.trainer import with_absolute_model_paths
from vidray.train.vae import (
    VAEObjective,
    check_vae_path,
    reconstruction_psnr,
    save_vae,
    unused_parameter_names,
    vae_export_path,
    vae_micro_loss,
    vae_training_job,
)

REPO = Path(__file__).resolve().parents[2]
TINY = ModelConfig(text_encoder="tiny_random")


def _clip(samples_dir: Path, name: str = "finetrainers_hiker_tiny_368x240.mp4") -> np.ndarray:
    """A shipped clip as `vidray prepare` fits it: uint8 (9, 64, 64, 3) at 8 fps."""
    path = samples_dir / name
    return read_clip(path, probe_media(path), Bucket(9, 64, 64), 8.0)


def test_a_job_becomes_its_vae_run_with_the_vae_training_settings(tmp_path):
    job = load_job_config(REPO / "jobs/configs/tiny_t2v.yaml", [
        f"storage.path={tmp_path}", "vae_training.max_steps=7", "vae_training.lr=3e-3",
        "vae_training.batch_size_per_worker=1", "model.vae_path=/elsewhere", "train.validation.every_steps=50",
        "train.validation.prompts=[a kite]", "train.ema={decay: 0.9}"])
    vae_job = vae_training_job(job)
    assert vae_job.name == "tiny-t2v-vae" and vae_job.train.objective == "vae"
    assert (vae_job.train.max_steps, vae_job.optim.lr, vae_job.data.batch_size_per_worker) == (7, 3e-3, 1)
    assert vae_job.data.latent_cache == "off" and vae_job.model.vae_path is None  # frames, and the init's VAE
    assert vae_job.train.validation.every_steps is None and vae_job.train.ema is None
    assert vae_training_job(vae_job) is vae_job  # a resubmitted VAE job stays itself
    assert vae_export_path(job) == vae_export_path(vae_job) == f"{tmp_path}/tiny-t2v-vae/vae"


@pytest.mark.parametrize("override, message", [
    ("model.lora={rank: 4}", "model.lora is set"),
    ("scaling.strategy=fsdp", "scaling.strategy is fsdp"),
    ("export.weights=ema", "export.weights is ema"),
])
def test_what_a_vae_run_cannot_do_is_refused_in_one_line(override, message):
    extra = ["train.ema={decay: 0.9}"] if "ema" in override else []
    job = load_job_config(REPO / "jobs/configs/tiny_t2v.yaml", [override, *extra])
    with pytest.raises(ConfigError, match=message) as err:
        vae_training_job(job)
    assert "\n" not in str(err.value) and str(err.value).startswith("train-vae: ")


@pytest.mark.parametrize("override, message", [
    ("vae_training.lr=0", "vae_training: lr must be > 0"),
    ("vae_training.l1_weight=0", r"l1_weight \+ mse_weight > 0"),
    ("vae_training.kl_weight=-1", "loss weights >= 0"),
    ("vae_training.max_steps=0", "vae_training.max_steps must be >= 1"),
])
def test_bad_vae_training_settings_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_job_config(None, [override])  # the defaults: mse_weight 0


@pytest.mark.slow
def test_the_cli_refuses_a_lora_vae_run_before_ray_starts():
    out = subprocess.run([sys.executable, "-m", "vidray.cli", "train-vae", str(REPO / "jobs/configs/tiny_t2v.yaml"),
                          "model.lora={rank: 4}"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == ["vidray train-vae: error: train-vae: model.lora is set (LoRA adapts "
                                               "the DiT): remove it for train-vae"]


def test_the_trainable_vae_is_the_presets_with_gradients_and_ignores_vae_path(tmp_path):
    family = get_family("easyanimate")
    frozen = family.build(TINY, seed=3).vae
    trainable = family.load_latent_models(ModelConfig(text_encoder="tiny_random", vae_path=str(tmp_path)), seed=3,
                                          trainable=True).vae
    assert trainable.training and all(p.requires_grad for p in trainable.parameters())
    assert all(torch.equal(a, b) for a, b in zip(frozen.state_dict().values(), trainable.state_dict().values(),
                                                 strict=True))


def test_the_loss_is_per_sample_with_its_own_noise_and_a_few_steps_lower_it(samples_dir):
    torch.manual_seed(0)
    clip = torch.from_numpy(_clip(samples_dir)[:5, :32, :32]).permute(3, 0, 1, 2)[None]  # uint8 (1, 3, 5, 32, 32)
    objective = VAEObjective(get_family("easyanimate").load_latent_models(TINY, seed=0, trainable=True).vae,
                             VAETrainingConfig(l1_weight=1.0, mse_weight=0.5, kl_weight=1e-6))
    assert unused_parameter_names(objective) == [] and all(p.grad is None for p in objective.parameters())
    gen = lambda s: torch.Generator().manual_seed(s)  # noqa: E731
    batch = torch.cat([clip, clip.flip(-1)])
    with torch.no_grad():
        pair = objective(batch.float() / 127.5 - 1, [gen(1), gen(2)])
        alone = objective(clip.float() / 127.5 - 1, [gen(1)])
        other_noise = objective(clip.float() / 127.5 - 1, [gen(9)])
    assert pair.shape == (2,) and torch.allclose(pair[0], alone[0], atol=1e-6)  # independent of its batch-mates
    assert not torch.equal(alone, other_noise)  # the posterior sample follows the generator
    optimizer = torch.optim.AdamW(objective.parameters(), lr=2e-3)
    losses = []
    for step in range(10):
        optimizer.zero_grad()
        loss = vae_micro_loss(objective, clip, [gen(step)], torch.ones(1))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3]), losses


def test_a_saved_vae_is_what_model_vae_path_loads_everywhere(samples_dir, tmp_path):
    family = get_family("easyanimate")
    vae = family.load_latent_models(TINY, seed=5, trainable=True).vae
    with torch.no_grad():
        for p in vae.parameters():
            p.mul_(0.9)  # weights unlike any preset's
    save_vae(vae.eval(), str(tmp_path / "vae"))
    cfg = ModelConfig(text_encoder="tiny_random", vae_path=str(tmp_path / "vae"))
    expected = vae.state_dict()
    for loaded in (load_vae_folder(tmp_path / "vae"), family.build(cfg, seed=0).vae,
                   family.load_latent_models(cfg, seed=0).vae,
                   family.build_encoders(cfg, seed=0).vae):
        assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
        assert all(torch.equal(expected[k], v) for k, v in loaded.state_dict().items())
    clip = _clip(samples_dir)
    assert reconstruction_psnr(load_vae_folder(tmp_path / "vae"), [clip]) == pytest.approx(
        reconstruction_psnr(vae, [clip]), abs=1e-6)


def test_reconstruction_psnr_is_the_mse_of_the_decoded_mode_on_the_unit_scale(samples_dir):
    vae = get_family("easyanimate").build(TINY, seed=0).vae
    clip = _clip(samples_dir)[:5, :32, :32]
    from vidray.models.vae import decode_latents, encode_video, frames_to_video

    with torch.no_grad():
        video = frames_to_video(clip[None])
        mse = ((decode_latents(vae, encode_video(vae, video)) - video) / 2).pow(2).mean().item()
    assert reconstruction_psnr(vae, [clip]) == pytest.approx(10 * np.log10(1 / mse), abs=1e-4)
    with pytest.raises(ValueError, match="no videos"):
        reconstruction_psnr(vae, [])


def test_a_vae_path_that_is_no_vae_folder_is_refused_in_one_line(tmp_path):
    job = load_job_config(REPO / "jobs/configs/tiny_t2v.yaml", [f"model.vae_path={tmp_path}",
                                                                  f"storage.path={tmp_path}"])
    with pytest.raises(ConfigError, match=r"is not a diffusers VAE folder \(no config.json\): train one with "
                                          r"`vidray train-vae CONFIG` \(it writes .*/tiny-t2v-vae/vae\)"):
        check_vae_path(job)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_vae_folder(tmp_path)


def test_relative_model_paths_are_made_absolute_on_the_driver(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = load_job_config(None, ["model.vae_path=runs/x-vae/vae", "model.init=pretrained",
                                 "model.pretrained_path=weights/pipe"])
    absolute = with_absolute_model_paths(job)
    assert absolute.model.vae_path == str(tmp_path / "runs/x-vae/vae")
    assert absolute.model.pretrained_path == str(tmp_path / "weights/pipe")
    plain = load_job_config(None, [])
    assert with_absolute_model_paths(plain) is plain


def test_psnr_and_the_side_by_side_pictures(tmp_path):
    from PIL import Image

    from vidray.compare import video_psnr, write_side_by_side

    a = np.full((5, 32, 32, 3), 100, np.uint8)
    b = a.copy()
    b[0, 0, 0, 0] = 110  # one value off by 10: MSE 100 / (5 * 32 * 32 * 3)
    assert video_psnr(a, a) == float("inf")
    assert video_psnr(b, a) == pytest.approx(10 * np.log10(255 ** 2 / (100 / a.size)))
    with pytest.raises(ValueError, match="shapes differ"):
        video_psnr(a[:1], a)
    still = np.full((1, 32, 32, 3), 200, np.uint8)
    png, mp4 = write_side_by_side({"clip": a, "other": b, "still": still}, tmp_path, fps=8.0)
    grid = np.asarray(Image.open(png))
    assert grid.shape == (3 * 32, 5 * 32, 3)  # a row per video, a column per frame
    assert (grid[64:, 32:] == 0).all() and (grid[64:, :32] == 200).all()  # the still, then black
    video = decode_mp4(mp4.read_bytes())
    assert video.shape == (5, 32, 96, 3)  # the three next to each other
    assert abs(int(video[0, 16, 80, 0]) - 200) <= 3 and int(video[3, 16, 80, 0]) <= 3


def test_a_family_whose_vae_cannot_train_here_is_refused_naming_both_ways_on(tmp_path):
    job = load_job_config(REPO / "jobs/configs/wan_t2v_tiny.yaml")
    with pytest.raises(ConfigError) as err:
        vae_training_job(job)
    message = str(err.value)
    assert message.startswith("train-vae: the wan family's VAE cannot be trained here yet") and "\n" not in message
    assert "model.vae_path" in message and "easyanimate" in message


def test_a_vae_runs_step_line_metrics_and_tensorboard_tags_say_vae_not_dit(tmp_path):
    from vidray.metrics import TrainMetrics
    from vidray.train.runlog import RunLog, read_scalars
    from vidray.train.window import LogWindow, compute_stage, step_line

    vae_job = vae_training_job(load_job_config(REPO / "jobs/configs/tiny_t2v.yaml", [f"storage.path={tmp_path}"]))
    stage = compute_stage(vae_job.train.objective)
    assert stage == "vae" and compute_stage(load_job_config(None).train.objective) == "dit"

    # The metrics the loop feeds (`_count_step`, `_add_loader_stats`): the trainer's step counts as the vae stage.
    metrics = TrainMetrics(rank=0, run=vae_job.name)
    window = LogWindow(1, compute=stage)
    for step in (1, 2):
        metrics.observe_step(data_wait_s=0.01, step_s=0.21, samples=2)
        metrics.add_stage(stage, busy_s=0.2, clips=2)
        metrics.add_stage("decode", busy_s=0.05, clips=2)
        window.add(torch.tensor(0.5), torch.tensor(1.0), 1e-3, [step, 0.01, 0.0, 0.2])
    data = metrics.window_summary()
    assert data["vae_busy_s"] == pytest.approx(0.4) and data["dit_busy_s"] == 0.0
    labels = {"rank": "0", "run": vae_job.name}
    busy = {s: metrics.registry.get_sample_value("vidray_stage_busy_seconds_total", {**labels, "stage": s})
            for s in ("vae", "dit")}
    assert busy == {"vae": pytest.approx(0.4), "dit": 0.0}  # the Prometheus series' stage label
    closed = window.close(2, epoch=0, lr_now=1e-3, step_time_s=0.21, data=data)
    assert "vae_step_time_s" in closed.metrics and "vae_busy_fraction" in closed.metrics
    assert not any(key.startswith("dit") for key in closed.metrics), closed.metrics

    line = step_line(closed, max_steps=2, data=data, prefetch_lead=0)
    assert "(encode 0.000 s, vae 0.200 s)" in line and "busy [decode " in line and " vae " in line
    assert "dit" not in line, line

    run_log = RunLog(str(tmp_path / "run"), start_step=1)
    run_log.log_window(closed.first_step, closed.losses, closed.grad_norms, closed.lrs, closed.metrics,
                       samples_per_step=2)
    run_log.close()
    tags = set(read_scalars(tmp_path / "run"))
    assert {"train/vae_step_time_s", "stages/vae_busy_fraction", "stages/decode_busy_fraction"} <= tags
    assert not [tag for tag in tags if "dit" in tag], tags
