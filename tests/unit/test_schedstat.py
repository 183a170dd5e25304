"""`benchmarks/_schedstat.py`: the steady-state sampler of `benchmarks/train_env.py` finds a real busy process by
its command line, waits for its CPU, and reports its busiest thread and the machine's time slices."""

import importlib.util
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

# Loaded from its file: putting benchmarks/ on sys.path would shadow modules of the repo (its serve.py, serve/).
_spec = importlib.util.spec_from_file_location(
    "_schedstat", Path(__file__).resolve().parents[2] / "benchmarks" / "_schedstat.py")
schedstat = sys.modules.setdefault("_schedstat", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(schedstat)  # after registering it: its dataclass looks its module up in sys.modules

pytestmark = pytest.mark.skipif(not schedstat.available(), reason="no per-thread schedstat in /proc here")


def test_sampler_measures_a_busy_process_after_its_cpu_threshold():
    marker = f"vidray-busy-{uuid.uuid4().hex}"
    busy = subprocess.Popen([sys.executable, "-c", "import sys\nwhile True: pass", marker])
    sampler = schedstat.SteadyStateSampler(marker, after_cpu_s=0.3, window_s=1.0, timeout_s=60)
    try:
        started = time.monotonic()
        sampler.start()
        sampler.join(timeout=30)
        waited = time.monotonic() - started
    finally:
        busy.kill()
        busy.wait()
        sampler.stop()
    result = sampler.result
    assert result is not None, "the sampler never saw the busy process reach 0.3 s of CPU"
    assert waited >= 1.0  # it sampled for its 1 s window, after the process had used its CPU threshold
    (thread,) = result["compute_threads"]
    assert thread["pid"] == busy.pid
    # A spinning thread on a 2-core machine shared with the test runner (and, under `make test-fast`'s two
    # pytest-xdist workers or other jobs, more): measured 0.2 cores at a load average of 12.
    assert thread["cores"] > 0.05
    assert thread["runqueue_wait_s_per_s"] >= 0 and thread["nonvoluntary_switches_per_s"] >= 0
    assert result["slices_per_s"] > 0


def test_sampler_stops_without_a_result_when_nothing_matches():
    sampler = schedstat.SteadyStateSampler(f"no-such-process-{uuid.uuid4().hex}", timeout_s=60)
    sampler.start()
    time.sleep(0.2)
    started = time.monotonic()
    sampler.stop()
    assert time.monotonic() - started < 2  # stop() ends the wait at once
    assert sampler.result is None
