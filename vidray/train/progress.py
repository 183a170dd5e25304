"""The driver's training progress bar, fed by the workers' reports (on a terminal only, `vidray.progress`).

Ray Train runs a run's reports through its controller, not the driver: a `UserCallback` there
(`after_report`, Ray Train 2.60) puts rank 0's step, loss and step time of each report (every
`train.log_every_steps`, every checkpoint, the last step) into a `ray.util.queue.Queue` actor, which a thread of
the driver reads into a tqdm bar: steps done of `train.max_steps`, loss, samples/s and the ETA. Off a terminal
nothing of this starts (no queue actor, no callback): rank 0's step lines are the log.
"""

from __future__ import annotations

import queue as stdlib_queue
import threading
from typing import Any

from vidray.progress import bars_enabled, progress_bar


def _report_callback(reports: Any) -> Any:
    """A Ray Train callback putting {"step", "loss", "step_time_s"} of rank 0's report into `reports`."""
    from ray.train import UserCallback  # heavy: ray

    class ReportProgress(UserCallback):
        def after_report(self, run_context, metrics, checkpoint):
            if not metrics:
                return
            rank0 = metrics[0]
            try:
                reports.put_nowait({k: rank0[k] for k in ("step", "loss", "step_time_s") if k in rank0})
            except Exception:  # noqa: BLE001 - a full or gone queue never stops training
                pass

    return ReportProgress()


class TrainProgress:
    """A context manager around `trainer.fit()`: on a terminal, a bar of steps `first_step`..`max_steps` with
    loss and samples/s (`samples_per_step` per step), drawn by a driver thread; elsewhere it does nothing.
    `callbacks` holds the Ray Train callback to pass in `RunConfig(callbacks=)` (empty off a terminal)."""

    def __init__(self, *, first_step: int, max_steps: int, samples_per_step: int):
        self.enabled = bars_enabled()
        self.callbacks: list[Any] = []
        self.samples_per_step = int(samples_per_step)
        self.first_step, self.max_steps = int(first_step), int(max_steps)
        self._stop = threading.Event()
        self._reports = self._bar = self._thread = None
        if self.enabled:
            from ray.util.queue import Queue  # heavy: ray

            self._reports = Queue(maxsize=10_000, actor_options={"num_cpus": 0})
            self.callbacks = [_report_callback(self._reports)]

    def __enter__(self) -> "TrainProgress":
        if self.enabled:
            self._bar = progress_bar(self.max_steps, "train", "step", initial=self.first_step - 1)
            self._thread = threading.Thread(target=self._follow, name="vidray-train-progress", daemon=True)
            self._thread.start()
        return self

    def _follow(self) -> None:
        from ray.util.queue import Empty  # heavy: ray

        while not self._stop.is_set():
            try:
                report = self._reports.get(block=True, timeout=0.5)
            except (Empty, stdlib_queue.Empty):
                continue
            except Exception:  # noqa: BLE001 - the queue actor is gone: the bar stops moving, training goes on
                return
            self.show(report)

    def show(self, report: dict[str, Any]) -> None:
        """Move the bar to `report["step"]` (back, after a restart from a checkpoint) with its loss and
        samples/s."""
        bar = self._bar
        step = int(report.get("step", bar.n))
        if step >= bar.n:
            bar.update(step - bar.n)
        else:
            bar.n = step
        postfix = {}
        if "loss" in report:
            postfix["loss"] = f"{float(report['loss']):.4f}"
        if report.get("step_time_s"):
            postfix["samples/s"] = f"{self.samples_per_step / float(report['step_time_s']):.1f}"
        bar.set_postfix(postfix)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._reports is not None:
            try:
                while True:  # the reports that arrived after the thread's last look
                    self.show(self._reports.get_nowait())
            except Exception:  # noqa: BLE001 - empty, or the actor is gone
                pass
            self._reports.shutdown()
        if self._bar is not None:
            self._bar.close()
