"""2-worker Ray Train runs on the shipped clips: completion with a checkpoint, and resume at the next step."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from vidray.config import load_job_config
from vidray.data.ingest import prepare
from vidray.train.checkpoint import read_train_state
from vidray.train.trainer import run_training

from tests.integration.conftest import assert_same_training_state, uninterrupted_run

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def tiny_job(shards_dir, storage, **steps):
    overrides = [
        f"data.shards_dir={shards_dir}",
        f"storage.path={storage}",
        "name=test-run",
        "model.text_encoder=tiny_random",
        "train.log_every_steps=2",
        "checkpoint.every_steps=3",
        "checkpoint.num_to_keep=2",
    ] + [f"{k.replace('__', '.')}={v}" for k, v in steps.items()]
    return load_job_config(REPO / "jobs/configs/tiny_t2v.yaml", overrides)


def test_two_workers_train_checkpoint_and_resume_at_next_step_with_the_uninterrupted_losses(local_ray, shards_dir,
                                                                                               tmp_path):
    """6 steps, then the same run name resumed to step 9: the resumed steps continue at 7 and both runs' losses
    are those of one uninterrupted run (exact resume)."""
    # 1. A first run of 6 steps: checkpoints at 3 and 6, diffusers weights at the end; its workers serve
    # Prometheus metrics on 127.0.0.1 while it runs (scraped here) and leave them in <run_dir>/metrics.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    scraped: list[str] = []
    done = threading.Event()

    def scrape():
        while not done.is_set() and not scraped:
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1).read().decode()
            except OSError:
                time.sleep(0.2)
                continue
            if "vidray_train_step" in text:
                scraped.append(text)

    scraper = threading.Thread(target=scrape, daemon=True)
    scraper.start()
    try:
        first = run_training(tiny_job(shards_dir, tmp_path, train__max_steps=6, train__metrics_port=port,
                                      train__validation__every_steps=3,
                                      train__validation__prompts='["a sailboat on a painted sea"]',
                                      train__validation__num_inference_steps=2))
    finally:
        done.set()
        scraper.join(timeout=5)
    assert scraped, "no worker answered on the metrics port during the run"
    assert [int(s) for s, _ in first.losses] == list(range(1, 7))
    families = {f.name: f for f in text_string_to_metric_families((first.run_dir / "metrics" / "rank_0.prom").read_text())}
    waits = [s for s in families["vidray_data_wait_seconds"].samples if s.name.endswith("_count")]
    assert waits and waits[0].value == 6 and waits[0].labels["rank"] == "0"  # one data wait per step
    assert (first.run_dir / "metrics" / "rank_1.prom").is_file()
    assert first.data["hot_hits"] + first.data["hot_misses"] == 6 * 2  # every clip of rank 0's batches
    assert [int(s[0]) for s in first.step_seconds] == list(range(1, 7))
    # Rank 0's peak RSS (bytes) holds at least the weights, gradients and AdamW's two moments (4x the weights)
    # and a torch process (> 100 MiB), and stays below the machine's memory: KiB read as bytes, or bytes scaled
    # twice, fall outside.
    from safetensors.torch import load_file
    import psutil

    weights = load_file(Path(first.checkpoint_path) / "transformer.safetensors")
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    assert max(4 * weight_bytes, 100 * 2**20) < first.peak_rss_bytes < psutil.virtual_memory().total
    assert first.checkpoint_path and read_train_state(first.checkpoint_path).step == 6
    assert read_train_state(first.checkpoint_path).world_size == 2
    assert (Path(first.diffusers_dir) / "model_index.json").is_file()
    assert list((Path(first.diffusers_dir) / "transformer").glob("*.safetensors"))
    saved = json.loads((Path(first.checkpoint_path) / "train_state.json").read_text())
    assert saved["step"] == 6
    # Validation samples of the checkpoints at steps 3 and 6, made by the validator actor beside the training.
    assert [v["step"] for v in first.validation] == [3, 6]
    for step in (3, 6):
        folder = first.run_dir / "validation" / f"step_{step:06d}"
        assert (folder / "0.mp4").is_file() and (folder / "grid.png").is_file()
    assert list((first.run_dir / "tensorboard" / "validation").glob("events.out.tfevents.*"))
    print(f"validation: {[round(v['seconds'], 1) for v in first.validation]} s each in the actor; the run's end "
          f"waited {first.validation_wait_s:.1f} s")

    # 2. The same run name with more steps resumes from step 6 and continues at step 7.
    second = run_training(tiny_job(shards_dir, tmp_path, train__max_steps=9))
    assert second.first_step == 7
    assert [int(s) for s, _ in second.losses] == [7, 8, 9]
    assert read_train_state(second.checkpoint_path).step == 9
    kept = sorted(p.name for p in (tmp_path / "test-run").glob("checkpoint_0*"))
    assert kept == ["checkpoint_000006", "checkpoint_000009"]  # num_to_keep=2

    # 3. Exact resume (same world size, fp32 on CPU): steps 1-6 and the resumed 7-9 have exactly the losses of
    # steps 1-9 trained in one go, and end with bitwise the same weights, optimizer and lr scheduler state.
    expected, reference_dir = uninterrupted_run(shards_dir)
    for step, loss in first.losses + second.losses:
        assert loss == expected[int(step)], step
    assert_same_training_state(second.checkpoint_path, reference_dir / "checkpoint_000009")

    # 4. What the run leaves to look at (`vidray.train.runlog`), continued by the resumed attempt: TensorBoard
    # events with each step's loss once (read with TensorBoard's own reader), metrics.jsonl and loss.png.
    from vidray.train.runlog import read_scalars

    run_dir = tmp_path / "test-run"
    scalars = read_scalars(run_dir)
    assert [s for s, _ in scalars["train/loss"]] == list(range(1, 10))
    for (_, value), (_, loss) in zip(scalars["train/loss"], first.losses + second.losses):
        assert value == pytest.approx(loss, rel=1e-6)  # float32 in the event file
    assert {"train/lr", "train/grad_norm", "train/samples_per_s", "data/wait_fraction",
            "stages/dit_busy_fraction"} <= set(scalars)
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == \
        list(range(1, 10))
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_worker_killed_mid_run_restarts_from_checkpoint_and_matches_uninterrupted_run(local_ray, shards_dir, tmp_path):
    """SIGKILL one Ray Train worker once the step-5 checkpoint is committed (the step-10 one is being written, and
    `report` is a barrier): the group restarts from the latest committed checkpoint (FailureConfig) and the run ends
    exactly where an uninterrupted run ends."""
    import os
    import signal
    import threading
    import time

    import psutil

    killed: list[int] = []

    def kill_a_worker_after_first_checkpoint():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (tmp_path / "b" / "test-run" / "checkpoint_000010").exists():
            time.sleep(0.05)
        # This test's own cluster's workers: the local Ray's processes descend from this (driver) process, so
        # another Ray on the host cannot make the lookup ambiguous (and no dashboard is needed: `local_ray`).
        workers = []
        for proc in psutil.Process().children(recursive=True):
            try:
                # Ray titles an actor's process `ray::<class>` (`ray::<class>.<method>` while a call runs).
                if (" ".join(proc.cmdline()).startswith("ray::RayTrainWorker")
                        and proc.status() != psutil.STATUS_ZOMBIE):
                    workers.append(proc)
            except psutil.Error:  # ended meanwhile
                continue
        if workers:
            victim = max(workers, key=lambda p: p.pid)
            os.kill(victim.pid, signal.SIGKILL)
            killed.append(victim.pid)

    killer = threading.Thread(target=kill_a_worker_after_first_checkpoint, daemon=True)
    killer.start()
    interrupted = run_training(tiny_job(shards_dir, tmp_path / "b", train__max_steps=40,
                                        checkpoint__every_steps=5, train__max_failures=2))
    killer.join(timeout=5)
    assert killed, "no worker was alive to kill: the run finished before its first checkpoint was seen"
    assert interrupted.first_step > 1  # the final attempt started from a checkpoint, not from scratch

    expected, reference_dir = uninterrupted_run(shards_dir)  # steps 1..40 of the same job trained in one go
    assert [int(s) for s, _ in interrupted.losses] == list(range(interrupted.first_step, 41))
    for step, loss in interrupted.losses:
        assert loss == expected[int(step)], step
    assert_same_training_state(interrupted.checkpoint_path, reference_dir / "checkpoint_000040")


@pytest.fixture(scope="module")
def twenty_shards(tmp_path_factory):
    """20 samples: the shipped clips listed several times (each listing is its own sample_id)."""
    root = tmp_path_factory.mktemp("twenty")
    items = json.loads((REPO / "samples" / "metadata.json").read_text())
    listed = [dict(item, file_path=str(REPO / "samples" / item["file_path"])) for item in items * 4][:20]
    (root / "metadata.json").write_text(json.dumps(listed))
    out = root / "shards"
    summary = prepare(root / "metadata.json", out, buckets=load_job_config(
        REPO / "jobs/configs/tiny_t2v.yaml").data.buckets, fps=8.0, samples_per_shard=8, progress=None)
    assert summary.num_samples == 20
    return out


def test_run_of_20_samples_resized_2_to_4_and_4_to_2_workers_mid_epoch_sees_every_sample_once_per_epoch(
        local_ray, twenty_shards, tmp_path, capsys):
    """2 workers for 2 steps, 4 workers for 3 more, 2 workers again to step 11: the sample_ids trained with weight
    > 0 in each finished epoch are all 20, each exactly once (multisets), and both resizes fall mid-epoch. The
    global batch follows the worker count (train.micro_batches_per_step null), and the driver says so."""
    import collections

    from vidray.data.index import load_sample_index

    everyone = collections.Counter(load_sample_index(twenty_shards).sample_id.astype(str).tolist())
    assert len(everyone) == 20
    runs, states, outputs = [], [], []
    for workers, max_steps in ((2, 2), (4, 5), (2, 11)):
        job = tiny_job(twenty_shards, tmp_path, train__max_steps=max_steps, scaling__num_workers=workers,
                       scaling__cpus_per_worker=0.5, data__loader_cpus=0.3, checkpoint__every_steps=100,
                       train__log_every_steps=100)  # 4 x (0.5 + 0.3 + 0.2 encode) = the 4 CPUs
        runs.append(run_training(job, record_sample_ids=True))
        states.append(read_train_state(runs[-1].checkpoint_path))  # before num_to_keep rotates it away
        outputs.append(capsys.readouterr().out)
    assert "global batch:" not in outputs[0]
    assert ("[vidray] global batch: 4 micro-batches per step, was 2 in the checkpoint (train.micro_batches_per_step "
            "is null: it follows the max worker count)") in outputs[1]
    assert ("[vidray] global batch: 2 micro-batches per step, was 4 in the checkpoint (train.micro_batches_per_step "
            "is null: it follows the max worker count; set it to 4 to keep the checkpoint's)") in outputs[2]
    # 11 micro-batches per epoch (17 clips / 2 -> 9, 3 images / 2 -> 2): both resizes must cut an epoch.
    after_first, after_second, last = states
    assert (after_first.world_size, after_second.world_size) == (2, 4)
    assert after_first.epoch == 0 and 0 < after_first.batch_index < 11
    assert after_second.epoch == 1 and 0 < after_second.batch_index < 11
    steps = [record for run in runs for record in run.trained_samples]
    assert [step for step, _, _ in steps] == list(range(1, 12))
    per_epoch = collections.defaultdict(collections.Counter)
    for _, epoch, ids in steps:
        per_epoch[epoch].update(ids)
    finished = [epoch for epoch in per_epoch if epoch < last.epoch]
    assert finished == [0, 1], (finished, last)
    for epoch in finished:
        assert per_epoch[epoch] == everyone, epoch
