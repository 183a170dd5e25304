"""What a run leaves to look at (`vidray.train.runlog`): TensorBoard event files read back with TensorBoard's own
`EventAccumulator`, metrics.jsonl and loss.png, continued without duplicates by a resumed attempt, and copied into
a run folder on object storage (a real S3 server)."""

from __future__ import annotations

import json

import pytest

from vidray.train.runlog import EXPERT_SCALARS, LOSS_PLOT, METRICS_FILE, STEP_SCALARS, TENSORBOARD_DIR, \
    WINDOW_SCALARS, RunLog, read_scalars

WINDOW = {"step_time_s": 0.5, "data_wait_fraction": 0.25, "encode_time_s": 0.1, "dit_step_time_s": 0.3,
          "decode_busy_fraction": 0.1, "vae_busy_fraction": 0.2, "text_busy_fraction": 0.05,
          "dit_busy_fraction": 0.9, "loss": 9.0, "step": 3}  # the loop's report also holds keys not plotted


def _train(log: RunLog, first: int, last: int, every: int = 3) -> None:
    """Log steps first..last in windows of `every`, loss 1/step, lr step*1e-4, grad norm 2."""
    for start in range(first, last + 1, every):
        steps = range(start, min(start + every, last + 1))
        log.log_window(start, [1 / s for s in steps], [2.0] * len(steps), [s * 1e-4 for s in steps],
                       WINDOW, samples_per_step=4)


def test_a_two_expert_groups_run_logs_each_experts_loss_and_gradient_norm_per_step(tmp_path):
    """`model.experts` layout groups (a fresh-user trial found the per-expert losses only in TensorBoard's window
    means): every step's line of metrics.jsonl and TensorBoard's `experts/*` carry each expert's values."""
    log = RunLog(str(tmp_path), start_step=1, title="t")
    experts = {"high": {"loss": [1.5, 1.25], "grad_norm": [3.0, 2.0]},
               "low": {"loss": [0.5, 0.75], "grad_norm": [1.0, 1.0]}}
    log.log_window(1, [1.0, 1.0], [2.0, 1.5], [1e-4, 2e-4], WINDOW, samples_per_step=4, experts=experts)
    log.close()
    scalars = read_scalars(tmp_path)
    dit_run = set(WINDOW_SCALARS.values()) - {WINDOW_SCALARS["vae_step_time_s"]}  # a VAE run's step time
    assert set(scalars) == set(STEP_SCALARS.values()) | dit_run | set(EXPERT_SCALARS.values())
    assert scalars["experts/loss_high"] == [(1, 1.5), (2, 1.25)]
    assert scalars["experts/grad_norm_low"] == [(1, 1.0), (2, 1.0)]
    rows = [json.loads(line) for line in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert rows[1] == {"step": 2, "loss": 1.0, "lr": 2e-4, "grad_norm": 1.5, "loss_high": 1.25, "grad_norm_high": 2.0,
                       "loss_low": 0.75, "grad_norm_low": 1.0}


def _png(path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_writes_every_scalar_metrics_lines_and_a_loss_png(tmp_path):
    log = RunLog(str(tmp_path), start_step=1, title="t")
    _train(log, 1, 6)
    log.close()
    scalars = read_scalars(tmp_path)
    assert set(scalars) == set(STEP_SCALARS.values()) | set(WINDOW_SCALARS.values()) - {"train/vae_step_time_s"}
    assert scalars["train/loss"] == [(s, pytest.approx(1 / s)) for s in range(1, 7)]
    assert [s for s, _ in scalars["train/step_time_s"]] == [3, 6]  # window metrics at each window's last step
    assert scalars["train/samples_per_s"][0][1] == pytest.approx(4 / 0.5)
    assert scalars["data/wait_fraction"][0][1] == pytest.approx(0.25)
    rows = [json.loads(line) for line in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7)) and rows[1] == {"step": 2, "loss": 0.5, "lr": 2e-4,
                                                                          "grad_norm": 2.0}
    assert _png(tmp_path / LOSS_PLOT)


def test_a_resumed_attempt_replaces_the_steps_it_trains_again(tmp_path):
    first = RunLog(str(tmp_path), start_step=1)
    _train(first, 1, 6)
    first.close()
    # Restarted from the checkpoint at step 3 (steps 4-6 are trained again, here with other losses).
    again = RunLog(str(tmp_path), start_step=4)
    again.log_window(4, [0.7, 0.6, 0.5], [1.0] * 3, [1e-3] * 3, WINDOW, samples_per_step=4)
    again.close()
    losses = read_scalars(tmp_path)["train/loss"]
    assert [s for s, _ in losses] == list(range(1, 7))  # each step once
    assert [v for _, v in losses][3:] == [pytest.approx(v) for v in (0.7, 0.6, 0.5)]
    rows = [json.loads(line) for line in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 0.5), (3, 1 / 3), (4, 0.7), (5, 0.6), (6, 0.5)]
    assert len(list((tmp_path / TENSORBOARD_DIR).glob("events.out.tfevents.*"))) == 2


def test_a_line_cut_by_a_killed_attempt_is_dropped_on_resume(tmp_path):
    (tmp_path / METRICS_FILE).write_text('{"step": 1, "loss": 1.0, "lr": 0.1, "grad_norm": 2.0}\n{"step": 2, "lo')
    resumed = RunLog(str(tmp_path), start_step=2)
    assert [r["step"] for r in resumed.steps] == [1]
    resumed.close()
    assert (tmp_path / METRICS_FILE).read_text().count("\n") == 1


def test_a_run_folder_on_object_storage_gets_the_files_at_each_flush(s3_env, tmp_path):
    from vidray.storage import download_dir, open_storage

    run = "s3://vidray-test/runlog/run"
    log = RunLog(run, start_step=1, title="remote")
    _train(log, 1, 3)
    log.flush()
    names = open_storage(run, setting="storage.path").files()
    assert {METRICS_FILE, LOSS_PLOT} <= names and any(n.startswith(f"{TENSORBOARD_DIR}/events.") for n in names)
    _train(log, 4, 6)
    log.close()
    local = tmp_path / "copy"
    download_dir(run, local)
    assert [s for s, _ in read_scalars(local)["train/loss"]] == list(range(1, 7))
    assert _png(local / LOSS_PLOT)
    resumed = RunLog(run, start_step=5)  # reads the earlier lines from the bucket
    assert [r["step"] for r in resumed.steps] == [1, 2, 3, 4]
    resumed.close()
