"""The encode stages with the latent cache, on a real local Ray: training from cached latents gives the losses of
online encoding, `vidray prepare --encode` fills the cache ahead, and later runs encode nothing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from vidray.config import load_job_config

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def load_sample_captions(shards_dir) -> list[str]:
    import pyarrow.parquet as pq

    return [c for f in sorted(Path(shards_dir).rglob("shard.*.parquet"))
            for c in pq.read_table(f, columns=["caption"]).column("caption").to_pylist()]


def job(shards_dir, tmp_path, name: str, cache: str):
    return load_job_config(REPO / "jobs/configs/tiny_t2v.yaml", [
        f"data.shards_dir={shards_dir}", f"storage.path={tmp_path / 'runs'}", f"name={name}",
        "model.text_encoder=tiny_random", "train.max_steps=3", "train.log_every_steps=1",
        "checkpoint.every_steps=3", f"data.latent_cache={cache}", "data.hot_bytes=0"])


def test_prepare_encode_fills_the_cache_from_the_command_line(tmp_path):
    """The CLI path on its own local Ray (started and stopped by the command), into its own shards folder. First
    in the module: no other local Ray of this module runs yet."""
    from tests.integration.conftest import ray_env

    cache = tmp_path / "cli-cache"
    out = subprocess.run(
        [sys.executable, "-m", "vidray.cli", "prepare", "--encode", str(REPO / "jobs/configs/tiny_t2v.yaml"),
         f"data.shards_dir={tmp_path / 'shards'}", "model.text_encoder=tiny_random", f"data.latent_cache={cache}"],
        cwd=REPO, env=ray_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    # The counts are per batch slot; slots beyond the 6 clips repeat one to fill a batch, and the line says so (a
    # new user's trial read "11 clips, latents 10 encoded / 2 cached" as a miscount).
    line = next(x for x in out.stdout.splitlines() if x.startswith(f"latent cache {cache}: 6 clips"))
    slots = re.search(r"latents (\d+) encoded / (\d+) cached", line)
    assert slots and int(slots[1]) == 6, line
    if int(slots[1]) + int(slots[2]) > 6:
        assert f"6 clips in {int(slots[1]) + int(slots[2])} batch slots (repeats that fill" in line, line
    assert len(list((cache / "vae").rglob("*.safetensors"))) == 6  # the 6 shipped samples, once each


def test_cached_latents_train_the_losses_of_online_encoding(local_ray, shards_dir, tmp_path):
    from vidray.data.fill_cache import encode_to_cache
    from vidray.train.trainer import run_training

    # 1. Online, no cache: every micro-batch is encoded by the stage as it arrives.
    online = run_training(job(shards_dir, tmp_path, "online", "off"))
    assert online.data["latent_misses"] > 0  # (hits: repeats within a padded batch, encoded once)

    # 2. Fill a cache ahead (what `vidray prepare --encode` runs): every clip once.
    cache = tmp_path / "latents"
    filled = encode_to_cache(job(shards_dir, tmp_path, "fill", str(cache)))
    # 6 samples, once each (a batch padded with a repeat of one of its clips encodes it once: a hit)
    assert filled["clips"] == 6 and filled["latent_misses"] == 6 and not filled["skipped"]
    assert filled["prompt_misses"] == len(set(load_sample_captions(shards_dir)))
    assert len(list((cache / "vae").rglob("*.safetensors"))) == 6
    again = encode_to_cache(job(shards_dir, tmp_path, "fill", str(cache)))
    assert again["latent_misses"] == 0 and again["prompt_misses"] == 0
    assert again["latent_hits"] == filled["latent_hits"] + filled["latent_misses"]

    # 3. From the cache: nothing encoded, the same losses to the bit.
    cached = run_training(job(shards_dir, tmp_path, "cached", str(cache)))
    assert cached.data["latent_misses"] == 0 and cached.data["latent_hits"] > 0
    assert cached.data["prompt_misses"] == 0
    assert cached.losses == online.losses
    assert cached.data["vae_busy_s"] < online.data["vae_busy_s"]
    # No clip decoded: the driver's task named the VAE while the workers started, and every clip's latents were
    # cached, so the loaders read them instead (`vidray.data.pipeline`, the latents tier).
    assert online.data["decode_clips"] > 0 and cached.data["decode_clips"] == 0
    assert cached.data["dit_clips"] == online.data["dit_clips"] > 0  # batch slots trained (was always 0)
