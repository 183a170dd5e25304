"""`make demo`'s job (`jobs/demo.py`) end to end, shortened to a few steps: prepare, `train-vae`, the DiT on that
VAE's latents, the generated videos against the caption's training clip, the side-by-side pictures, and a console
without Ray's or the libraries' noise. (What the full-length demo reaches, PSNR against the goals, is measured by
`benchmarks/demo_learns.py`.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from tests.conftest import noise_in

REPO = Path(__file__).resolve().parents[2]


def test_the_demo_trains_the_vae_then_the_dit_on_its_latents_and_shows_the_clip_beside_its_generation(tmp_path):
    from PIL import Image

    from vidray.models.easyanimate import load_vae_folder
    from vidray.models.export import load_model

    env = dict(os.environ, RAY_TMPDIR=tempfile.mkdtemp(prefix="/tmp/vrd"), PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run(
        [sys.executable, str(REPO / "jobs/demo.py"), "--config", str(REPO / "jobs/configs/tiny_t2v.yaml"),
         f"data.source={REPO / 'samples/metadata.json'}", f"data.shards_dir={tmp_path / 'shards'}",
         f"storage.path={tmp_path / 'runs'}", "model.text_encoder=tiny_random", "vae_training.max_steps=2",
         "train.max_steps=2", "checkpoint.every_steps=2", "train.log_every_steps=1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert not noise_in(text), noise_in(text)
    assert "(RayTrainWorker pid=" in text and "\x1b[" not in text  # not a terminal: Ray's prefixes uncoloured
    steps = [line for line in text.splitlines() if line.startswith("== ")]
    assert [s.split()[1] for s in steps] == ["1.", "2.", "3.", "4.", "summary"], steps
    # The VAE run (step 2) prints no caption check (its captions reach no model) and names its step "vae".
    vae_part = text[text.index(steps[1]):text.index(steps[2])]
    assert "captions:" not in vae_part and re.search(r"step 1/2 .*\(encode [\d.]+ s, vae [\d.]+ s\)", vae_part), vae_part
    assert re.search(r"step 1/2 .*\(encode [\d.]+ s, dit [\d.]+ s\)", text[text.index(steps[2]):]), text[-3000:]
    summary = text[text.index("== summary"):]
    psnr = re.search(r"VAE reconstruction PSNR on 6 training clips: ([\d.]+) dB", summary)
    compared = re.search(r"PSNR against the training clip of 'A hiker standing .*': trained DiT ([\d.]+) dB, "
                         r"random-init DiT ([\d.]+) dB \(([-+][\d.]+) dB\); the VAE's reconstruction ([\d.]+) dB",
                         summary)
    assert psnr and compared, summary
    assert 3.0 < float(psnr.group(1)) < 60.0
    trained, baseline, margin = (float(compared.group(i)) for i in (1, 2, 3))
    assert abs((trained - baseline) - margin) < 0.11

    # The DiT trained on, and exported, the VAE that train-vae wrote.
    vae = load_vae_folder(tmp_path / "runs/tiny-t2v-vae/vae")
    exported = load_model(tmp_path / "runs/tiny-t2v/diffusers").components.vae
    assert all(torch.equal(a, b) for a, b in zip(vae.state_dict().values(), exported.state_dict().values(),
                                                 strict=True))
    samples = tmp_path / "runs/tiny-t2v/samples"
    grid = np.asarray(Image.open(samples / "side_by_side.png"))
    assert grid.shape == (4 * 64, 9 * 64, 3)  # clip, reconstruction, trained and random-init DiT; 9 frames each
    assert (samples / "side_by_side.mp4").stat().st_size > 0 and (samples / "generated.mp4").stat().st_size > 0
    assert "training clip, VAE reconstruction, generated (trained DiT), generated (random-init DiT)" in summary
