"""What a training run leaves for a person to look at, written by rank 0 into the run folder:

- `tensorboard/`: TensorBoard event files (`tensorboard --logdir <run folder>`): per step `train/loss`, `train/lr`,
  `train/grad_norm`; per log window `train/step_time_s`, `train/samples_per_s`, `data/wait_fraction`,
  `stages/<stage>_busy_fraction` (decode, vae, text, dit; a VAE run: decode and vae, its trainer's stage),
  `train/encode_time_s`, `train/dit_step_time_s` (a VAE run: `train/vae_step_time_s`);
- `metrics.jsonl`: one line per step, {"step", "loss", "lr", "grad_norm"} (loss and grad norm are the mean over
  ranks), the data behind the curves;
- `loss.png`: the loss curve of the whole run (raw and smoothed), redrawn at each checkpoint and at the end.

A resumed or restarted run continues the same files: the writer purges events from its first step on
(`SummaryWriter(purge_step=)`), and `metrics.jsonl` keeps only the steps before it, so steps trained again after a
restart appear once. A run folder on object storage is written in a local folder and copied into the run folder
(`vidray.storage`) at each checkpoint and at the end. TensorBoard's own layout is used as is (torch's
`torch.utils.tensorboard.SummaryWriter`, read back by `tensorboard`'s `EventAccumulator`); the PNG is matplotlib's.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from vidray.locations import is_uri

TENSORBOARD_DIR = "tensorboard"
METRICS_FILE = "metrics.jsonl"
LOSS_PLOT = "loss.png"
WINDOW_SCALARS = {
    "step_time_s": "train/step_time_s",
    "samples_per_s": "train/samples_per_s",
    "data_wait_fraction": "data/wait_fraction",
    "encode_time_s": "train/encode_time_s",
    "dit_step_time_s": "train/dit_step_time_s",
    "vae_step_time_s": "train/vae_step_time_s",  # a VAE run's step (`vidray.train.window.compute_stage`)
    **{f"{stage}_busy_fraction": f"stages/{stage}_busy_fraction" for stage in ("decode", "vae", "text", "dit")},
}
"""TensorBoard tag of each window metric of the training loop's report (`vidray.train.loop`)."""
STEP_SCALARS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm"}
"""TensorBoard tag of each per-step value."""
EXPERT_SCALARS = {f"{value}_{expert}": f"experts/{value}_{expert}" for value in ("loss", "grad_norm")
                  for expert in ("high", "low")}
"""TensorBoard tag of each per-step value of a run whose two experts train as two worker groups (`model.experts`
layout groups): each expert's loss and gradient norm, the mean over its ranks (also in metrics.jsonl)."""


class RunLog:
    """Rank 0's TensorBoard writer, `metrics.jsonl` and `loss.png` of one run attempt.

    Args:
        run_dir: the run folder (a local path or an object store URI).
        start_step: the first step this attempt trains (1, or the resumed checkpoint's step + 1): events and
            metric lines of this step and later, from an earlier attempt, are dropped.
        title: the plot's title (the run's name).

    Raises OSError (or `vidray.storage.StorageTransferError`) when the run folder cannot be written.
    """

    def __init__(self, run_dir: str, *, start_step: int, title: str = ""):
        from torch.utils.tensorboard import SummaryWriter  # heavy: torch

        from vidray.storage import open_storage  # heavy: pyarrow, numpy

        self.storage = open_storage(run_dir, setting="storage.path")
        self.local = Path(tempfile.mkdtemp(prefix="vidray-runlog-")) if is_uri(run_dir) else Path(run_dir)
        self.local.mkdir(parents=True, exist_ok=True)
        self.title = title
        self.start_step = int(start_step)
        self.steps = self._earlier_steps()
        self._write_metrics_file()
        self.writer = SummaryWriter(str(self.local / TENSORBOARD_DIR), purge_step=self.start_step)

    def _earlier_steps(self) -> list[dict[str, float]]:
        """The lines of the run's metrics.jsonl before `start_step` (none for a new run)."""
        if not self.storage.is_file(METRICS_FILE):
            return []
        rows = []
        for line in self.storage.read_bytes(METRICS_FILE).decode(errors="replace").splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # the last line of an attempt killed while it wrote: dropped
                continue
        return [row for row in rows if isinstance(row, dict) and int(row.get("step", self.start_step)) <
                self.start_step]

    def _write_metrics_file(self) -> None:
        text = "".join(json.dumps(row) + "\n" for row in self.steps)
        (self.local / METRICS_FILE).write_text(text)

    def log_window(self, first_step: int, losses: list[float], grad_norms: list[float], lrs: list[float],
                   window: dict[str, float], *, samples_per_step: int,
                   experts: dict[str, dict[str, list[float]]] | None = None) -> None:
        """Record the steps `first_step`.. of one log window: their mean-over-ranks `losses` and `grad_norms` and
        their `lrs` (one each per step), and the window metrics (`WINDOW_SCALARS` keys; samples/s is
        `samples_per_step` / step_time_s) at the window's last step. `experts` ({"high" | "low": {"loss":
        [...], "grad_norm": [...]}}, one value per step: `ClosedWindow.experts`) adds each expert's values to the
        step's line and its `EXPERT_SCALARS` tags."""
        for i, (loss, grad_norm, lr) in enumerate(zip(losses, grad_norms, lrs)):
            row = {"step": first_step + i, "loss": float(loss), "lr": float(lr), "grad_norm": float(grad_norm)}
            for expert, values in (experts or {}).items():
                row.update({f"{name}_{expert}": float(per_step[i]) for name, per_step in values.items()})
            self.steps.append(row)
            for key, tag in (*STEP_SCALARS.items(), *EXPERT_SCALARS.items()):
                if key in row:
                    self.writer.add_scalar(tag, row[key], row["step"])
        last = first_step + len(losses) - 1
        values = dict(window)
        if values.get("step_time_s"):
            values["samples_per_s"] = samples_per_step / values["step_time_s"]
        for key, tag in WINDOW_SCALARS.items():
            if key in values:
                self.writer.add_scalar(tag, float(values[key]), last)
        with open(self.local / METRICS_FILE, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in self.steps[-len(losses):])

    def flush(self) -> None:
        """Write the event file out, redraw loss.png and, for a run folder on object storage, copy the three into
        it (at each checkpoint and at the end)."""
        self.writer.flush()
        plot_losses(self.steps, self.local / LOSS_PLOT, title=self.title)
        if not self.storage.is_local:
            copy_into(self.storage, self.local, only=[TENSORBOARD_DIR, METRICS_FILE, LOSS_PLOT])

    def close(self) -> None:
        """`flush`, then close the writer."""
        self.flush()
        self.writer.close()


def copy_into(storage: Any, local: Path, *, only: list[str]) -> None:
    """Copy the files under `local` whose relative path is, or lies under, one of `only` into `storage` (a run
    folder on object storage), file by file: the run folder holds checkpoints this must not touch (unlike
    `vidray.storage.upload_dir`, which makes the destination hold exactly the source's files)."""
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        rel = path.relative_to(local).as_posix()
        if any(rel == prefix or rel.startswith(prefix.rstrip("/") + "/") for prefix in only):
            storage.write_bytes(rel, path.read_bytes())


def plot_losses(steps: list[dict[str, float]], out: Path, *, title: str = "") -> None:
    """Draw the loss of each step (light) and its exponential moving average (alpha 0.1, dark) against the step
    into the PNG `out` (matplotlib's Agg backend: no display needed). Written to a temp file and renamed, so a
    viewer never reads half a PNG. Nothing is drawn for no steps."""
    if not steps:
        return
    import matplotlib  # heavy: matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: matplotlib

    xs = [int(r["step"]) for r in steps]
    ys = [float(r["loss"]) for r in steps]
    smooth, ema = [], ys[0]
    for y in ys:
        ema = 0.9 * ema + 0.1 * y
        smooth.append(ema)
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(xs, ys, color="tab:blue", alpha=0.3, linewidth=1, label="loss")
    ax.plot(xs, smooth, color="tab:blue", linewidth=2, label="moving average")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title or "training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = out.with_name(out.name + ".tmp")
    fig.savefig(tmp, format="png")
    plt.close(fig)
    tmp.replace(out)


def read_scalars(run_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} of the TensorBoard event files in a local run folder's `tensorboard/`, read with
    TensorBoard's own `EventAccumulator` (purged steps of restarted attempts dropped, as TensorBoard shows them)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # heavy: tensorboard

    acc = EventAccumulator(str(Path(run_dir) / TENSORBOARD_DIR), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
