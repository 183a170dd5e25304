"""The job driver of `test_autoscaler.py`: trains the tiny job on the cluster named by `RAY_ADDRESS` (a head with
Ray's autoscaler) and prints what it saw as one line `RESULT <json>`:

    python tests/integration/autoscaler_driver.py section.key=value ...

- `nodes_before`, `nodes_after_job`, `nodes_after_idle`: every node the GCS knows (dead ones too), as
  {"node_id", "alive", "labels"}, before the job, right after it and once no worker node is alive any more (or
  after `IDLE_WAIT_S`); `idle_wait_s`: how long that took after the job;
- `last_step`, `placement`: the run's `TrainResult` fields (where each rank's trainer, decode operators and
  encode actors ran, as they saw it from inside).

Ray 2.60 gap: vidray learns that a cluster autoscales, and up to how much, from the cluster config the
autoscaler reports to the GCS (`ray._private.state.state.get_max_resources_from_cluster_config`). Nothing in Ray 2.60
reports it for a cluster started with `ray start --autoscaling-config` (the GCS handler exists,
`GcsAutoscalerStateManager::HandleReportClusterConfig`, but no Python caller: `ray/includes/common.pxd:647`
declares `ReportClusterConfig` and `ray._raylet.GcsClient` does not expose it); later Ray's v2 `Autoscaler`
reports it when it starts. vidray then reads the cluster YAML itself (`vidray.runtime.autoscaler_max_resources`):
the test names it with `VIDRAY_AUTOSCALER_CONFIG`, as a user of `ray start --autoscaling-config` would (`ray up`'s
head has it at `~/ray_bootstrap_config.yaml`, read without the variable).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import vidray.runtime  # before ray: loopback-only defaults

REPO = Path(__file__).resolve().parents[2]
IDLE_WAIT_S = 120.0
"""The longest wait (s) for the worker nodes to go away after the job (the test's idle timeout is 6 s; the node went
away 0-6 s after the job's end on an idle 2-core machine): a bound on waiting for the condition, 20x the timeout, so
that a loaded machine's slower autoscaler rounds do not fail the test (issue 48)."""


def nodes() -> list[dict]:
    import ray

    return [{"node_id": n["NodeID"], "alive": bool(n["Alive"]), "labels": dict(n.get("Labels") or {})}
            for n in ray.nodes()]


def main(*overrides: str) -> None:
    import ray

    from vidray.config import load_job_config
    from vidray.train.trainer import run_training

    vidray.runtime.init_ray()
    out: dict = {"autoscaler_max_resources": vidray.runtime.autoscaler_max_resources(), "nodes_before": nodes()}
    result = run_training(load_job_config(REPO / "jobs/configs/tiny_t2v.yaml", list(overrides)))
    out.update(last_step=result.last_step, placement=result.placement, nodes_after_job=nodes())
    done = time.monotonic()
    while time.monotonic() - done < IDLE_WAIT_S and sum(n["alive"] for n in nodes()) > 1:
        time.sleep(0.5)
    out.update(idle_wait_s=time.monotonic() - done, nodes_after_idle=nodes())
    ray.shutdown()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
