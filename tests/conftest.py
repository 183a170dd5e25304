"""Shared pytest fixtures."""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

NOISE_LINES = (
    "Reporting training result", "TrainingReport(", "core_worker.cc", "has constructor arguments in the object store",
    "Loading weights", "Progress bars disabled", "Writing model shards", "Loading pipeline components",
    "execution finished in", "Requesting resources", "Started training worker group", "Setting up process group",
    "Moving model to device", "Wrapping provided model in DistributedDataParallel", "Started a local Ray instance",
    "Generated new authentication token", "Token authentication is enabled for this Ray cluster",
)
"""Lines of Ray and the libraries that drowned vidray's own in a default run (a new user's trial; `vidray.logs`
says where each comes from and which setting switches it off)."""


def noise_in(output: str) -> list[str]:
    """The lines of `output` holding any of `NOISE_LINES` (a default run must print none)."""
    return [line for line in output.splitlines() if any(noise in line for noise in NOISE_LINES)]


FORKSERVER_PRELOAD = ["torch", "torch.distributed", "vidray.models.registry", "vidray.train.parallel",
                      "vidray.train.checkpoint", "vidray.train.step"]


def start_ranks(fn, args: tuple, nprocs: int) -> None:
    """Run `fn(rank, *args)` in `nprocs` fresh processes and wait for them (torch's `start_processes`).

    The processes come from a forkserver that imported torch, diffusers and vidray's training modules but ran no
    op (no thread), never from the pytest process: forking a process that has run torch ops (OpenMP and gloo
    threads, a heap mid-update) gave a rank `malloc(): unaligned fastbin chunk detected` and SIGABRT in CI. The
    preload keeps a start near a fork's cost (spawn's imports took ~7 s a rank). `fn` must be a module-level
    function.
    """
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")



def join_gloo(rank: int, world_size: int, port: int) -> None:
    """In a rank `start_ranks` started: one torch thread, and the gloo process group of `world_size` ranks on
    127.0.0.1:`port` (`free_port`). The caller destroys it (`dist.destroy_process_group`) when done."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 when asked (another process may take it before the caller binds it)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]

def _repeat_at_once(barrier, results, repeats: int, action, args: tuple) -> None:
    """One process of `run_at_once`: wait for the others at `barrier`, call `action(*args)` `repeats` times and put
    None (all succeeded) or the first error's repr on `results`."""
    barrier.wait(timeout=60)
    for _ in range(repeats):
        try:
            action(*args)
        except Exception as err:  # noqa: BLE001 - reported to the caller
            results.put(repr(err))
            return
    results.put(None)


def at_once_context():
    """The `multiprocessing` context `run_at_once` starts processes with (the preloaded forkserver): make the shared
    objects passed to its action (a `Value`, a `Lock`) with it."""
    import multiprocessing

    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
    return multiprocessing.get_context("forkserver")


def run_at_once(action, *args, repeats: int, processes: int = 3, timeout_s: float = 120) -> list[str]:
    """Start `processes` processes that each call `action(*args)` `repeats` times, released together at a barrier
    once all of them are up (a race between processes, e.g. writers of one file). Returns the problems: each
    process's first error (its repr; that process then stops) and a line for each process that did not report or
    exit 0 within `timeout_s`.

    The processes come from `start_ranks`' forkserver, never a fork of the pytest process, so `action` and `args`
    are pickled: a module-level function, with `args` of paths, numbers or `multiprocessing` objects made by
    `at_once_context()` (a closure cannot travel). Forking the pytest process failed CI (stop 54, two tests,
    "process ... exit code None"): a pytest-xdist worker runs execnet's threads, a fork copies any lock one of
    them holds at that moment, and the child waits on it forever."""
    import queue

    ctx = at_once_context()
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    workers = [ctx.Process(target=_repeat_at_once, args=(barrier, results, repeats, action, args))
               for _ in range(processes)]
    for worker in workers:
        worker.start()
    problems, deadline = [], time.monotonic() + timeout_s
    for _ in workers:
        try:
            problem = results.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if problem is not None:
            problems.append(problem)
    for worker in workers:
        worker.join(timeout=max(1.0, deadline - time.monotonic()))
        if worker.exitcode != 0:
            worker.kill()
            worker.join(timeout=10)
            problems.append(f"process {worker.pid} exit code {worker.exitcode}")
    return problems


def guided_prompts(family, components, max_sequence_length: int):
    """(prompt_embeds, mask, negative_prompt_embeds, negative_mask) of the batch ["a red ball", "waves"] with the
    negatives ["", "blurry"], encoded by `family` with `components`' text encoder: the two guided requests the
    image-to-video parity tests sample."""
    embeds, mask = family.encode_prompt(components.text_encoder, components.tokenizer, ["a red ball", "waves"],
                                        max_sequence_length=max_sequence_length)
    negative, negative_mask = family.encode_prompt(components.text_encoder, components.tokenizer, ["", "blurry"],
                                                   max_sequence_length=max_sequence_length)
    return embeds, mask, negative, negative_mask


def takes_image(family, transformer) -> bool:
    """Whether `transformer` is an image-to-video model: `family.condition` gives it a (here empty) condition."""
    return family.condition(transformer, latent_shape=(1, family.latent_channels, 1, 2, 2)) is not None


def clip_condition(family, model_cfg, encoders, video, condition: str = "first"):
    """`family.condition` of a training clip `video` (B, 3, F, H, W) for `model_cfg` with `model.i2v.condition`
    set to `condition` (what the encode stage computes): an `ImageCondition`."""
    model_cfg = dataclasses.replace(model_cfg, i2v=dataclasses.replace(model_cfg.i2v, condition=condition))
    return family.condition(model_cfg, encoders=encoders, clip=video)


@pytest.fixture(scope="session")
def samples_dir() -> Path:
    """The repo's `samples/` folder: six small real clips/stills and their EasyAnimate `metadata.json`."""
    return REPO_ROOT / "samples"


@pytest.fixture(scope="session")
def real_data_dir() -> Path:
    """The shared folder of eleven real media files (`$VIDRAY_REAL_DATA`, else `<repo>/../shared/data/real`);
    skips the test when it is absent."""
    path = Path(os.environ.get("VIDRAY_REAL_DATA") or REPO_ROOT.parent / "shared" / "data" / "real")
    if not (path / "SOURCES.md").is_file():
        pytest.skip(f"real media folder {path} not found; the rest of the suite runs on samples/")
    return path


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server (moto's standalone server) on 127.0.0.1 at a free port, with the bucket
    `vidray-test`. Yields its endpoint URL (`http://127.0.0.1:PORT`); stopped by PID at the end. Tests point
    vidray at it with `s3_env`."""
    import re
    import subprocess
    import sys
    import time

    moto_server = Path(sys.executable).with_name("moto_server")
    if not moto_server.is_file():
        pytest.skip("moto[server] is not installed (pip install -e '.[dev]')")
    proc = subprocess.Popen([str(moto_server), "-H", "127.0.0.1", "-p", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    endpoint = None
    deadline = time.monotonic() + 30
    while endpoint is None and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        if m := re.search(r"Running on (http://127\.0\.0\.1:\d+)", line):
            endpoint = m.group(1)
    if endpoint is None:
        proc.kill()
        pytest.fail("moto_server did not report its port within 30 s")
    import threading

    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # drain its log
    import pyarrow.fs as pafs

    fs = pafs.S3FileSystem(access_key="testing", secret_key="testing", region="us-east-1", scheme="http",
                           endpoint_override=endpoint.split("://", 1)[1], allow_bucket_creation=True)
    fs.create_dir("vidray-test")
    try:
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def s3_env(s3_server):
    """The AWS environment variables that send vidray's `s3://` URIs to `s3_server` (set for the test module,
    restored after it); yields the endpoint."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {"AWS_ENDPOINT_URL": s3_server, "AWS_ACCESS_KEY_ID": "testing",
                           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
            mp.setenv(key, value)
        mp.delenv("AWS_ENDPOINT_URL_S3", raising=False)
        yield s3_server


@pytest.fixture(scope="session")
def tiny_serve_model_dir(tmp_path_factory) -> Path:
    """The tiny random EasyAnimate model (`tiny_random` text encoder, 16 tokens) exported as a diffusers folder
    with its job file (bucket 9x64x48, flow shift 3): what `serve/` loads. Built once per session."""
    from vidray.config import FlowConfig, ModelConfig, job_config_from_dict
    from vidray.models import get_family
    from vidray.models.export import write_job_file

    family = get_family("easyanimate")
    components = family.build(ModelConfig(text_encoder="tiny_random", max_sequence_length=16), seed=0)
    out = family.save_pipeline(components, tmp_path_factory.mktemp("m") / "diffusers", FlowConfig(shift=3.0))
    write_job_file(out, job_config_from_dict({"name": "t", "model": {"text_encoder": "tiny_random",
                                                                     "max_sequence_length": 16},
                                              "data": {"buckets": [[9, 64, 48]]}}))
    return out


def assert_same_training_state(checkpoint: str | Path, reference: str | Path) -> None:
    """Exact resume: the transformer weights, every optimizer state tensor (AdamW's step, exp_avg, exp_avg_sq;
    every DCP entry of a sharded checkpoint) and the lr scheduler of `checkpoint` are bitwise equal (`torch.equal`,
    same dtype) to the `reference` checkpoint's (the uninterrupted run at the same step, same world size: fp32 on
    CPU, fixed threads)."""
    import torch
    from safetensors.torch import load_file

    def same(a, b, where: str) -> None:
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), where
            assert a.dtype == b.dtype and torch.equal(a, b), (
                f"{where} differs: max |diff| {(a.double() - b.double()).abs().max().item():.3g}")
        elif isinstance(a, dict):
            assert isinstance(b, dict) and a.keys() == b.keys(), where
            for key in a:
                same(a[key], b[key], f"{where}.{key}")
        elif isinstance(a, (list, tuple)):
            assert isinstance(b, (list, tuple)) and len(a) == len(b), where
            for i, (x, y) in enumerate(zip(a, b)):
                same(x, y, f"{where}[{i}]")
        else:
            assert a == b, (where, a, b)

    checkpoint, reference = Path(checkpoint), Path(reference)
    if (checkpoint / "dcp").is_dir():  # a sharded checkpoint (FSDP, or two expert groups): every entry of every rank
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

        with warnings.catch_warnings():  # read in this one process, without a process group
            warnings.filterwarnings("ignore", message=r"torch.distributed is .*uninitialized")
            same(*(_load_state_dict_from_keys(storage_reader=FileSystemReader(str(c / "dcp")))
                   for c in (checkpoint, reference)), "dcp")
    else:
        same(load_file(checkpoint / "transformer.safetensors"), load_file(reference / "transformer.safetensors"),
             "transformer")
        same(torch.load(checkpoint / "optimizer.pt", weights_only=True),
             torch.load(reference / "optimizer.pt", weights_only=True), "optimizer.pt")
    # LambdaLR's `_step_count` counts step() calls on this scheduler object (for its call-order warning); a resumed
    # run rebuilds the scheduler at the checkpoint's step (`vidray.train.optim.apply_optim_config`), so it differs
    # and is no training state. Everything else (last_epoch, base_lrs, _last_lr) must be equal.
    schedulers = [{k: v for k, v in torch.load(c / "lr_scheduler.pt", weights_only=True).items() if k != "_step_count"}
                  for c in (checkpoint, reference)]
    same(*schedulers, "lr_scheduler.pt")


@pytest.fixture(scope="session")
def shards_dir(tmp_path_factory):
    """The shipped clips prepared with the tiny job's buckets, 4 samples per shard: once per session, shared by
    every module that only reads it (no test writes into it; the latent cache under it, `data.latent_cache: auto`,
    fills with the first run and serves the rest), so the session's reference run (`uninterrupted_run`) is
    trained once for all of them. The unit tests of the in-process loop use it too (`tests/unit/test_worker.py`)."""
    from vidray.config import load_job_config
    from vidray.data.ingest import prepare

    out = tmp_path_factory.mktemp("shards")
    summary = prepare(REPO_ROOT / "samples" / "metadata.json", out, buckets=load_job_config(
        REPO_ROOT / "jobs/configs/tiny_t2v.yaml").data.buckets, fps=8.0, samples_per_shard=4)
    assert summary.num_kept >= 4
    return out
