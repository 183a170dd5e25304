"""What a run prints (`vidray.logs`): quiet library settings by default, the user's own values kept, `--verbose`
bringing Ray's and the libraries' lines back; checked in fresh interpreters, where `import vidray` applies them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

PROBE = """
import json, os, sys
sys.argv[1:] and os.environ.update(json.loads(sys.argv[1]))
import vidray, vidray.logs as logs
if os.environ.get("PROBE_VERBOSE"):
    logs.set_verbose()
logs.apply_local_cluster_defaults()
print(json.dumps({"env": {k: os.environ.get(k) for k in [*logs.QUIET_ENV, *logs.LOCAL_CLUSTER_ENV]},
                  "train": logs.ray_train_log_level(), "init": logs.ray_init_logging_level(),
                  "workers": logs.worker_env()}))
"""


def probe(extra_env: dict[str, str] | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("VIDRAY_VERBOSE", "RAY_DATA_LOG_LEVEL",
                                                           "HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY",
                                                           "DIFFUSERS_VERBOSITY",
                                                           "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(extra_env or {})], env=env, capture_output=True,
                         text=True, timeout=60, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def test_a_default_run_sets_every_quiet_setting_and_keeps_the_users_own():
    seen = probe({"RAY_DATA_LOG_LEVEL": "INFO"})  # a Ray user's own setting wins
    assert seen["env"] == {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error",
                           "DIFFUSERS_VERBOSITY": "error", "RAY_DATA_LOG_LEVEL": "INFO",
                           "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}
    assert seen["train"] == "WARNING" and seen["init"] == 30
    assert seen["workers"] == {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error",
                               "DIFFUSERS_VERBOSITY": "error", "RAY_DATA_LOG_LEVEL": "INFO"}


def test_verbose_removes_what_vidray_set_but_not_the_users_settings():
    seen = probe({"PROBE_VERBOSE": "1", "TRANSFORMERS_VERBOSITY": "warning"})
    assert seen["env"] == {"HF_HUB_DISABLE_PROGRESS_BARS": None, "TRANSFORMERS_VERBOSITY": "warning",
                           "DIFFUSERS_VERBOSITY": None, "RAY_DATA_LOG_LEVEL": None,
                           "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": None}
    assert seen["train"] == "INFO" and seen["init"] == 20
    assert seen["workers"] == {"VIDRAY_VERBOSE": "1"}  # Ray Train's workers on a cluster are verbose too


def test_vidray_train_and_the_ray_job_entry_point_take_verbose():
    from vidray.cli import parse_args

    args = parse_args(["train", "jobs/configs/tiny_t2v.yaml", "train.max_steps=2", "--verbose"])
    assert args.verbose and args.overrides == ["train.max_steps=2"]
    out = subprocess.run([sys.executable, str(REPO_ROOT / "jobs/train.py"), "--help"], capture_output=True,
                         text=True, timeout=60, cwd=REPO_ROOT, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert "--verbose" in out.stdout


FAMILY_PROBE = """
import json, os, sys
os.environ.update(json.loads(sys.argv[1]))
from vidray.models import get_family
family = get_family("wan")  # what a worker, an encode actor or a serve replica does before it loads weights
from diffusers.utils import logging
print(json.dumps({"bars": logging.is_progress_bar_enabled()}))
"""


@pytest.mark.slow
def test_a_process_that_loads_a_family_has_diffusers_bars_off_unless_verbose():
    """diffusers' `Loading pipeline components...` bars reached the console from encode actors, the text-identity
    actor and serve replicas loading a pretrained folder (a fresh-user trial): every process that looks a family up
    turns them off, as `vidray generate` and the validator did already; `--verbose` keeps them."""
    env = {k: v for k, v in os.environ.items() if k != "VIDRAY_VERBOSE"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    seen = {}
    for verbose in ("", "1"):
        out = subprocess.run([sys.executable, "-c", FAMILY_PROBE, json.dumps({"VIDRAY_VERBOSE": verbose})], env=env,
                             capture_output=True, text=True, timeout=120, check=True)
        seen[verbose] = json.loads(out.stdout.splitlines()[-1])["bars"]
    assert seen == {"": False, "1": True}


DDP_STEPS = r"""
import os, sys
import torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
if sys.argv[2] == "quiet":
    from vidray.train.parallel import quiet_unused_parameters_warning
    print("before", file=sys.stderr, flush=True)
    quiet_unused_parameters_warning()
# Two experts' DDP as `model.experts.layout: shared` builds it: find_unused_parameters, and steps that use both.
class Both(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.high, self.low = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)

    def forward(self, x):
        return self.high(x) + self.low(x)


model = torch.nn.parallel.DistributedDataParallel(Both(), find_unused_parameters=True)
for _ in range(2):
    model(torch.ones(3, 2)).sum().backward()
print("steps done", file=sys.stderr, flush=True)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("mode", ["quiet", "plain"])
def test_ddp_s_unused_parameters_advice_reaches_stderr_only_without_the_quieting(mode):
    from tests.conftest import free_port
    from vidray.train.parallel import UNUSED_PARAMETERS_WARNING

    env = {k: v for k, v in os.environ.items() if k != "VIDRAY_VERBOSE"}
    out = subprocess.run([sys.executable, "-c", DDP_STEPS, str(free_port()), mode], cwd=REPO_ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "steps done" in out.stderr
    if mode == "quiet":  # the line is gone, what else reached stderr meanwhile stays
        assert UNUSED_PARAMETERS_WARNING not in out.stderr, out.stderr
        assert out.stderr.index("before") < out.stderr.index("steps done")
    else:  # what the quieting stops: torch's C++ reducer prints it once, no Python warning
        assert out.stderr.count(UNUSED_PARAMETERS_WARNING) == 1, out.stderr
