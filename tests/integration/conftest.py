"""Fixtures that start real Ray clusters on 127.0.0.1 and end exactly the processes they started, by PID."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from vidray.runtime import CLIENT_ENV, apply_ray_env_defaults

# The integration tests import these from here too.
from tests.conftest import assert_same_training_state, free_port  # noqa: F401

REPO = Path(__file__).resolve().parents[2]


def pids_mentioning(marker: str) -> list[int]:
    """PIDs of live processes (this one aside) whose command line contains `marker` (our unique temp dir), or that
    hold a file open under it: Ray's agents and workers retitle themselves (`ray::DashboardAgent`) but keep their
    log files in the session's `logs/` open. A node that Ray's fake autoscaler provider starts inside the monitor
    (`test_autoscaler.py`) leaves such agents behind, reparented and deaf to SIGTERM, when its raylet is killed."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline or _holds_file_under(entry, marker):
            pids.append(int(entry.name))
    return pids


def _holds_file_under(proc: Path, marker: str) -> bool:
    try:
        fds = list((proc / "fd").iterdir())
    except OSError:  # gone, or not ours to read
        return False
    inside = marker.rstrip("/") + "/"
    for fd in fds:
        try:
            if os.readlink(fd).startswith(inside):
                return True
        except OSError:
            continue
    return False


def end_processes_under(marker: str, attempts: int = 20) -> None:
    """SIGKILL, by PID, every process `pids_mentioning(marker)` finds (`marker`: the temp or session folder of a
    Ray cluster this test process started, so only that cluster's processes), until none is left or `attempts`
    half-second rounds have passed. A worker outlives its killed raylet now and then (a `ray::TrainController`
    reparented to init was seen after a module's `ray.shutdown()`)."""
    for _ in range(attempts):
        leftovers = pids_mentioning(marker)
        if not leftovers:
            return
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)


def _session_dir() -> str:
    """The session folder of the Ray this process is connected to (`/tmp/ray/session_<date>_<pid>`)."""
    import ray

    return ray._private.worker._global_node.get_session_dir_path()


def ray_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({k: env.get(k, v) for k, v in CLIENT_ENV.items()})
    # The job's `python` is the one on the head node's PATH: this venv's.
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def init_ray_without_dashboard(num_cpus: int = 4) -> bool:
    """`vidray.runtime.init_ray(num_cpus=...)` (a new local cluster on 127.0.0.1 as vidray starts it; True when it
    started one) without Ray's dashboard: its head process and the ~10 module processes it starts in Ray 2.60.
    Nothing vidray runs asks the dashboard (its jobs, state and metrics APIs); the tests that do (`ray job`, state
    listings) start their own head. Measured on 2 cores: Ray up in 3 s instead of 5, a warm 3-step run 20 s instead
    of 22-24 s, test_train.py 291 s -> 248 s (the dashboard's processes take CPU from the run's).

    What this leaves out: Ray Train's PlacementGroupCleaner asks the State API (the dashboard) every second whether
    the controller lives, to remove the run's placement group should the controller die; here it cannot, logs
    "Failed to query Ray Train Controller actor state" each second of a run, and is stopped with the run as usual.
    No test of these modules kills a controller; `vidray train` (the CLI tests) keeps the dashboard."""
    import ray

    from vidray.runtime import init_ray

    apply_ray_env_defaults()
    real_init = ray.init

    def init_without_dashboard(*args, **kwargs):
        return real_init(*args, **{**kwargs, "include_dashboard": False})

    ray.init = init_without_dashboard
    try:
        return init_ray(num_cpus=num_cpus)
    finally:
        ray.init = real_init


@pytest.fixture(scope="module")
def local_ray():
    """A module-scoped local Ray (in-process driver, 4 logical CPUs, listeners on 127.0.0.1, no dashboard:
    `init_ray_without_dashboard`)."""
    import ray

    started = init_ray_without_dashboard(num_cpus=4)
    session_dir = _session_dir() if started else None
    yield ray
    if started:
        ray.shutdown()
        end_processes_under(session_dir)



SERVE_BUCKET = [5, 32, 32]
"""(num_frames, height, width) the serve tests' model records as its training bucket."""


@pytest.fixture(scope="module")
def exported_model(tmp_path_factory):
    """A tiny random EasyAnimate model exported as training exports a run (diffusers + vidray_job.yaml), trained
    at `SERVE_BUCKET`: what the serve tests serve."""
    from vidray.config import FlowConfig, ModelConfig, job_config_from_dict
    from vidray.models import get_family
    from vidray.models.export import write_job_file

    family = get_family("easyanimate")
    components = family.build(ModelConfig(text_encoder="tiny_random", max_sequence_length=16), seed=0)
    out_dir = family.save_pipeline(components, tmp_path_factory.mktemp("model") / "diffusers", FlowConfig(shift=3.0))
    write_job_file(out_dir, job_config_from_dict({
        "name": "tiny-serve", "model": {"text_encoder": "tiny_random", "max_sequence_length": 16},
        "data": {"buckets": [SERVE_BUCKET]}, "flow": {"shift": 3.0},
    }))
    return out_dir


@contextlib.contextmanager
def loopback_cluster(nodes: list[dict], *, system_config: dict | None = None):
    """A simulated multi-node Ray cluster (`ray.cluster_utils.Cluster`) on 127.0.0.1 with this process joined to
    it: a head of 0 CPUs (the driver's side: Ray Train's controller, Ray Data's coordinator) and one worker node
    per entry of `nodes` (`Cluster.add_node` keyword arguments, e.g. {"num_cpus": 2, "labels": {...}}). Yields
    (cluster, [node handles]); shut down by the Cluster's own process handles at the end."""
    apply_ray_env_defaults()  # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before ray is imported: loopback only
    import ray
    from ray.cluster_utils import Cluster

    head_args = {"num_cpus": 0, "node_ip_address": "127.0.0.1"}
    if system_config is not None:
        head_args["_system_config"] = system_config
    cluster = Cluster(initialize_head=True, head_node_args=head_args)
    session_dir = None
    try:
        handles = [cluster.add_node(node_ip_address="127.0.0.1", **node) for node in nodes]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        session_dir = _session_dir()
        yield cluster, handles
    finally:
        ray.shutdown()
        cluster.shutdown()
        if session_dir is not None:
            end_processes_under(session_dir)


REFERENCE_STEPS = 40
"""Steps of the uninterrupted reference run (`uninterrupted_run`)."""
REFERENCE_CHECKPOINT_EVERY = 3
"""The reference run keeps every checkpoint: steps 3, 6, 9, ..., 39 and 40 (what resumed runs end at)."""
_UNINTERRUPTED: dict[str, tuple[dict[int, float], Path]] = {}


def uninterrupted_losses(shards_dir: Path) -> dict[int, float]:
    """{step: loss} of `uninterrupted_run(shards_dir)`."""
    return uninterrupted_run(shards_dir)[0]


def uninterrupted_run(shards_dir: Path) -> tuple[dict[int, float], Path]:
    """({step: loss} for steps 1..`REFERENCE_STEPS`, its run folder holding `checkpoint_<step>` every
    `REFERENCE_CHECKPOINT_EVERY` steps and at the last) of the tiny job (2 workers, `tiny_random` text encoder, seed 0,
    `jobs/configs/tiny_t2v.yaml`'s optimizer) trained straight through on `shards_dir`: the run that a resumed run,
    a run whose worker or driver was killed and a run killed during a checkpoint must match (`test_train.py`,
    `test_checkpoint_faults.py`, `test_driver_restart.py`). It trains in the Ray this process has initialized (the
    calling test's), else in a local Ray started for it and shut down after. The folder lives until the pytest
    process exits.

    Run once per pytest session and prepared folder, keyed by `index.json`'s content_hash (the shards' bytes:
    libx264 does not always encode a clip to the same bytes twice, so another module's `shards_dir` needs its own).
    A step's loss does not depend on `train.max_steps` (10 warmup steps, then a constant lr), the checkpoint
    cadence or the logging, so one 40-step run serves tests that train 6, 9 or 40 steps with other cadences.
    """
    import atexit
    import shutil

    import ray

    from vidray.config import load_job_config
    from vidray.data.shards import read_index
    from vidray.train.trainer import run_training

    key = read_index(shards_dir)["content_hash"]
    if key not in _UNINTERRUPTED:
        storage = tempfile.mkdtemp(prefix="vidray-reference-")
        atexit.register(shutil.rmtree, storage, ignore_errors=True)
        job = load_job_config(REPO / "jobs/configs/tiny_t2v.yaml", [
            f"data.shards_dir={shards_dir}", f"storage.path={storage}", "name=reference",
            "model.text_encoder=tiny_random", f"train.max_steps={REFERENCE_STEPS}",
            f"train.log_every_steps={REFERENCE_STEPS}", f"checkpoint.every_steps={REFERENCE_CHECKPOINT_EVERY}",
            "checkpoint.num_to_keep=null"])
        own_ray = not ray.is_initialized()
        if own_ray:
            init_ray_without_dashboard(num_cpus=4)
        try:
            result = run_training(job)
        finally:
            if own_ray:
                ray.shutdown()
        losses = {int(step): float(loss) for step, loss in result.losses}
        assert sorted(losses) == list(range(1, REFERENCE_STEPS + 1)), sorted(losses)
        _UNINTERRUPTED[key] = (losses, Path(result.run_dir))
    return _UNINTERRUPTED[key]


class RayHead:
    """A `ray start --head --block` child process with its own ports and temp dir.

    `autoscaling_config`: a function of the head's GCS address (`127.0.0.1:<port>`) that returns a cluster config;
    the head then starts Ray's autoscaler with it (`--autoscaling-config=<temp_dir>/autoscaling.yaml`)."""

    def __init__(self, tmp_root: str, extra_env: dict[str, str] | None = None, labels: dict[str, str] | None = None,
                 num_cpus: int = 4, autoscaling_config: Callable[[str], dict[str, Any]] | None = None):
        self.temp_dir = tmp_root
        self.gcs_port = free_port()
        self.dashboard_port = free_port()
        self.dashboard_url = f"http://127.0.0.1:{self.dashboard_port}"
        self.metrics_port = free_port()
        """The node's Prometheus endpoint (`--metrics-export-port`): http://127.0.0.1:<metrics_port>/metrics."""
        # On SIGTERM `ray start --block` (Ray 2.60) first drains its node for up to 30 s, waiting for leases to be
        # returned so that Serve can move traffic off it; after a training job that wait ran out every time and
        # took 32 s of this fixture's teardown. These heads are stopped at the end of a test: no draining.
        self.env = {**ray_env(), "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", **(extra_env or {})}
        cmd = [
            str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
            "--node-ip-address=127.0.0.1", f"--port={self.gcs_port}",
            "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}",
            f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
            f"--metrics-export-port={self.metrics_port}", f"--runtime-env-agent-port={free_port()}",
            f"--num-cpus={num_cpus}", f"--temp-dir={self.temp_dir}", "--disable-usage-stats",
        ]
        if autoscaling_config:
            import yaml

            config_path = Path(self.temp_dir) / "autoscaling.yaml"
            config_path.write_text(yaml.safe_dump(autoscaling_config(f"127.0.0.1:{self.gcs_port}")))
            cmd.append(f"--autoscaling-config={config_path}")
        if labels:
            cmd.append("--labels=" + ",".join(f"{k}={v}" for k, v in labels.items()))
        # As docs/cluster.md does: `ray start --head` under RAY_AUTH_MODE=token needs a token and does not write one
        # (a local `ray.init()` does, so on a machine that has run one the file is already there and is kept).
        subprocess.run([str(Path(sys.executable).parent / "ray"), "get-auth-token", "--generate"], env=self.env,
                       capture_output=True, check=True, timeout=60)
        self.log = open(Path(self.temp_dir) / "ray_start.log", "w")
        self.process = subprocess.Popen(cmd, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 90) -> None:
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RayHeadExitedEarly(f"ray start exited early: {Path(self.log.name).read_text()[-3000:]}")
            try:
                urllib.request.urlopen(f"{self.dashboard_url}/api/version", timeout=2)
                return
            except urllib.error.HTTPError:
                return  # 401 without a token: the dashboard is up
            except (urllib.error.URLError, OSError):
                time.sleep(1)
        raise TimeoutError(f"Ray head not ready after {timeout_s} s: {Path(self.log.name).read_text()[-3000:]}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # ray start --block then kills its own children
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        # Anything still alive that runs under our temp dir was started by this head: end it by PID.
        end_processes_under(self.temp_dir)
        self.log.close()


class RayHeadExitedEarly(RuntimeError):
    """`ray start --head` ended before its dashboard answered."""


def start_ray_head(prefix: str, extra_env: dict[str, str] | None = None, attempts: int = 2,
                   labels: dict[str, str] | None = None, num_cpus: int = 4,
                   autoscaling_config: Callable[[str], dict[str, Any]] | None = None) -> RayHead:
    """A ready `RayHead` in a new temp dir under `prefix` (short: Ray's socket paths are length-limited). A head
    that exits early is started again once, on new ports: `free_port` hands out a port that is free when asked,
    and another process can take it before Ray binds it (the suite saw one such early exit, right after a busy
    Serve test). The first failure's log is printed to stderr. Other failures are raised at once."""
    for attempt in range(1, attempts + 1):
        head = RayHead(tempfile.mkdtemp(prefix=prefix), extra_env=extra_env, labels=labels, num_cpus=num_cpus,
                       autoscaling_config=autoscaling_config)
        try:
            head.wait_ready()
            return head
        except RayHeadExitedEarly as err:
            head.stop()
            if attempt == attempts:
                raise
            print(f"[tests] {err}; starting the head again on other ports", file=sys.stderr, flush=True)
        except BaseException:
            head.stop()
            raise
    raise AssertionError("unreachable")


@pytest.fixture
def ray_head():
    """A Ray head node started with `ray start --head` on 127.0.0.1, labeled `vidray.io/stage=dit` (what a DiT node
    of a labeled cluster carries), stopped by PID at the end of the test."""
    head = start_ray_head("/tmp/vrh", labels={"vidray.io/stage": "dit"})
    try:
        yield head
    finally:
        head.stop()
