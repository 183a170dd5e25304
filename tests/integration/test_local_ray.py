"""`vidray train` without `RAY_ADDRESS` starts a local cluster of its own, also on a machine where `ray start` ran:
Ray records such a head in `<temp>/ray/ray_current_cluster` (and leaves the file behind when the head is stopped),
and a bare `ray.init()` joins that address instead of starting one."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.integration.conftest import REPO, free_port, pids_mentioning

pytestmark = pytest.mark.integration


def test_a_local_run_starts_its_own_cluster_when_ray_start_left_its_address_file():
    # A new user's trial: after the `ray start --head` recipe (now in docs/cluster.md), `vidray train` without RAY_ADDRESS died
    # with "ValueError: When connecting to an existing cluster, num_cpus and num_gpus must not be provided".
    temp = tempfile.mkdtemp(prefix="/tmp/vrl")  # short: Ray's socket paths are length-limited
    try:
        (Path(temp) / "ray").mkdir()
        stale = f"127.0.0.1:{free_port()}"  # what a stopped `ray start --head` leaves: nothing answers there
        (Path(temp) / "ray" / "ray_current_cluster").write_text(stale)
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update(RAY_TMPDIR=temp, PYTHONPATH=str(REPO))
        code = ("import vidray, ray\nfrom vidray.runtime import init_ray\nassert init_ray()\n"
                "print('GCS', ray.get_runtime_context().gcs_address, flush=True)\nray.shutdown()\n")
        done = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                              timeout=240)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        [gcs] = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("GCS ")]
        assert gcs != stale and gcs.startswith("127.0.0.1:")
    finally:
        for pid in pids_mentioning(temp):  # only what this test's cluster started, by PID
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(temp, ignore_errors=True)
