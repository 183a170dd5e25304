"""Validation samples (`vidray.train.validation`) in-process with a tiny model: a run folder's checkpoint sampled
into mp4s, a PNG grid and TensorBoard (read back with TensorBoard's own reader), the EMA sampled when the run keeps
one, the same seed giving the same videos, and bad settings refused in one line."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import torch

from vidray.config import ConfigError, ModelConfig, job_config_from_dict, load_job_config
from vidray.data.video import decode_mp4
from vidray.errors import UserError
from vidray.models import get_family
from vidray.train.checkpoint import TrainState, save_checkpoint
from vidray.train.validation import TENSORBOARD_SUBDIR, Validator, check_validation_prompts, frame_grid

JOB = {
    "name": "val", "model": {"text_encoder": "tiny_random", "max_sequence_length": 16},
    "data": {"buckets": [[5, 32, 32], [1, 32, 32]], "fps": 8.0},
    "checkpoint": {"every_steps": 2},
    "train": {"validation": {"every_steps": 2, "prompts": ["a red kite", "a blue boat"], "num_inference_steps": 2}},
}


def _checkpoint(run_dir, step: int, job: dict, *, ema: bool = False):
    """A complete checkpoint of the tiny model (weights moved off their init) at `step` in `run_dir`."""
    cfg = job_config_from_dict(job)
    transformer = get_family("easyanimate").load_diffusion_models(ModelConfig(**job["model"]), seed=0).transformer
    with torch.no_grad():
        for param in transformer.parameters():
            param.add_(0.1 * step)
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=1e-4)
    averaged = None
    if ema:
        from vidray.config import EMAConfig
        from vidray.train.ema import EMA

        averaged = EMA(transformer, EMAConfig(decay=0.5))
        averaged.maybe_update(1)
        with torch.no_grad():
            for param in averaged.averaged.module.params.values():
                param.mul_(0.5)  # an average unlike the weights
    return save_checkpoint(run_dir / f"checkpoint_{step:06d}", model=transformer, optimizer=optimizer,
                           lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
                           train_state=TrainState(step=step, epoch=0, batch_index=step, world_size=1,
                                                  index_hash="x"),
                           job_config=cfg.to_dict(), ema=None if averaged is None else averaged.averaged)


def test_a_checkpoint_is_sampled_into_mp4s_a_grid_and_tensorboard_videos(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    _checkpoint(run, 2, JOB)
    result = Validator(str(run), job_config_from_dict(JOB).to_dict()).validate(2)
    out = run / "validation" / "step_000002"
    assert result["step"] == 2 and result["dir"] == str(out) and result["seconds"] > 0
    videos = [decode_mp4((out / f"{i}.mp4").read_bytes()) for i in range(2)]
    assert all(v.shape == (5, 32, 32, 3) for v in videos)  # the first multi-frame bucket
    assert (out / "grid.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    meta = json.loads((out / "prompts.json").read_text())
    assert meta["prompts"] == ["a red kite", "a blue boat"] and meta["bucket"] == "5x32x32"
    acc = EventAccumulator(str(run / TENSORBOARD_SUBDIR), size_guidance={"images": 0})
    acc.Reload()
    assert set(acc.Tags()["images"]) == {"validation/0", "validation/1", "validation/grid"}
    gif = acc.Images("validation/0")[0]
    assert gif.step == 2 and gif.encoded_image_string[:6] == b"GIF89a"  # the video, played by TensorBoard

    # The next validation samples the same prompts with the same seed: a checkpoint of the same weights gives the
    # same videos. Compared on the lossless grid, within 2/255 and a few pixels: MKL's float sums may differ in the last bits between
    # two calls (alignment), which moves a few pixels by 1 and, through x264's mode decisions, mp4 pixels by up to 11
    # (seen on CI). Other weights give other videos, so the comparison can fail.
    again, moved = tmp_path / "again", tmp_path / "moved"
    for folder, step in ((again, 2), (moved, 12)):
        _checkpoint(folder, step, JOB)
        Validator(str(folder), job_config_from_dict(JOB).to_dict()).validate(step)
    first, same, other = (_png(folder / f"validation/step_{step:06d}/grid.png")
                          for folder, step in ((run, 2), (again, 2), (moved, 12)))
    assert np.abs(same - first).max() <= 2 and np.abs(same - first).mean() <= 0.05  # here: 0 and 0
    assert np.abs(other - first).mean() > 0.5  # here: 1.3 (the tiny random VAE maps most latents alike)


def _png(path) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(path).convert("RGB")).astype(np.int16)


def test_the_ema_is_sampled_when_the_run_keeps_one(tmp_path):
    job = {**JOB, "train": {**JOB["train"], "ema": {"decay": 0.5}}}
    plain, averaged = tmp_path / "plain", tmp_path / "ema"
    _checkpoint(plain, 2, JOB)
    _checkpoint(averaged, 2, job, ema=True)
    Validator(str(plain), job_config_from_dict(JOB).to_dict()).validate(2)
    Validator(str(averaged), job_config_from_dict(job).to_dict()).validate(2)
    a = decode_mp4((plain / "validation/step_000002/0.mp4").read_bytes())
    b = decode_mp4((averaged / "validation/step_000002/0.mp4").read_bytes())
    assert not np.array_equal(a, b)  # the halved averages, not the trained weights


def test_a_sharded_checkpoint_and_its_ema_are_sampled_as_the_full_one(tmp_path):
    """scaling.strategy: fsdp: the validator reads the DCP folder in one process (every rank's shards, the EMA's
    too), so a sharded checkpoint of the same weights and EMA gives the full checkpoint's videos."""
    from vidray.config import EMAConfig
    from vidray.train.checkpoint import save_sharded_checkpoint
    from vidray.train.ema import EMA

    job = {**JOB, "train": {**JOB["train"], "ema": {"decay": 0.5}}, "scaling": {"strategy": "fsdp"}}
    full, sharded = tmp_path / "full", tmp_path / "sharded"
    _checkpoint(full, 2, job, ema=True)
    transformer = get_family("easyanimate").load_diffusion_models(ModelConfig(**job["model"]), seed=0).transformer
    with torch.no_grad():
        for param in transformer.parameters():
            param.add_(0.2)  # as _checkpoint moves them at step 2
    averaged = EMA(transformer, EMAConfig(decay=0.5))
    averaged.maybe_update(1)
    with torch.no_grad():
        for param in averaged.averaged.module.params.values():
            param.mul_(0.5)
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=1e-4)
    save_sharded_checkpoint(sharded / "checkpoint_000002", model=transformer, optimizer=optimizer,
                            lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
                            train_state=TrainState(step=2, epoch=0, batch_index=2, world_size=1, index_hash="x"),
                            job_config=job_config_from_dict(job).to_dict(), rank=0, world_size=1,
                            ema=averaged.averaged)
    for run in (full, sharded):
        Validator(str(run), job_config_from_dict(job).to_dict()).validate(2)
    a, b = (_png(run / "validation/step_000002/grid.png") for run in (full, sharded))
    assert np.abs(a - b).max() <= 2
    # what it sampled: the sharded checkpoint's EMA (the halved averages), not its trained weights
    from vidray.train.ema import load_ema_into

    fresh = get_family("easyanimate").load_diffusion_models(ModelConfig(**job["model"]), seed=0).transformer
    assert load_ema_into(fresh, sharded / "checkpoint_000002")
    averages = averaged.averages()
    for name, param in fresh.named_parameters():
        if name in averages:
            assert torch.equal(param, averages[name]), name


def test_a_validation_waits_for_its_checkpoint_to_be_complete(tmp_path):
    run = tmp_path / "run"
    validator = Validator(str(run), job_config_from_dict(JOB).to_dict())
    done: dict = {}
    thread = threading.Thread(target=lambda: done.update(validator.validate(4)))
    thread.start()
    time.sleep(1.5)
    assert not done  # no checkpoint_000004 yet: still waiting
    _checkpoint(run, 4, JOB)
    thread.join(timeout=120)
    assert done["step"] == 4 and (run / "validation/step_000004/grid.png").is_file()


def test_frame_grid_puts_one_video_per_row_and_pads_short_ones():
    a = np.full((3, 2, 2, 3), 7, np.uint8)
    b = np.full((1, 2, 2, 3), 9, np.uint8)
    grid = frame_grid([a, b])
    assert grid.shape == (4, 6, 3)
    assert (grid[:2] == 7).all() and (grid[2:, :2] == 9).all() and (grid[2:, 2:] == 0).all()


@pytest.mark.parametrize("overrides, message", [
    (["train.validation.every_steps=30"], "must be a multiple of checkpoint.every_steps=50"),
    (["train.validation.every_steps=50"], "train.validation.prompts must list the fixed prompts"),
    (["train.validation.every_steps=50", "train.validation.prompts=[\"\"]"], "none empty"),
    (["train.validation.every_steps=50", "train.validation.prompts=[\"x\"]", "train.validation.num_inference_steps=0"],
     "num_inference_steps must be >= 1"),
    (["train.validation.every_steps=50", "train.validation.prompts=[\"x\"]", "train.validation.bucket=9x64"],
     "bucket must look like"),
    (["train.validation.every_steps=50", "train.validation.prompts=[\"x\"]", "train.validation.images=[\"a.png\"]"],
     "train.validation.images are first frames for an image-to-video model: set model.i2v"),
    (["train.validation.every_steps=50", "train.validation.prompts=[\"x\"]", "model.i2v.condition=first",
      "train.validation.images=[\"a.png\", \"b.png\"]"], "one image per prompt: 2 images for 1 prompts"),
])
def test_bad_validation_settings_are_refused_at_load_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_job_config(None, overrides)
    assert "\n" not in str(err.value)


def test_a_prompt_longer_than_the_text_encoder_takes_is_refused_before_the_run():
    job = load_job_config(None, ["model.text_encoder=tiny_random", "model.max_sequence_length=16",
                                 "train.validation.every_steps=50",
                                 "train.validation.prompts=[\"a kite\", \"" + "very " * 40 + "long\"]"])
    with pytest.raises(UserError, match=r"train.validation.prompts\[1\] .* tokens, longer than "
                                        r"model.max_sequence_length=16"):
        check_validation_prompts(job)
    check_validation_prompts(load_job_config(None, ["train.validation.every_steps=50",
                                                    "train.validation.prompts=[\"a kite\"]"]))


def test_an_image_to_video_run_is_validated_from_its_fixed_first_frames(tmp_path, monkeypatch):
    """`train.validation.images` (model.i2v): each prompt's sample is conditioned on its image, as `vidray generate
    --image` samples it; an image that is not one is refused before the run."""
    from PIL import Image

    import vidray.inference.sampler as sampler
    from vidray.inference.sampler import generate_video
    from vidray.models.export import load_model

    given = []  # the first frame of each sample, recorded on its way to the real generate_video

    def recording(*args, **kwargs):
        given.append(None if kwargs.get("image") is None else np.asarray(kwargs["image"]))
        return generate_video(*args, **kwargs)

    monkeypatch.setattr(sampler, "generate_video", recording)

    images = []
    for i in range(2):
        images.append(tmp_path / f"first{i}.png")
        Image.fromarray(np.random.RandomState(i).randint(0, 256, (40, 48, 3), dtype=np.uint8)).save(images[-1])
    model = {**JOB["model"], "i2v": {"condition": "first"}}
    job = {**JOB, "model": model, "train": {"validation": {**JOB["train"]["validation"],
                                                           "images": [str(p) for p in images]}}}
    text_only = {**JOB, "model": model}
    run, plain = tmp_path / "run", tmp_path / "plain"
    checkpoint = _checkpoint(run, 2, job)
    _checkpoint(plain, 2, text_only)
    Validator(str(run), job_config_from_dict(job).to_dict()).validate(2)
    Validator(str(plain), job_config_from_dict(text_only).to_dict()).validate(2)
    out = run / "validation/step_000002"
    assert json.loads((out / "prompts.json").read_text())["images"] == [str(p) for p in images]
    loaded = load_model(checkpoint)
    expected = generate_video(loaded.family, loaded.components, ["a red kite"], (5, 32, 32), flow=loaded.flow,
                              num_inference_steps=2, max_sequence_length=16, seed=0,
                              image=Image.open(images[0]).convert("RGB"))[0]
    grid, text_grid = _png(out / "grid.png"), _png(plain / "validation/step_000002/grid.png")
    assert np.abs(grid[:32, :32 * 5] - expected.transpose(1, 0, 2, 3).reshape(32, -1, 3)).max() <= 2
    assert grid.shape == text_grid.shape
    # each prompt's sample got its own image; the text-only run's got none (the tiny random VAE decodes the two
    # alike, so the pixels cannot tell them apart)
    assert len(given) == 4 and given[2] is None and given[3] is None
    for i in range(2):
        np.testing.assert_array_equal(given[i], np.asarray(Image.open(images[i]).convert("RGB")))

    bad = tmp_path / "not_an_image.png"
    bad.write_bytes(b"nope")
    with pytest.raises(UserError, match=r"train.validation.images\[1\]: .* not an image PIL can read"):
        check_validation_prompts(job_config_from_dict({**job, "train": {"validation": {
            **job["train"]["validation"], "images": [str(images[0]), str(bad)]}}}))
