"""`vidray doctor [CONFIG [overrides]]`: what this machine, a job config and the Ray cluster it would run on say
about a run, before it is started (the operations plane of `../shared/DESIGN.md`).

Every check calls the code the real commands run (`vidray.train.trainer.check_job_inputs`, `check_resources`,
`vidray.placement.resolve_placement`, `vidray.data.fill_cache.check_encode_resources`), so what the doctor reports is
what `vidray train` would do or refuse, without reserving anything or training:

- environment: Python, torch (CUDA devices, NCCL / gloo), Ray (against the version `pyproject.toml` pins),
  diffusers, transformers, PyAV with the H.264 decoder and the libx264 encoder vidray writes clips with, the
  CPU count and memory, Ray's token for CLI clients;
- the job (with CONFIG): the config and overrides, `data.source` (its listed files that are missing; the source
  the shards were prepared from when it is another file), the prepared shards in `data.shards_dir` (or
  that `prepare` has not run), `storage.path`, `data.latent_cache`, and where `train` would start (step 1, or the
  checkpoint it resumes from; or why it would refuse, e.g. another driver training the run now); before any shard
  exists, `train`'s checks that need none (`vidray.train.trainer.check_job_settings`: the text encoder's limit,
  the validation prompts' token counts, `model.vae_path`);
- the cluster: with `RAY_ADDRESS`, it joins the cluster (no resources reserved; an address where nothing answers,
  or the dashboard's URL, is a FAIL at once: `vidray.runtime.check_ray_address`) and checks its nodes, labels and
  resources (the autoscaler's limit included) against the job; without it, the local cluster `vidray train`
  would start here. On a cluster with GPUs, a GPU job's predicted per-GPU memory (`vidray.train.plan`): FAIL,
  naming the strategy that fits, when its own is predicted not to.

Each finding is one line, `ok`, `warn` or `FAIL`, with the fix for the last two. `check_environment`, `check_job` and
`check_cluster` return them; the CLI (`vidray.cli.cmd_doctor`) prints them and exits 1 when any is `FAIL`. With
`--measure` it adds what `vidray.doctor_measure.measure` measures with the job's workers on the cluster (all-reduce
bandwidth, the object store's transfer rate, one simulated training step).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import logging
import os
import platform
from dataclasses import dataclass
from typing import Any, Callable, Literal

from vidray.data.fill_cache import check_encode_resources
from vidray.errors import UserError, UserFileNotFound
from vidray.locations import is_uri
from vidray.placement import STAGES, PlacementError, alive_nodes, expert_selectors, resolve_placement
from vidray.runtime import (
    LOCAL_RAY,
    apply_ray_env_defaults,
    autoscaler_max_resources,
    check_ray_address,
    local_cluster_resources,
    will_start_local_ray,
)

__all__ = ["Finding", "check_cluster", "check_environment", "check_job"]

Level = Literal["ok", "warn", "fail"]


@dataclass(frozen=True)
class Finding:
    """One line of the doctor's report: `level` (`ok`, `warn`, `fail`), the `topic` it is about (a setting, a
    library, `cluster`) and the `message`, which for `warn` and `fail` says what to do."""

    level: Level
    topic: str
    message: str

    def __str__(self) -> str:
        return f"{'FAIL' if self.level == 'fail' else self.level:<4}  {self.topic}: {self.message}"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _pinned_ray() -> str | None:
    """The Ray version `pyproject.toml` pins (`ray[...]==X`), read from the installed vidray's metadata."""
    for requirement in importlib.metadata.requires("vidray") or []:
        name, _, rest = requirement.partition("==")
        if name.split("[")[0].strip() == "ray" and rest:
            return rest.split(";")[0].strip()
    return None


def _captured(check: Callable[[], Any]) -> tuple[Any, list[str]]:
    """Run `check`, returning (its result, the `[vidray] ...` lines it printed) so they can be reported."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = check()
    lines = [line.removeprefix("[vidray] ").strip() for line in out.getvalue().splitlines() if line.strip()]
    return result, lines


def check_environment() -> list[Finding]:
    """The libraries and hardware a run uses (module docstring). Never raises."""
    found: list[Finding] = [Finding("ok", "python", f"{platform.python_version()} ({platform.machine()}), "
                                    f"{os.cpu_count()} CPU(s), {_memory_gib():.1f} GiB memory")]
    import torch  # heavy: torch, numpy
    import torch.distributed as dist  # heavy: torch, numpy

    backends = [name for name, ok in (("nccl", dist.is_nccl_available()), ("gloo", dist.is_gloo_available())) if ok]
    if torch.cuda.is_available():
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        found.append(Finding("ok", "torch", f"{torch.__version__}, {torch.cuda.device_count()} CUDA device(s) "
                             f"({', '.join(names)}), backends {', '.join(backends) or 'none'}"))
        if "nccl" not in backends:
            found.append(Finding("warn", "torch", "NCCL is not available: multi-GPU training falls back to gloo "
                                 "(slow); install a CUDA build of torch (docs/getting-started.md, 'Installing torch')"))
    else:
        found.append(Finding("ok", "torch", f"{torch.__version__}, no CUDA device: training uses gloo on CPU "
                             f"(scaling.use_gpu must be false here), backends {', '.join(backends) or 'none'}"))
    ray_version, pinned = _version("ray"), _pinned_ray()
    if pinned and ray_version != pinned:
        found.append(Finding("warn", "ray", f"{ray_version} installed, vidray pins {pinned}: its Ray workarounds "
                             f"(../shared/NOTES.md) are measured on {pinned}; `make install` installs it"))
    else:
        found.append(Finding("ok", "ray", str(ray_version)))
    found.append(Finding("ok", "diffusers", f"{_version('diffusers')}, transformers {_version('transformers')}"))
    found.extend(_check_pyav())
    found.extend(_check_ray_token())
    return found


def _check_ray_token() -> list[Finding]:
    """With `RAY_ADDRESS` and `RAY_AUTH_MODE=token`, where this client's token comes from (Ray's order:
    `RAY_AUTH_TOKEN`, `RAY_AUTH_TOKEN_PATH`, `~/.ray/auth_token`), or a warning that there is none."""
    if not os.environ.get("RAY_ADDRESS") or os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return []
    if os.environ.get("RAY_AUTH_TOKEN"):
        return [Finding("ok", "ray auth", "RAY_AUTH_MODE=token, token from RAY_AUTH_TOKEN")]
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    if os.path.isfile(path):
        return [Finding("ok", "ray auth", f"RAY_AUTH_MODE=token, token from {path}")]
    return [Finding("warn", "ray auth", f"RAY_AUTH_MODE=token but there is no token ({path} does not exist, "
                    "RAY_AUTH_TOKEN is unset): copy the token of the cluster's head there; a head started without "
                    "RAY_AUTH_MODE=token has none, and then this client must unset RAY_AUTH_MODE")]


def _memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return float("nan")


def _check_pyav() -> list[Finding]:
    try:
        import av  # heavy: av
    except ImportError as err:
        return [Finding("fail", "av", f"PyAV does not import ({err}): `make install` installs it")]
    missing = []
    for name, mode, use in (("h264", "r", "decode the shards' clips"), ("libx264", "w", "write clips and videos")):
        try:
            av.codec.Codec(name, mode)
        except Exception:  # noqa: BLE001 - av.codec.codec.UnknownCodecError and friends
            missing.append(f"{name} ({'decoder' if mode == 'r' else 'encoder'}, to {use})")
    if missing:
        return [Finding("fail", "av", f"PyAV {av.__version__} lacks {', '.join(missing)}: install the PyAV wheel "
                        "from PyPI (it bundles FFmpeg with them)")]
    return [Finding("ok", "av", f"{av.__version__}, FFmpeg with the h264 decoder and the libx264 encoder")]


def check_job(job: Any) -> list[Finding]:
    """The job's inputs and outputs, as `vidray prepare` and `vidray train` would find them (module docstring).
    Writes nothing, except that trying the run folder's lock (`run_folder_lock`) creates a missing local
    `storage.path` folder (the run folder in it is removed again), and that an object-store `storage.path` or
    `data.latent_cache` gets an empty probe object written and deleted (`Storage.check_reachable`). Never raises:
    an object store that does not answer is a FAIL line."""
    from vidray.data.ingest import read_source  # heavy: pyarrow, av, PIL
    from vidray.data.shards import INDEX_NAME, read_index  # heavy: pyarrow, av, PIL
    from vidray.storage import open_storage  # heavy: pyarrow, numpy
    from vidray.train.trainer import (  # heavy: pyarrow, numpy, pydantic
        check_job_inputs,
        check_job_settings,
        run_folder_lock,
    )

    found = [Finding("ok", "config", f"job {job.name!r}: {job.model.family} ({job.model.init}, text encoder "
                     f"{job.model.text_encoder}), {len(job.data.buckets)} bucket(s), scaling.num_workers="
                     f"{job.scaling.num_workers}, train.max_steps={job.train.max_steps}")]
    reachable = True
    try:
        shards = open_storage(job.data.shards_dir)
        shards.check_reachable("data.shards_dir")
        prepared = shards.is_file(INDEX_NAME)
    except (UserError, OSError) as err:  # an S3 endpoint that does not answer, a missing bucket, a bad URI
        found.append(Finding("fail", "data.shards_dir", str(err)))
        reachable = prepared = False
    try:
        items = read_source(job.data.source)
        missing = [str(it.file_path) for it in items if not is_uri(str(it.file_path)) and not it.file_path.exists()]
        if missing:
            found.append(Finding("warn", "data.source", f"{job.data.source}: {len(items)} file(s) listed, "
                                 f"{len(missing)} missing (e.g. {missing[0]}): `vidray prepare` skips and reports "
                                 "them; fix the paths to keep them"))
        else:
            found.append(Finding("ok", "data.source", f"{job.data.source}: {len(items)} file(s) listed"))
    except UserError as err:
        note = " (the shards are prepared already: only a new prepare needs it)" if prepared else ""
        found.append(Finding("warn" if prepared else "fail", "data.source", f"{err}{note}"))
    if reachable and not prepared:  # an unreachable store has its FAIL line already
        found.append(Finding("warn", "data.shards_dir", f"{job.data.shards_dir} holds no prepared shards (no "
                             f"{INDEX_NAME}): run `vidray prepare CONFIG` (or `vidray train --prepare`)"))
    if prepared:
        found.extend(_check_prepared_source(job))
        try:
            index = read_index(shards)
            found.append(Finding("ok", "data.shards_dir", f"{job.data.shards_dir}: {index['num_samples']} "
                                 f"sample(s) in {len(index['shards'])} shard(s), buckets {index['buckets']}"))
        except UserError as err:
            found.append(Finding("fail", "data.shards_dir", str(err)))
            prepared = False
    outputs = _check_outputs(job)
    found.extend(outputs)
    if any(f.level == "fail" for f in outputs):
        return found  # `vidray train` stops at the same check first
    try:  # a driver training this run now: `vidray train` would be refused at once
        with run_folder_lock(job):
            pass
    except UserError as err:
        return [*found, Finding("fail", "train", f"`vidray train` would refuse: {err}")]
    if prepared:
        try:
            plan, lines = _captured(lambda: check_job_inputs(job))
            if plan.checkpoint is None and not lines:
                lines = ["`vidray train` starts at step 1"]
            found.append(Finding("ok", "train", "; ".join(lines)))  # train's own lines: where it resumes, changes
        except UserFileNotFound as err:
            found.append(Finding("fail", "train", str(err)))
        except UserError as err:
            found.append(Finding("fail", "train", f"`vidray train` would refuse: {err}"))
        except OSError as err:  # the store failed between the checks above and this one
            found.append(Finding("fail", "train", f"reading the run's checkpoints or shards failed: {err}"))
    else:  # no shards yet: what needs none (the text encoder's limit, the validation prompts, model.vae_path)
        try:
            _captured(lambda: check_job_settings(job))
            found.append(Finding("ok", "train", "the model, its max_sequence_length, the validation prompts and "
                                 "model.vae_path pass `vidray train`'s checks (the shards' own wait for `vidray "
                                 "prepare`)"))
        except UserError as err:
            found.append(Finding("fail", "train", f"`vidray train` would refuse: {err}"))
    return found


def _check_prepared_source(job: Any) -> list[Finding]:
    """A warning when the committed prepare of `data.shards_dir` read another source list than `data.source`
    (`vidray train` trains on the shards as they are). Reports that record the list's sha256
    (`source_list_sha256`) compare its bytes: the same list at another path (a `ray job submit` working dir
    copy) is no warning, and the same path edited since is one. Older reports compare real paths. Local files
    only."""
    from vidray.data.shards import read_report  # heavy: pyarrow, av, PIL
    from vidray.models.export import file_sha256  # heavy: pydantic

    try:
        report = read_report(job.data.shards_dir)
    except UserError:
        return []  # an old prepare without a report: nothing to compare
    prepared_from, prepared_sha = report.get("source"), report.get("source_list_sha256")
    source = str(job.data.source)
    if not prepared_from or is_uri(prepared_from) or is_uri(source):
        return []
    same_path = os.path.realpath(prepared_from) == os.path.realpath(source)
    if prepared_sha:
        try:
            if file_sha256(source) == prepared_sha:
                return []
        except OSError:
            return []  # data.source's own line says it cannot be read
        if same_path:
            return [Finding("warn", "data.source", f"{source} changed since the shards in {job.data.shards_dir} "
                            "were prepared from it: `vidray train` trains on the shards as they are; run `vidray "
                            "prepare` to train on its files now")]
    elif same_path:
        return []
    return [Finding("warn", "data.source", f"the shards in {job.data.shards_dir} were prepared from {prepared_from}, "
                    f"not {source}: `vidray train` trains on the shards as they are; run `vidray prepare` "
                    "to train on data.source's files")]


def _check_outputs(job: Any) -> list[Finding]:
    """`storage.path` and `data.latent_cache` writable: what `check_job_inputs` checks first
    (`vidray.data.outputs.check_output_location`), one line per location."""
    from vidray.data.outputs import check_output_location  # heavy: pyarrow, numpy, pydantic
    from vidray.train.trainer import output_locations  # heavy: pyarrow, numpy, pydantic

    found = []
    for key, path in output_locations(job):
        try:
            check_output_location(key, path)
            how = "the store answers, the bucket exists, a probe object was written and deleted" if is_uri(path) \
                else "writable"
            found.append(Finding("ok", key, f"{path}: {how}"))
        except (UserError, OSError) as err:
            found.append(Finding("fail", key, str(err)))
    return found


def check_cluster(job: Any | None) -> list[Finding]:
    """The Ray cluster a run would use: joined (`RAY_ADDRESS`; nothing is reserved, and this process leaves it
    again) or the local one `vidray train` would start; with a job, its resources and stage placement."""
    import ray  # heavy: ray

    from vidray.data.outputs import latent_cache_root  # heavy: pyarrow, numpy, pydantic
    from vidray.train.trainer import check_resources  # heavy: pyarrow, numpy, pydantic

    found: list[Finding] = []
    if will_start_local_ray():
        resources = local_cluster_resources()
        found.append(Finding("ok", "cluster", f"no RAY_ADDRESS: `vidray train` starts a local Ray cluster with "
                             f"{resources['CPU']:g} CPUs and {resources['GPU']:g} GPUs, on 127.0.0.1"))
        if job is not None:
            found.extend(_resource_findings(job, resources, None, LOCAL_RAY, check_resources,
                                            check_encode_resources if latent_cache_root(job) else None))
            found.extend(_memory_findings(job, resources, local=True))
            if any(getattr(job.placement, s).label_selector for s in STAGES) or any(expert_selectors(job).values()):
                found.append(Finding("ok", "placement", "the local node has no vidray labels: every stage runs on "
                                     "it, its label_selector dropped (`vidray.placement`)"))
        return found
    address = os.environ.get("RAY_ADDRESS") or "the Ray this process is connected to"
    try:
        if ray.is_initialized():
            started = False
        else:  # joined quietly: Ray's INFO lines would break the one-line-per-check report
            check_ray_address(address)  # else ray.init retries a dead address for ever, deaf to Ctrl-C
            apply_ray_env_defaults()
            ray.init(logging_level=logging.WARNING, log_to_driver=False)
            started = True
    except UserError as err:
        return [Finding("fail", "cluster", str(err))]
    except Exception as err:  # noqa: BLE001 - ConnectionError, auth errors, ...: reported, not raised
        text = _one_line(str(err)).rstrip(". ")
        if "authentication" in f"{type(err).__name__} {text}".lower():
            fix = ("The cluster and this client must agree on Ray's token auth: a head started with "
                   "RAY_AUTH_MODE=token needs the same token here (~/.ray/auth_token, or RAY_AUTH_TOKEN); a head "
                   "started without it has no token: then unset RAY_AUTH_MODE here (docs/cluster.md, 'Token "
                   "authentication')")
        elif address.startswith("ray://") and "client server" in text.lower():  # seen under load, intermittent
            fix = ("The address answered, but the head's Ray client server did not start a session for this client "
                   "(its logs: ray_client_server*.err in the head's session folder): run the doctor again, or on "
                   "the head with RAY_ADDRESS=127.0.0.1:6379")
        elif os.environ.get("RAY_AUTH_MODE", "").lower() != "token":  # Ray reports a refused token this way too
            fix = ("Check the address (`ray status` on the head prints it); a head started with RAY_AUTH_MODE=token "
                   "refuses a client without it: export RAY_AUTH_MODE=token here, with the head's token in "
                   "~/.ray/auth_token or RAY_AUTH_TOKEN (docs/cluster.md, 'Token authentication')")
        else:
            fix = "Check the address (`ray status` on the head prints it)"
        return [Finding("fail", "cluster", f"cannot join {address}: {type(err).__name__}: {text}. {fix}")]
    try:
        nodes = alive_nodes()
        resources = ray.cluster_resources()
        autoscaler_max = autoscaler_max_resources()
        labels = sorted({f"{k}={v}" for n in nodes for k, v in n.labels.items() if k.startswith("vidray.io/")})
        found.append(Finding("ok", "cluster", f"{address}: {len(nodes)} alive node(s), {resources.get('CPU', 0):g} "
                             f"CPUs, {resources.get('GPU', 0):g} GPUs"
                             + (f" (its autoscaler can reach {autoscaler_max})" if autoscaler_max else "")
                             + f"; vidray labels: {', '.join(labels) or 'none'}"))
        if job is not None:
            found.extend(_resource_findings(job, resources, autoscaler_max, "the cluster", check_resources,
                                            check_encode_resources if latent_cache_root(job) else None))
            found.extend(_memory_findings(job, resources, local=False))
            try:
                _, lines = _captured(lambda: resolve_placement(job, nodes, autoscaler=autoscaler_max is not None))
                found.extend(Finding("warn" if line.startswith("warning") else "ok", "placement", line)
                             for line in lines)
            except PlacementError as err:  # one line per stage that no node can hold
                found.extend(Finding("fail", "placement", problem) for problem in err.problems)
            except UserError as err:
                found.append(Finding("fail", "placement", str(err)))
    finally:
        if started:
            ray.shutdown()
    return found


def _one_line(text: str) -> str:
    """An error message as one report line: a message that carries a remote traceback (Ray's client server sends
    one) becomes its first line and its last (the exception raised)."""
    lines = [line.strip() for line in text.splitlines() if line.strip() and line.strip() != "."]
    if len(lines) <= 1:
        return lines[0] if lines else text.strip()
    return f"{lines[0]} ... {lines[-1]}"


def _resource_findings(job: Any, resources: dict[str, float], autoscaler_max: dict[str, float] | None, where: str,
                       check_train: Callable[..., None], check_encode: Callable[..., None] | None) -> list[Finding]:
    found = []
    for topic, check in (("resources", check_train), ("vidray encode", check_encode)):
        if check is None:
            continue
        try:
            _, lines = _captured(lambda: check(job, resources, autoscaler_max=autoscaler_max, where=where))
            what = ("workers, with their loaders and encode actors, fit" if topic == "resources"
                    else "encode pipeline fits")
            found.append(Finding("ok", topic, "; ".join(lines) or f"the job's {what} in {where}"))
        except UserError as err:
            found.append(Finding("fail", topic, str(err)))
    return found



def _memory_findings(job: Any, resources: dict[str, float], *, local: bool) -> list[Finding]:
    """The memory planner's verdict on a GPU cluster (`vidray.train.plan.check_cluster_fits`, what `train` refuses
    before reserving GPUs): nothing on a cluster without GPUs or for a CPU job."""
    from vidray.train.plan import check_cluster_fits  # heavy: pydantic

    gpu_memory = None
    if local and resources.get("GPU", 0):
        import torch  # heavy: torch, numpy

        if torch.cuda.is_available():
            gpu_memory = torch.cuda.get_device_properties(0).total_memory
    try:
        line = check_cluster_fits(job, resources, gpu_memory_bytes=gpu_memory)
    except UserError as err:
        return [Finding("fail", "memory", str(err))]
    if line is None:
        return []
    return [Finding("warn" if "unknown" in line else "ok", "memory", line)]
