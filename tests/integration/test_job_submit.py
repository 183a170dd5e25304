"""`ray job submit` of jobs/train.py against a head node started with `ray start --head`, as docs/cluster.md shows; then
`vidray doctor` joined to the same cluster (RAY_ADDRESS) checks it against the job's placement."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def test_ray_job_submit_trains_to_succeeded(ray_head, tmp_path):
    ray_cli = str(Path(sys.executable).parent / "ray")
    submit = subprocess.run(
        [
            ray_cli, "job", "submit", "--address", ray_head.dashboard_url, "--no-wait",
            "--submission-id", "vidray-test-job", "--working-dir", str(REPO), "--",
            "python", "jobs/train.py", "--config", "jobs/configs/tiny_t2v.yaml", "--prepare",
            f"data.shards_dir={tmp_path / 'shards'}", f"storage.path={tmp_path / 'runs'}",
            "model.text_encoder=tiny_random", "train.max_steps=4", "train.log_every_steps=2",
            "checkpoint.every_steps=2",
        ],
        env=ray_head.env, capture_output=True, text=True, timeout=120,
    )
    assert submit.returncode == 0, submit.stdout + submit.stderr

    deadline, status = time.monotonic() + 300, ""
    while time.monotonic() < deadline:
        done = subprocess.run(
            [ray_cli, "job", "status", "--address", ray_head.dashboard_url, "vidray-test-job"],
            env=ray_head.env, capture_output=True, text=True, timeout=60,
        )
        status = (done.stdout + done.stderr).lower()
        if any(s in status for s in ("succeeded", "failed", "stopped")):
            break
        time.sleep(2)
    logs = subprocess.run(
        [ray_cli, "job", "logs", "--address", ray_head.dashboard_url, "vidray-test-job"],
        env=ray_head.env, capture_output=True, text=True, timeout=60,
    ).stdout
    assert "job 'vidray-test-job' succeeded" in status, f"status: {status}\nlogs:\n{logs[-4000:]}"
    assert "step 4/4" in logs
    assert (tmp_path / "runs" / "tiny-t2v" / "checkpoint_000004" / "manifest.json").is_file()
    assert (tmp_path / "runs" / "tiny-t2v" / "diffusers" / "model_index.json").is_file()

    # 2. `vidray doctor` joins the cluster (nothing reserved) and checks the job against its node and label.
    env = {**ray_head.env, "RAY_ADDRESS": f"127.0.0.1:{ray_head.gcs_port}"}
    doctor = [str(Path(sys.executable).parent / "vidray"), "doctor", "jobs/configs/tiny_t2v.yaml",
              f"data.shards_dir={tmp_path / 'shards'}", f"storage.path={tmp_path / 'runs'}",
              "model.text_encoder=tiny_random", "train.max_steps=8",
              "placement.dit.label_selector={vidray.io/stage: dit}"]
    checked = subprocess.run(doctor, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    lines = checked.stdout.splitlines()
    assert any(line.startswith("ok    cluster: 127.0.0.1:") and "1 alive node(s), 4 CPUs" in line
               and "vidray labels: vidray.io/stage=dit" in line for line in lines), checked.stdout
    assert any(line.startswith("ok    placement: placement.dit.label_selector={'vidray.io/stage': 'dit'}: 1 of the "
                               "cluster's 1 node(s) satisfy it") for line in lines), checked.stdout
    assert any(line.startswith("ok    train: resuming from ") and "checkpoint_000004" in line for line in lines)
    # A selector no node satisfies is what `vidray train` refuses before reserving anything: a FAIL, with its fix;
    # every stage no node satisfies has its own FAIL line (a new user's trial: only the first was reported). One
    # `vidray doctor` run checks both (each run is a CLI start and a cluster join).
    three = subprocess.run([*doctor, "placement.vae.label_selector={vidray.io/stage: vae}",
                            "placement.text.label_selector={vidray.io/stage: vae}",
                            "placement.decode.label_selector={vidray.io/stage: decode}"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=120)
    assert three.returncode == 1, three.stdout + three.stderr
    assert any(line.startswith("FAIL  placement: no node satisfies placement.vae.label_selector=") and
               "1 node(s) with vidray.io/stage=dit" in line for line in three.stdout.splitlines()), three.stdout
    failed = [line.split("label_selector=")[0] for line in three.stdout.splitlines()
              if line.startswith("FAIL  placement: ")]
    assert failed == [f"FAIL  placement: no node satisfies placement.{stage}." for stage in ("decode", "vae", "text")], \
        three.stdout
