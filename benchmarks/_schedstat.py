"""Who runs and who wakes on this machine: per-thread CPU scheduling counts from Linux `/proc`, for benchmarks.

On a small shared machine a benchmark's step time depends on what else the scheduler runs beside it: every
wake-up of another thread can preempt a compute thread, and with ranks in lockstep (DDP) one preempted rank stalls
the others at the next all-reduce. Both the number of wake-ups and their CPU are visible per thread in
`/proc/<pid>/task/<tid>/schedstat` (run ns, run-queue wait ns, time slices; kernel docs,
Documentation/scheduler/sched-stats.rst) and `status` (`nonvoluntary_ctxt_switches`: the thread was preempted).
psutil has no per-thread run-queue wait or slice counts, so those are read from `/proc`; it finds the processes.

`SteadyStateSampler(pattern)` is a thread that waits until a process whose command line matches `pattern` has used
`after_cpu_s` seconds of CPU (past its start-up and warmup), then takes two snapshots of every thread on the
machine `window_s` apart. Its `result` (None on a machine without `/proc` schedstat, or when nothing matched
before `timeout_s`):

- `slices_per_s`: time slices per second over all threads of the machine (each is one thread put on a CPU);
- `top_processes`: the 10 processes with the most slices per second, `[pid, name, slices_per_s, cores]`;
- `compute_threads`: per matching process that used >= 0.2 core in the window, its busiest thread:
  `{"pid", "cores", "runqueue_wait_s_per_s", "nonvoluntary_switches_per_s"}` (seconds it waited runnable for a CPU,
  and times it was preempted, per second of the window).
"""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass

import psutil

__all__ = ["SteadyStateSampler", "available", "sample"]

_MIN_COMPUTE_CORES = 0.2
"""A matching process counts as a compute process when it used at least this many cores in the window."""


@dataclass(frozen=True)
class _Thread:
    process_name: str
    run_ns: int
    wait_ns: int
    slices: int
    nonvoluntary: int


def available() -> bool:
    """True when this machine exposes per-thread schedstat (Linux with schedstats in /proc)."""
    return os.path.exists(f"/proc/self/task/{threading.get_native_id()}/schedstat")


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _snapshot() -> dict[tuple[int, int], _Thread]:
    """Every thread's counters, keyed by (pid, tid); threads that exit while being read are left out."""
    threads = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            name = _read(f"/proc/{pid}/comm").strip()
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                run_ns, wait_ns, slices = map(int, _read(f"/proc/{pid}/task/{tid}/schedstat").split())
                status = _read(f"/proc/{pid}/task/{tid}/status")
            except (OSError, ValueError):
                continue
            found = re.search(r"^nonvoluntary_ctxt_switches:\s+(\d+)", status, re.M)
            threads[(int(pid), int(tid))] = _Thread(name, run_ns, wait_ns, slices, int(found.group(1)) if found else 0)
    return threads


def _matching(pattern: re.Pattern) -> dict[int, float]:
    """{pid: CPU seconds used (user + system)} of the processes (other than this one) whose command line matches
    `pattern`; psutil reads them."""
    found = {}
    for proc in psutil.process_iter(["cmdline", "cpu_times"]):
        cmdline, cpu = proc.info["cmdline"], proc.info["cpu_times"]
        if proc.pid != os.getpid() and cmdline and cpu and pattern.search(" ".join(cmdline)):
            found[proc.pid] = cpu.user + cpu.system
    return found


def sample(window_s: float, focus_pids: list[int]) -> dict:
    """Two snapshots `window_s` seconds apart, summarized as the module docstring's `result`, with the busiest
    thread of each of `focus_pids` as `compute_threads`."""
    before, t0 = _snapshot(), time.perf_counter()
    time.sleep(window_s)
    after, dt = _snapshot(), time.perf_counter() - t0
    per_process: dict[int, list] = {}
    busiest: dict[int, tuple[float, float, float]] = {}
    total = 0.0
    for (pid, tid), now in after.items():
        old = before.get((pid, tid))
        if old is None:
            continue
        slices = (now.slices - old.slices) / dt
        cores = (now.run_ns - old.run_ns) / 1e9 / dt
        total += slices
        entry = per_process.setdefault(pid, [pid, now.process_name, 0.0, 0.0])
        entry[2] += slices
        entry[3] += cores
        if pid in focus_pids and cores > busiest.get(pid, (-1.0,))[0]:
            busiest[pid] = (cores, (now.wait_ns - old.wait_ns) / 1e9 / dt, (now.nonvoluntary - old.nonvoluntary) / dt)
    top = sorted(per_process.values(), key=lambda e: -e[2])[:10]
    return {
        "window_s": round(dt, 2),
        "slices_per_s": round(total),
        "top_processes": [[pid, name, round(s), round(c, 3)] for pid, name, s, c in top],
        "compute_threads": [
            {"pid": pid, "cores": round(c, 3), "runqueue_wait_s_per_s": round(w, 3),
             "nonvoluntary_switches_per_s": round(n)}
            for pid, (c, w, n) in sorted(busiest.items())
            if per_process[pid][3] >= _MIN_COMPUTE_CORES
        ],
    }


class SteadyStateSampler(threading.Thread):
    """Samples the machine once a process matching `pattern` (a regex over its command line) has used
    `after_cpu_s` seconds of CPU; `result` as in the module docstring. A daemon thread: `start()` before the
    measured run, `stop()` after it (a sample in progress finishes, within `window_s`), then `result`. It gives up
    `timeout_s` seconds after `start()`."""

    def __init__(self, pattern: str, *, after_cpu_s: float = 8.0, window_s: float = 5.0, timeout_s: float = 900.0):
        super().__init__(name=f"SteadyStateSampler({pattern})", daemon=True)
        self.pattern = re.compile(pattern)
        self.after_cpu_s, self.window_s, self.timeout_s = after_cpu_s, window_s, timeout_s
        self.result: dict | None = None
        self._stopped = threading.Event()

    def stop(self) -> None:
        """Stop waiting and return once a sample in progress has finished."""
        self._stopped.set()
        self.join()

    def run(self) -> None:
        if not available():
            return
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline and not self._stopped.is_set():
            cpu_s = _matching(self.pattern)
            if any(seconds >= self.after_cpu_s for seconds in cpu_s.values()):
                self.result = sample(self.window_s, list(cpu_s))
                return
            self._stopped.wait(0.5)
