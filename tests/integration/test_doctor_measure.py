"""`vidray doctor CONFIG --measure` on a local 2-node Ray cluster (`ray.cluster_utils.Cluster`, every listener on
127.0.0.1): the tiny job's 2 workers land one per node (1.5 CPUs each on nodes of 2), measure the gloo all-reduce
bandwidth between them per message size, the object store's node-to-node rate, and one simulated training step
against the memory plan. The table is printed (`pytest -s`): docs/training.md shows one."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from vidray.cli import main
from vidray.doctor_measure import TRANSFER_FLOOR_BYTES_S

from tests.integration.conftest import loopback_cluster

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "jobs/configs/tiny_t2v.yaml")
pytestmark = pytest.mark.integration

NODE_CPUS = 2
"""Logical CPUs per worker node: with scaling.cpus_per_worker=1.5 PACK places one worker per node (and the static
resource check counts 1.5 + data.loader_cpus 0.3 + 0.2 of encode actors = 2 CPUs a worker)."""


@pytest.fixture
def cluster():
    """A head node with 0 CPUs and two worker nodes of `NODE_CPUS` CPUs, all on 127.0.0.1; this process joined to
    it. Shut down (by the Cluster's own process handles) at the end."""
    with loopback_cluster([{"num_cpus": NODE_CPUS}] * 2) as (cluster, _):
        yield cluster


def test_measure_reports_bandwidth_per_size_the_node_to_node_rate_and_the_step_against_the_plan(
        cluster, capsys, tmp_path):
    code = main(["doctor", CONFIG, "--measure", "--max-message-mib", "4", f"data.shards_dir={tmp_path / 'shards'}",
                 f"storage.path={tmp_path / 'runs'}", "scaling.cpus_per_worker=1.5", "data.loader_cpus=0.3"])
    out = capsys.readouterr().out
    with capsys.disabled():
        print("\n" + out)
    assert code == 0, out
    found = {}
    for line in out.splitlines()[:-1]:
        level, rest = line.split(None, 1)
        topic, message = rest.split(": ", 1)
        found[topic] = (level, message)

    # 1. The all-reduce bus bandwidth per size between the two workers, one per node.
    for size in ("1 MiB", "4 MiB"):
        level, message = found[f"allreduce {size}"]
        busbw, algbw = (float(x) for x in re.findall(r"(?:busbw|algbw) +([0-9.]+) GB/s", message))
        assert level == "ok" and math.isfinite(busbw) and busbw > 0 and busbw == algbw, message  # n = 2
    level, message = found["allreduce"]
    assert message.startswith("2 workers on 2 node(s), gloo: busbw ") and "at 4 MiB, the largest size" in message
    assert "not judged below 16 MiB" in message and "the job's gradients" in message

    # 2. The object store between the two nodes: its level is the rate's judgement (the 2-core machine's loopback
    # has measured 53 MB/s under load, below the 1 GbE floor: a warning then, with its advice, never a failure).
    level, message = found["transfer"]
    assert message.startswith("node-to-node (")
    rate = float(re.search(r" at ([0-9.]+) MB/s", message).group(1))
    assert rate > 0 and "the job's latent batch (9x64x64 x2, 24 KiB)" in message
    slow = rate * 1e6 < TRANSFER_FLOOR_BYTES_S
    if abs(rate * 1e6 - TRANSFER_FLOOR_BYTES_S) > 1e6:  # the message rounds the rate to 1 MB/s
        assert level == ("warn" if slow else "ok"), message
        assert (f"below {TRANSFER_FLOOR_BYTES_S / 1e6:.0f} MB/s" in message) == slow, message

    # 3. One simulated step of the tiny model against the plan.
    level, message = found["step"]
    assert message.startswith("tiny at 9x64x64 x2 (32 text tokens), ddp fp32 on one CPU worker: ")
    step_ms = float(re.search(r": ([0-9.]+) ms a step", message).group(1))
    ratio = float(re.search(r"the plan [0-9.]+ MiB \(([0-9.]+)x\)", message).group(1))
    assert step_ms > 0 and 0.85 <= ratio <= 1.15 and level == "ok", message
