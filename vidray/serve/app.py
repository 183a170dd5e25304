"""The vidray Serve application: settings, the ingress deployment with its job runner, and `build_app`.

```
serve run serve/serve_config.yaml        # import path serve.app:build_app, args = ServeSettings
```
`build_app(args)` validates the settings and the model folder (config files only, no weights) before Serve
reserves anything, then binds: `VideoIngress` (HTTP, `vidray.serve.routes`) -> handles to `TextEncoder`, `Denoiser`,
`VaeDecoder` (`vidray.serve.stages`). A two-expert model (Wan 2.2 A14B: `transformer_2` and `boundary_ratio`) gets
two denoiser deployments, `Denoiser` with the high-noise expert alone and `LowNoiseDenoiser` with the low-noise one,
each with its own actor options (placement by label, GPUs: `serve/serve_config_experts.yaml`); a job's latents go
from the first to the second at the boundary step.

Jobs: `POST /v1/videos` writes a queued record to the job store (`vidray.serve.jobs`, sqlite under
`store_dir`, held by one actor on the Ray head: `vidray.serve.store_actor`) and returns. Each ingress replica
runs a job runner that claims queued jobs (up to
`runner.max_concurrent_jobs` at once), runs text -> denoise -> decode through the stage handles, writes the mp4
into the store and marks the job completed. Progress (0-100) moves with the denoising steps: 5 after the prompt is
encoded, 5 + 90 * step / num_inference_steps while denoising, 100 when the mp4 is stored.

Faults (documented outcome, tested): a stage replica that dies under a job (its actor is gone) hands the job back:
it is queued again for one more attempt (`runner.max_attempts`, default 2), and a second death marks it failed with
`error.code = "replica_died"`. An ingress replica that dies stops renewing its jobs' leases; any runner's sweep
re-queues them (or fails them with `runner_lost` after the last attempt) once `runner.lease_s` has passed. Serve
restarts dead replicas. A stage Serve reports DEPLOY_FAILED fails its jobs at the next heartbeat; one with no
replica placed (no node satisfies its label selector or has its resources) is named in `GET /v1/status` and fails
its jobs with `stage_unplaced` after `runner.unplaced_stage_timeout_s` (`VideoJobService.stage_problems`). A job
deleted while running is dropped by its runner at the next progress update.

Bounds (issue 27 item 2): each bearer token is a client (`auth.token_file` may list several; the store keeps a short
hash, never the token); `limits.max_queued_jobs` and `limits.max_queued_jobs_per_token` cap unfinished jobs (429
with `Retry-After` beyond them); runners take clients' queues round-robin; finished jobs expire after
`retention.hours` and the runner's periodic sweep removes them with their files, and temp mp4s older than
`retention.tmp_max_age_s`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import hashlib
import logging
import math
import os
import socket
import sqlite3
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Literal, NamedTuple

import ray
import ray.exceptions
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray import serve

from vidray.buckets import Bucket, check_bucket
from vidray.config import MemoryConfig
from vidray.errors import UserError
from vidray.locations import is_uri
from vidray.models.export import (
    inspect_model,
    lora_path_problem,
    model_experts,
    sharded_checkpoint_problem,
    two_experts_lora_problem,
)
from vidray.serve.api import ModelSpec, VideoRequest
from vidray.serve.errors import ApiLimits
from vidray.serve.metrics import JobMetrics, gauge_refresh_s
from vidray.serve.jobs import ANONYMOUS_CLIENT, JobStore, JobStoreUnavailableError
from vidray.serve.policy import PolicyConfig
from vidray.serve.routes import build_api, client_id
from vidray.serve.stages import Denoiser, TextEncoder, VaeDecoder
from vidray.serve.store_actor import head_job_store

__all__ = ["ServeSettings", "ServeSettingsError", "VideoIngress", "VideoJobService", "build_app", "model_spec"]

logger = logging.getLogger("ray.serve")

IMAGE_SIDE_FACTOR = 2
"""An `input_reference` side may be up to this many times the largest video side the model makes (its largest
training bucket, or the largest size `limits` lets a request ask): it is resized down to the video's size, and a
larger image only costs decode time (`ModelSpec.max_image_px`)."""

LOW_NOISE_DENOISER = "LowNoiseDenoiser"
"""The deployment of a two-expert model's low-noise expert (its high-noise one is `Denoiser`)."""


class StageUnavailableError(RuntimeError):
    """A stage deployment this job needs cannot serve it: Serve reports it DEPLOY_FAILED (its replicas fail to
    start, e.g. a model whose weights do not load). The message names the deployment, its status and Serve's
    message."""


class StageUnplacedError(StageUnavailableError):
    """A stage deployment this job needs has no replica running and Serve cannot place one: its replicas wait to
    be scheduled (no alive node satisfies its `label_selector`, or none has its resources: Ray leaves such an actor
    PENDING without error) for longer than `runner.unplaced_stage_timeout_s`. The job fails with code
    `stage_unplaced` and this message (it names the deployment, no host)."""


UNAVAILABLE_STATUSES = ("DEPLOY_FAILED",)
"""Serve's deployment statuses (`ray.serve.schema.DeploymentStatus`) under which a stage takes no request: a call
to it would wait for a replica that does not come. Not UNHEALTHY: a replica that died is replaced, and its jobs
are retried (`runner.max_attempts`); failing them then would end jobs that Serve recovers."""


class InputReferenceGoneError(RuntimeError):
    """A job's first-frame image is no longer stored although the job is: deleted once its last attempt had
    encoded it, then the job was handed back (`JobStore.requeue`). The job fails with code
    `input_reference_gone`."""


SERVE_UNSCHEDULED_NOTE = "to be scheduled"
"""What Serve's deployment status message says of replicas still waiting for a node (ray 2.60,
`serve/_private/deployment_state.py`: "... has N replicas that have taken more than 30s to be scheduled ..."): set
after RAY_SERVE_SLOW_STARTUP_WARNING_S (30 s) of PENDING_ALLOCATION, kept until the deployment changes status."""


class StageProblem(NamedTuple):
    """A stage deployment that cannot take work (`VideoJobService.stage_problems`)."""

    deployment: str
    kind: Literal["failed", "unplaced"]
    serve_message: str
    """Serve's status message for the deployment."""
    seen_at: float
    """Monotonic seconds when this replica first saw it so (for "failed": when last checked)."""
    waiting_s: float
    """Seconds since `seen_at`, as of the call that returned it."""


class ServeSettingsError(UserError):
    """Application args that cannot work; raised by `build_app` before any replica starts."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AuthSettings(_Section):
    token_env: str = "VIDRAY_API_TOKEN"
    """Environment variable holding the bearer token (read by `build_app`)."""
    token_file: str | None = None
    """A file holding the bearer tokens, one per line (blank lines and lines starting with '#' are skipped), e.g. a
    mounted secret; wins over token_env. Each token is one client for `limits.max_queued_jobs_per_token` and fair
    scheduling; each at least 16 characters."""
    admin_token_file: str | None = None
    """A file of admin bearer tokens, one per line (as token_file; each at least 16 characters), e.g. a mounted
    secret: an admin token reads, downloads, lists and deletes every client's videos, where any other token sees
    only its own (another client's id is a 404). Its own creates count as its own client. A file, not the tokens
    themselves, so serve_config.yaml holds no secret. null: no admin."""
    disabled: bool = False
    """True serves without authentication (say so explicitly; the default refuses to start without a token)."""


class LimitSettings(_Section):
    max_body_bytes: int = Field(8 * 2**20, ge=1024)
    """Largest request body in bytes (413 above it, refused before it is read)."""
    max_prompt_chars: int = Field(2000, ge=1)
    """Longest prompt (and negative prompt) in characters (400 above it)."""
    max_image_bytes: int = Field(4 * 2**20, ge=1)
    """Largest `input_reference` image file in bytes (413 above it)."""
    max_image_px: int = Field(4096, ge=16)
    """Largest `input_reference` side in pixels (400 above it); the model's own bound applies when smaller: twice
    the largest side of its training buckets and of max_width / max_height (the image is resized to the video)."""
    image_decode_workers: int = Field(2, ge=1, le=64)
    """Threads that decode `input_reference` images, at most this many at once, in a pool of their own: image work
    never takes the threads the other routes (reads, downloads) run in."""
    image_decode_timeout_s: float = Field(10.0, gt=0, le=600)
    """Seconds an image may wait for a decode thread and decode: past it a create is refused (400 when the decode
    itself ran that long, 503 with Retry-After when the decode threads were busy)."""
    max_num_inference_steps: int = Field(100, ge=1)
    """Most denoising steps a request may ask (400 above it)."""
    max_width: int = Field(1024, ge=16)
    """Largest video width in pixels a request may ask (memory)."""
    max_height: int = Field(1024, ge=16)
    """Largest video height in pixels a request may ask."""
    max_num_frames: int = Field(129, ge=1)
    """Most frames a request may ask (`seconds` * fps is checked against it too)."""
    max_queued_jobs: int = Field(1000, ge=1)
    """Most unfinished (queued + in_progress) jobs in the store, all clients together; a create beyond it is a 429
    with `Retry-After`."""
    max_queued_jobs_per_token: int = Field(100, ge=1)
    """Most unfinished (queued + in_progress) jobs of one bearer token (of everyone when auth is disabled); a create
    beyond it is a 429 with `Retry-After`."""
    max_stored_bytes_per_token: int | None = Field(10 * 2**30, ge=1)
    """Byte quota of one bearer token's stored files (its input images and finished mp4s, until deleted or
    expired); a create once they reach it is a 403 `storage_quota_exceeded` naming the quota (delete videos to
    free room); jobs already queued still finish, so a token may pass it by at most its unfinished jobs' videos.
    null: no quota."""
    max_stored_bytes: int | None = Field(None, ge=1)
    """Byte quota of the whole store (all tokens' files); a create once they reach it is a 507. null: bounded by
    `min_free_bytes` alone."""
    min_free_bytes: int | None = Field(512 * 2**20, ge=1)
    """Free bytes kept on the store's disk: below it a create is a 507 (checked before the image is written) and
    no runner starts a job (they wait, queued, until space is freed). null: no check (a full disk is still a 507)."""


class RetentionSettings(_Section):
    hours: float | None = Field(168.0, gt=0)
    """Hours a finished (completed or failed) job and its mp4 are kept after they finish (its `expires_at`), then
    removed: 404 afterwards. null keeps them until deleted (the disk then fills)."""
    sweep_every_s: float = Field(60.0, gt=0)
    """How often each runner removes expired jobs and stale temp files (also once when it starts)."""
    tmp_max_age_s: float = Field(3600.0, gt=0)
    """A temp mp4 in `store_dir/tmp` older than this (seconds) is left by a dead or cancelled render and is
    removed; keep it above the longest mp4 write, so a live render's file is never taken."""


class RunnerSettings(_Section):
    max_concurrent_jobs: int = Field(16, ge=1)
    """Jobs one ingress replica runs at once (their denoising batches together in the Denoiser)."""
    lease_s: float = Field(30.0, gt=0)
    """A running job's lease; renewed every lease_s / 3 s; an expired lease means its runner died."""
    max_attempts: int = Field(2, ge=1)
    """Claims per job: 2 = one retry after a replica died under it."""
    poll_s: float = Field(0.5, gt=0)
    """How often an idle runner looks for queued jobs (submissions to this replica wake it at once)."""
    unplaced_stage_timeout_s: float = Field(300.0, gt=0)
    """Seconds a running job waits for a stage that has no replica running while Serve reports its replicas waiting
    to be scheduled (no node satisfies its label_selector or has its resources; Serve says so after
    RAY_SERVE_SLOW_STARTUP_WARNING_S, 30 s), before the job fails with `stage_unplaced`: time for an autoscaler to
    start a matching node. A stage with one replica placed takes every request meanwhile (Serve routes only to
    running replicas). `GET /v1/status` names an unplaced stage at once."""


class PolicySettings(_Section):
    """The Denoiser's batch policy (`vidray.serve.policy.PolicyConfig`)."""

    latency_target_s: float = Field(120.0, gt=0)
    """Seconds a request may spend in the Denoiser (queue + steps + transfer to it) that the policy aims at."""
    max_batch_size: int = Field(8, ge=1)
    """Most requests in the running batch (memory); the Denoiser's max_ongoing_requests must be >= it."""
    max_wait_s: float = Field(0.05, ge=0)
    """Longest wait for arrivals before a fresh batch's first step."""
    latency_quantile: float = Field(0.9, ge=0.5, le=0.999)
    """Quantile of the Denoiser's latency that must meet `latency_target_s` (0.5: the mean); the policy widens
    its prediction by the measured spread of step times."""


class DenoiserSettings(_Section):
    """One Denoiser replica spanning several GPUs (`vidray.serve.replica_group`; issue 47): a placement group of
    that many bundles on one node, one torch process group inside it."""

    gpus: int = Field(1, ge=1)
    """GPUs one Denoiser replica spans (NCCL), each in a bundle {GPU: 1, CPU: 1} of its placement group (STRICT_PACK:
    one node). Its `ray_actor_options` must fit one bundle (num_gpus 1, num_cpus <= 1); give the deployment a
    `placement_group_bundle_label_selector` to pin the bundles to labeled nodes."""
    processes: int = Field(1, ge=1)
    """CPU processes (gloo) one Denoiser replica spans, in bundles {CPU: 1}: the CPU path of `gpus`, for tests."""
    cfg_parallel: bool = True
    """With an even span: the two guidance branches on two halves of the ranks (CFG parallel) and the sequence split
    over each half (context parallel); a request without guidance then runs whole on both halves. false: every
    rank splits the sequence (needs a family with context parallel)."""

    @property
    def ranks(self) -> int:
        """Processes one replica spans: `gpus` or `processes` (at most one of them is above 1)."""
        return max(self.gpus, self.processes)


class ServeSettings(_Section):
    """The application's `args` in `serve/serve_config.yaml` (unknown keys are refused)."""

    model_path: str
    """A diffusers folder written by training (`<run>/diffusers`) or a checkpoint folder; relative paths are taken
    from the folder `serve run` / `serve deploy` ran in. A LoRA run's export or checkpoint is served with its
    adapters merged."""
    lora_path: str | None = None
    """LoRA adapters merged into the Denoiser's transformer when it loads: a local folder (`<run>/diffusers/lora`,
    or peft's adapter_config.json + adapter_model.safetensors) or .safetensors file on every Denoiser node;
    relative paths as `model_path`. null: none."""
    model_name: str = "vidray"
    """The `model` string of responses; requests may omit `model` or give exactly this."""
    store_dir: str = "outputs/serve"
    """Job records (sqlite) and finished mp4s: a folder on the Ray head's disk (`store_on: head`), or on each
    ingress replica's node (`store_on: replica`). Relative paths are taken from the folder `serve run` ran in."""
    store_on: Literal["head", "replica"] = "head"
    """Where the job store runs. head: one actor on the Ray head node holds the store, and every ingress replica
    on every node uses it, so jobs outlive the loss of any worker node (`vidray.serve.store_actor`). replica: each
    ingress replica opens `store_dir` on its own node (one node only: replicas on two nodes would keep two
    stores, and a lost node takes its jobs)."""
    fps: float = Field(8.0, gt=0, le=240)
    """Frame rate of the mp4s; `seconds` of a request = num_frames / fps."""
    crf: int = Field(18, ge=0, le=51)
    """H.264 constant rate factor of the mp4s (libx264, yuv420p): 18 is close to lossless, higher is smaller and
    worse (23 is x264's default), 0 is lossless (about 2x the bytes of 18 on the tiny models). Above 0 libx264 does
    not always encode the same frames to the same bytes (PyAV 18.1: 4 to 42 byte strings in 60 encodes of one
    9x32x32 clip, frames up to 28 levels apart), so two mp4s of one video can differ a little; with 0 they decode
    to the same frames (the tests compare served videos with `vidray generate`'s so)."""
    default_num_inference_steps: int = Field(16, ge=1)
    default_guidance_scale: float = Field(1.0, ge=1.0)
    auth: AuthSettings = AuthSettings()
    limits: LimitSettings = LimitSettings()
    policy: PolicySettings = PolicySettings()
    runner: RunnerSettings = RunnerSettings()
    retention: RetentionSettings = RetentionSettings()
    denoiser: DenoiserSettings = DenoiserSettings()
    """How many GPUs (or CPU processes) one Denoiser replica spans: `DenoiserSettings`."""
    memory: MemoryConfig = MemoryConfig()
    """The stages' weights (`vidray.config.MemoryConfig`): `storage_dtype` (auto: bf16 on a replica with a GPU, fp32
    on one without; fp8: float8 storage, bf16 compute) and `offload` (none | model | group | sequential: needs the
    replica to have a GPU, `ray_actor_options.num_gpus`). The training-only keys `block_swap`,
    `fsdp_cpu_offload` and `activation_offload` are refused. The model folder says nothing about a device: the same folder serves on
    either."""


def _spanning_options(span: DenoiserSettings, info, experts) -> dict[str, Any]:
    """The Denoiser's deployment options for a replica spanning `span.gpus` GPUs or `span.processes` CPU processes
    ({} for 1): a STRICT_PACK placement group of one bundle per rank. Raises ServeSettingsError (one line) for both
    above 1, a two-expert model, or a span the family cannot split (`generation_parallel_problem`)."""
    from vidray.inference.parallel import generation_parallel_problem  # heavy: torch (the ingress has none)

    if span.gpus > 1 and span.processes > 1:
        raise ServeSettingsError(f"denoiser: gpus ({span.gpus}) and processes ({span.processes}) cannot both be "
                                 "above 1; use gpus on GPU nodes, processes (CPU, gloo) for tests")
    ranks = span.ranks
    if ranks == 1:
        return {}
    if experts is not None:
        raise ServeSettingsError("denoiser.gpus / processes above 1 is not supported for a two-expert model yet; "
                                 "set them to 1")
    problem = generation_parallel_problem(ranks, guidance=span.cfg_parallel, family_name=info.family_name,
                                          flag="denoiser.gpus" if span.gpus > 1 else "denoiser.processes")
    if problem:  # the message names generate's flag for guidance; the serve config's is cfg_parallel
        raise ServeSettingsError(problem.replace("--guidance-scale above 1", "denoiser.cfg_parallel: true"))
    bundle = {"CPU": 1.0, "GPU": 1.0} if span.gpus > 1 else {"CPU": 1.0}
    return {"placement_group_bundles": [dict(bundle) for _ in range(ranks)],
            "placement_group_strategy": "STRICT_PACK"}


TRAINING_ONLY_MEMORY = ("block_swap", "fsdp_cpu_offload", "activation_offload")
"""`memory` keys that apply to training alone (refused in the serve config)."""


def _memory_problem(memory: MemoryConfig) -> str | None:
    """A training-only `memory` key set away from its default, as one line; None when there is none."""
    for key in TRAINING_ONLY_MEMORY:
        if getattr(memory, key) != getattr(MemoryConfig(), key):
            return (f"memory.{key} is training-only (`vidray train`'s memory section); serving takes "
                    f"memory.storage_dtype and memory.offload: remove memory.{key}")
    return None


def _read_tokens(auth: AuthSettings) -> tuple[str, ...] | None:
    """The bearer tokens (one per client), or None when auth is disabled. Raises ServeSettingsError naming the
    source when there is none, or one is shorter than 16 characters."""
    if auth.disabled:
        return None
    if auth.token_file:
        path = Path(auth.token_file).expanduser()
        if path.is_dir():
            raise ServeSettingsError(f"auth.token_file {path} is a folder; give the file that holds the tokens")
        if not path.is_file():
            raise ServeSettingsError(f"auth.token_file {path} does not exist; create it or set auth.token_env")
        lines = [line.strip() for line in path.read_text().splitlines()]
        tokens = [line for line in lines if line and not line.startswith("#")]
        where = f"auth.token_file {path}"
    else:
        tokens = [os.environ.get(auth.token_env, "").strip()]
        where = f"environment variable {auth.token_env}"
    for number, token in enumerate(tokens or [""], start=1):
        if len(token) < 16:
            which = "" if len(tokens) <= 1 else f" (token {number} of {len(tokens)})"
            raise ServeSettingsError(
                f"no usable bearer token: {where}{which} is empty or shorter than 16 characters; set it (e.g. "
                f"`export {auth.token_env}=$(python -c 'import secrets; print(secrets.token_urlsafe(32))')`), "
                "or serve without authentication by setting auth.disabled: true"
            )
    return tuple(dict.fromkeys(tokens))


def _read_admin_tokens(auth: AuthSettings) -> tuple[str, ...]:
    """The admin tokens of `auth.admin_token_file` (none without one). Raises ServeSettingsError when the file is
    missing, a folder, holds none, holds one shorter than 16 characters, or auth is disabled (no token to tell an
    admin by)."""
    if auth.admin_token_file is None:
        return ()
    path = Path(auth.admin_token_file).expanduser()
    if auth.disabled:
        raise ServeSettingsError(f"auth.admin_token_file {path} is set while auth.disabled is true: without "
                                 "authentication every request is one client that sees all; remove one of them")
    if not path.is_file():
        raise ServeSettingsError(f"auth.admin_token_file {path} is {'a folder' if path.is_dir() else 'missing'}; "
                                 "give the file that holds the admin tokens, one per line, or remove the key")
    tokens = [line.strip() for line in path.read_text().splitlines()]
    tokens = [token for token in tokens if token and not token.startswith("#")]
    if not tokens or any(len(token) < 16 for token in tokens):
        raise ServeSettingsError(f"auth.admin_token_file {path} holds no token, or one shorter than 16 characters; "
                                 "write one token of at least 16 characters per line")
    return tuple(dict.fromkeys(tokens))


def model_spec(settings: ServeSettings, info) -> ModelSpec:
    """What the model folder (`vidray.models.export.ModelInfo`) can make, bounded by settings.limits."""
    bucket = info.default_bucket()
    if bucket is None:
        raise ServeSettingsError(f"model_path {info.path} records no training bucket (a stock diffusers folder); "
                                 "serve a folder exported by vidray training")
    family = info.family
    image_inputs = family.image_inputs(info)  # 0: text-to-video; 2: a first and a last one, but the API gives one
    rules = family.card.bucket_rules  # what GenerationRequest checks too: one rule, read from the card

    def valid_num_frames(num_frames: int) -> bool:
        try:
            check_bucket(Bucket(num_frames, bucket.height, bucket.width), family.name)
        except ValueError:
            return False
        return True

    largest_side = max([settings.limits.max_width, settings.limits.max_height]
                       + [max(b.height, b.width) for b in info.buckets])
    return ModelSpec(
        name=settings.model_name,
        default_size=(bucket.width, bucket.height),
        default_num_frames=bucket.num_frames,
        fps=settings.fps,
        size_multiple=rules.spatial_multiple,
        max_width=settings.limits.max_width,
        max_height=settings.limits.max_height,
        max_num_frames=settings.limits.max_num_frames,
        valid_num_frames=valid_num_frames,
        supports_image_to_video=image_inputs == 1,
        **({"no_image_reason": "is conditioned on a first and a last frame, and the Videos API gives one image "
                               "(use vidray generate --image --last-image)"} if image_inputs == 2 else {}),
        default_num_inference_steps=settings.default_num_inference_steps,
        default_guidance_scale=settings.default_guidance_scale,
        max_image_px=IMAGE_SIDE_FACTOR * largest_side,
        family=family.name,
    )


class VideoJobService:
    """What the HTTP routes call (`vidray.serve.routes.VideoService`), plus the job runner of one ingress replica."""

    def __init__(self, settings: ServeSettings, auth_token: str | tuple[str, ...] | None, text, denoiser, vae,
                 low_noise_denoiser=None, *, admin_tokens: tuple[str, ...] = (), app_name: str | None = None):
        """`auth_token`: the clients' tokens (None: no auth); `admin_tokens`: tokens that see every client's
        videos (accepted too); `app_name`: the Serve app, which must own `store_dir` (`vidray.serve.jobs.
        claim_store`; None skips the check). Raises `StoreOwnedError` when another app owns `store_dir`."""
        self.settings = settings
        if auth_token is not None and isinstance(auth_token, str):
            auth_token = (auth_token,)
        self.auth_token = None if auth_token is None else tuple(dict.fromkeys((*auth_token, *admin_tokens)))
        """The bearer token(s) every route but /healthz requires (`vidray.serve.routes.check_bearer`); None: no auth."""
        self.admin_clients = frozenset(client_id(token) for token in admin_tokens)
        """`client_id`s of the admin tokens: they see every client's videos."""
        limits = settings.limits
        self.limits = ApiLimits(max_body_bytes=limits.max_body_bytes, max_prompt_chars=limits.max_prompt_chars,
                                max_image_bytes=limits.max_image_bytes, max_image_px=limits.max_image_px,
                                max_num_inference_steps=limits.max_num_inference_steps,
                                image_decode_workers=limits.image_decode_workers,
                                image_decode_timeout_s=limits.image_decode_timeout_s)
        self.info = inspect_model(settings.model_path)
        self.spec = model_spec(settings, self.info)
        self.store = _open_store(settings, app=app_name)
        self.text, self.denoiser, self.vae = text, denoiser, vae
        self.low_noise_denoiser = low_noise_denoiser
        """A two-expert model's second denoiser stage (`LowNoiseDenoiser`: the steps below the boundary, after
        `denoiser`'s), or None: `denoiser` takes every step."""
        self.owner = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        """This runner's id; each claim's owner is this id + '#' + a claim number (`_next_owner`)."""
        self._num_claims = 0
        self._wake = asyncio.Event()
        self._active: dict[str, asyncio.Task] = {}
        self._owners: dict[str, str] = {}
        """job id -> the owner id of this runner's claim of it (per claim, so a stale attempt cannot act)."""
        self._renders: dict[str, tuple[asyncio.Task, dict, str]] = {}
        """job id -> (its render task, its `owned` flag, its claim's owner id) while this replica renders it
        (`_drop` stops one)."""
        self._runner_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        """The loop the runner and its renders run on (set by `ensure_runner`)."""
        self._stopping = False
        self.metrics = JobMetrics()
        self._store_counted_at = -math.inf  # monotonic seconds of the last `store.counts()` for the gauge
        self._swept_at = -math.inf  # monotonic seconds of the last retention / temp-file sweep
        self._stage_check_lock = threading.Lock()
        self._stage_checked: tuple[float, list[StageProblem]] = (-math.inf, [])
        """(monotonic seconds, result) of the last `serve.status()` stage check (`stage_problems`): shared by every
        running job's heartbeat and `GET /v1/status`, so the controller is asked once per beat, not once per job."""
        self._unplaced_since: dict[str, float] = {}
        """deployment -> monotonic seconds when this replica first saw it unplaced (cleared once it is placed)."""

    # --- routes -------------------------------------------------------------------------------------------------
    async def submit(self, request: VideoRequest, *, client: str = ANONYMOUS_CLIENT,
                     idempotency_key: str | None = None) -> dict:
        """Store the job for `client` (a hash of its bearer token), or answer the job an `idempotency_key` of
        this client made for the same request. Raises `vidray.serve.jobs.QueueFullError` past
        `limits.max_queued_jobs` or `limits.max_queued_jobs_per_token`, `StorageFullError` past a byte quota or
        with the disk under `limits.min_free_bytes`, `IdempotencyKeyReusedError`, OSError / sqlite3 errors when
        the store cannot be written (the route answers 429, 403 or 507, 422, 507 or 503)."""
        params = request.generation.to_dict()  # the job's GenerationRequest (`VideoJob.request` reads it back)
        if (note := request.input_reference_note()) is not None:
            params["input_reference"] = note  # its size, and a note when the video's aspect ratio stretches it
        job = await asyncio.to_thread(
            self.store.create, model=request.model or self.spec.name, prompt=request.prompt,
            size=f"{request.width}x{request.height}", seconds=request.seconds, params=params,
            input_reference=request.input_reference, client=client,
            **({"input_suffix": request.input_reference_suffix} if request.input_reference is not None else {}),
            max_unfinished=self.settings.limits.max_queued_jobs,
            max_unfinished_per_client=self.settings.limits.max_queued_jobs_per_token,
            idempotency_key=idempotency_key,
            max_client_bytes=self.settings.limits.max_stored_bytes_per_token,
            max_store_bytes=self.settings.limits.max_stored_bytes,
            min_free_bytes=self.settings.limits.min_free_bytes,
        )
        self.ensure_runner()
        self._wake.set()
        return job.to_openai()

    def get(self, video_id: str, *, client: str | None) -> dict | None:
        """`client`'s video object (None: any client's), or None (`JobStore.get`)."""
        job = self.store.get(video_id, client=client)
        return None if job is None else job.to_openai()

    def list(self, *, after: str | None, limit: int, order: str, client: str | None) -> tuple[list[dict], bool]:
        """A page of `client`'s video objects (None: every client's) (`JobStore.list`)."""
        jobs, has_more = self.store.list(after=after, limit=limit, order=order, client=client)
        return [job.to_openai() for job in jobs], has_more

    def delete(self, video_id: str, *, client: str | None) -> bool:
        """Delete `client`'s job (None: any client's) (`JobStore.delete`). A render of it in this replica stops at
        once, and its Denoiser request leaves the running batch after the step in flight; a render in another
        ingress replica stops at its next progress event or heartbeat (`runner.lease_s` / 3 at most)."""
        deleted = self.store.delete(video_id, client=client)
        if deleted:
            self._drop(video_id)
        return deleted

    def open_video(self, video_id: str, *, client: str | None):
        """`client`'s finished mp4 (None: any client's) opened for reading, or None (`JobStore.open_video`)."""
        return self.store.open_video(video_id, client=client)

    def health(self) -> dict:
        """``{"status": "ok"}`` while this replica's runner runs (restarting it if it ended), else
        ``{"status": "not ok"}`` (the replica is stopping). Constant time: no store access."""
        self.ensure_runner()
        running = self._runner_task is not None and not self._runner_task.done()
        return {"status": "ok" if running and not self._stopping else "not ok"}

    async def status(self, *, client: str | None = None) -> dict:
        """For the authenticated `GET /v1/status`: the model name, `client`'s job counts by status (None: all
        clients'; read in a thread, off the event loop), the jobs rendering in this replica, and the stages that
        cannot take work: `"stages": {"unplaced": [{"stage", "waiting_s", "message"}], "failed": [...]}`
        (`stage_problems`; empty lists when every stage is placed and healthy, or outside Serve)."""
        counts = await asyncio.to_thread(lambda: self.store.counts(client=client))
        problems = await asyncio.to_thread(self.stage_problems)
        stages: dict[str, list[dict]] = {"unplaced": [], "failed": []}
        for problem in problems:
            stages[problem.kind].append({"stage": problem.deployment, "waiting_s": round(problem.waiting_s, 1),
                                         "message": problem.serve_message})
        return {"object": "status", "model": self.spec.name, "jobs": counts, "running_here": len(self._active),
                "stages": stages}

    # --- runner -------------------------------------------------------------------------------------------------
    def ensure_runner(self) -> None:
        """Start this replica's runner task (idempotent; needs the replica's event loop); never after `shutdown`."""
        if self._stopping:
            return
        if self._runner_task is None or self._runner_task.done():
            self._loop = asyncio.get_running_loop()
            self._runner_task = self._loop.create_task(self._run())

    async def _run(self) -> None:
        while not self._stopping:
            try:
                for job_id, status in await asyncio.to_thread(self.store.recover_expired):
                    logger.warning("job %s lost its runner (lease expired): now %s", job_id, status)
                    self.metrics.count_job("retried" if status == "queued" else "failed")
                if time.monotonic() - self._store_counted_at >= gauge_refresh_s():
                    self._store_counted_at = time.monotonic()
                    self.metrics.set_jobs(await asyncio.to_thread(self.store.counts))
                if time.monotonic() - self._swept_at >= self.settings.retention.sweep_every_s:
                    self._swept_at = time.monotonic()
                    await asyncio.to_thread(self._sweep)
                while not self._stopping and len(self._active) < self.settings.runner.max_concurrent_jobs:
                    job = await asyncio.to_thread(self.store.claim, self._next_owner(), self.settings.runner.lease_s,
                                                  min_free_bytes=self.settings.limits.min_free_bytes)
                    if job is None:
                        break
                    if self._stopping:  # claimed while the replica began to stop: straight back to the queue
                        await asyncio.to_thread(self.store.requeue, job.id, job.owner)
                        break
                    self._start(job)
            except Exception:  # noqa: BLE001 - the runner must outlive a bad sweep (e.g. a locked disk)
                logger.exception("job runner sweep failed; retrying")
            self._wake.clear()
            if self._stopping:
                break
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self.settings.runner.poll_s)
            except asyncio.TimeoutError:
                pass

    def _next_owner(self) -> str:
        """A fresh owner id for the next claim: a runner that stalled past a lease and re-claimed the same job
        holds the new attempt under another id, so the stalled attempt's heartbeat and complete fail."""
        self._num_claims += 1
        return f"{self.owner}#{self._num_claims}"

    def _start(self, job) -> None:
        """Run a claimed job in a task of this replica's loop, tracked in `_active` until it ends."""
        task = asyncio.get_running_loop().create_task(self._execute(job))
        self._active[job.id] = task
        self._owners[job.id] = job.owner

        def forget(_task, job_id=job.id, owner=job.owner):
            if self._owners.get(job_id) == owner:  # not a newer claim of the same job
                self._active.pop(job_id, None)
                self._owners.pop(job_id, None)

        task.add_done_callback(forget)

    def _sweep(self) -> None:
        """Remove expired jobs (with their files) and stale temp mp4s (`retention`); runs in a thread."""
        retention = self.settings.retention
        expired = self.store.sweep_expired()
        stale = self.store.sweep_temp(older_than_s=retention.tmp_max_age_s)
        if expired or stale:
            logger.info("retention sweep: removed %d expired jobs and %d stale temp files", len(expired), len(stale))

    async def shutdown(self, timeout_s: float = 10.0) -> list[str]:
        """Stop this replica's runner in good order (Serve calls it as the replica stops: `VideoIngress.__del__`):
        claim nothing more, hand every job it is rendering back to the store as ``queued`` without counting the
        attempt (`JobStore.requeue`), so another replica (or this app after a restart) renders it at once, then
        stop those renders (their Denoiser requests leave the batch), waiting at most `timeout_s` seconds.
        Returns the ids handed back."""
        self._stopping = True
        self._wake.set()
        if self._runner_task is not None and not self._runner_task.done():
            # Not cancelled: a claim in flight runs in a thread and would complete unseen; the runner ends its sweep
            # (handing back what it claims from now on) and stops.
            done, _ = await asyncio.wait([self._runner_task], timeout=timeout_s)
            if not done:
                self._runner_task.cancel()
        handed_back = []
        for job_id, task in list(self._active.items()):
            if await asyncio.to_thread(self.store.requeue, job_id, self._owners.get(job_id, self.owner)):
                handed_back.append(job_id)
                self.metrics.count_job("handed_back")
                logger.info("job %s handed back (queued, attempt not counted): this replica is stopping", job_id)
            if job_id in self._renders:
                self._drop(job_id)
            else:
                task.cancel()  # its render has not started yet
        active = [task for task in self._active.values() if not task.done()]
        if active:
            await asyncio.wait(active, timeout=timeout_s)
        return handed_back

    def _drop(self, job_id: str, owner: str | None = None) -> None:
        """Stop this replica's render of a job it no longer owns (deleted, or its lease lost): the render task is
        cancelled, which cancels its Denoiser stream (`_render`). With `owner`, only the render of that claim.
        Called from a route's worker thread (`delete`), it hands the cancel to the runner's loop: asyncio tasks are
        cancelled only on their own loop."""
        loop = self._loop
        if loop is not None and not _runs_on(loop):
            loop.call_soon_threadsafe(self._drop, job_id, owner)
            return
        entry = self._renders.get(job_id)
        if entry is not None and owner in (None, entry[2]):
            render, owned, _ = entry
            owned["value"] = False
            render.cancel()

    async def _execute(self, job) -> None:
        """Run one claimed job through the stages; every outcome ends in the store (completed, queued again,
        failed), never left in_progress by a live runner. A job this runner no longer owns (deleted, or its lease
        lost) is dropped at once: its render is cancelled (`_drop`), not left to finish."""
        lease_s = self.settings.runner.lease_s
        progress = {"value": 0}
        owned = {"value": True}
        stopped: dict[str, BaseException] = {}  # why the heartbeat stopped the render, if it did
        render = asyncio.get_running_loop().create_task(self._render(job, progress, owned))
        self._renders[job.id] = (render, owned, job.owner)

        async def heartbeat():
            while True:
                await asyncio.sleep(lease_s / 3)
                unavailable = await asyncio.to_thread(self.unavailable_stage)
                if unavailable is not None:  # its call would wait for a replica that does not come
                    stopped["error"] = unavailable
                    render.cancel()
                    return
                try:
                    ok = await asyncio.to_thread(self.store.heartbeat, job.id, job.owner,
                                                 progress=progress["value"], lease_s=lease_s)
                except JobStoreUnavailableError as err:  # the head's store restarting: renew at the next beat
                    logger.warning("job %s: lease not renewed: %s", job.id, err)
                    continue
                if not ok:
                    self._drop(job.id, job.owner)
                    return

        beat = asyncio.get_running_loop().create_task(heartbeat())
        try:
            try:
                mp4 = await render
            except asyncio.CancelledError:
                if "error" in stopped:  # a stage it needs cannot start: the job fails (below), naming it
                    raise stopped["error"] from None
                if owned["value"]:  # this task itself was cancelled (the replica is stopping)
                    raise
                mp4 = None
            if mp4 is None:
                logger.info("job %s was deleted or its lease lost while running; dropped", job.id)
                return
            done = await asyncio.to_thread(self.store.complete, job.id, job.owner, mp4)
            if done:
                self.metrics.count_job("completed", seconds=time.time() - job.created_at)
                await self._release_input(job)
            else:
                mp4.unlink(missing_ok=True)
        except JobStoreUnavailableError as err:
            # The store did not answer (its actor restarting): nothing can be recorded now, and failing the job
            # would be final. Left in_progress under this claim, the lease rule recovers it (`recover_expired`).
            logger.warning("job %s left to its lease: %s", job.id, err)
        except ray.exceptions.RayActorError as err:  # ActorDiedError, ActorUnavailableError: a replica is gone
            status = await asyncio.to_thread(
                self.store.release, job.id, job.owner, code="replica_died",
                message=f"a stage replica died while rendering this video ({type(err).__name__})",
            )
            logger.warning("job %s: a stage replica died (%s); job now %s", job.id, type(err).__name__, status)
            if status is not None:
                self.metrics.count_job("retried" if status == "queued" else "failed")
            if status == "failed":
                await self._release_input(job)
        except InputReferenceGoneError as err:
            if await asyncio.to_thread(self.store.fail, job.id, job.owner, "input_reference_gone", str(err)):
                self.metrics.count_job("failed")
        except Exception as err:  # noqa: BLE001 - any other failure fails this job with its reason
            code = failure_code(err)
            if code == "internal_error":
                logger.exception("job %s failed", job.id)
            else:
                logger.warning("job %s failed (%s): %s", job.id, code, failure_message(err))
            if await asyncio.to_thread(self.store.fail, job.id, job.owner, code, failure_message(err)):
                self.metrics.count_job("failed")
                await self._release_input(job)
        finally:
            beat.cancel()
            if self._renders.get(job.id, (None, None, None))[2] == job.owner:
                self._renders.pop(job.id)

    async def _release_input(self, job) -> None:
        """Delete `job`'s first-frame image from the store (`JobStore.drop_input`) once nothing needs it: the VAE
        stage encoded it on the job's last attempt, or the job finished. Best effort: a store that does not answer
        leaves the file to the job's expiry, which removes it with the video."""
        if job.input_reference is None:
            return
        try:
            await asyncio.to_thread(self.store.drop_input, job.id)
        except Exception:  # noqa: BLE001 - the job's outcome stands; the retention sweep removes the file later
            logger.warning("job %s: its input_reference was not deleted now", job.id, exc_info=True)

    def unavailable_stage(self) -> StageUnavailableError | None:
        """The error to fail a running job with, when a stage deployment of this application cannot take its
        request, else None: a stage Serve reports DEPLOY_FAILED (`UNAVAILABLE_STATUSES`) at once
        (`StageUnavailableError`, '<deployment> is DEPLOY_FAILED: <Serve's message>'); a stage unplaced
        (`stage_problems`) for more than `runner.unplaced_stage_timeout_s` (`StageUnplacedError`). None also where
        Serve cannot say (stage objects outside Serve, as the unit tests chain them; the controller not answering).
        A job waiting on such a stage would wait for good: `_execute` fails it instead.

        Blocks on one `serve.status()` call per heartbeat at most (`stage_problems`): call it in a thread."""
        timeout_s = self.settings.runner.unplaced_stage_timeout_s
        for problem in self.stage_problems():
            if problem.kind == "failed":
                return StageUnavailableError(f"the {problem.deployment} stage is DEPLOY_FAILED: "
                                             f"{problem.serve_message}")
            if problem.waiting_s > timeout_s:
                return StageUnplacedError(
                    f"the {problem.deployment} stage has no replica running: Serve could not place one on any node "
                    f"for {problem.waiting_s:.0f} s (no node satisfies its label_selector or has its resources; "
                    f"runner.unplaced_stage_timeout_s is {timeout_s:g} s); the server's operator must add a "
                    "matching node or fix the stage's placement; create the video again later")
        return None

    def stage_problems(self) -> list[StageProblem]:
        """The stage deployments of this application that cannot take work now, from Serve's status: DEPLOY_FAILED
        ones (kind "failed"), and unplaced ones (kind "unplaced": no replica RUNNING while Serve reports replicas
        that "have taken more than N s to be scheduled", its message for replicas still PENDING_ALLOCATION); a
        stage with a running replica is fine whatever its other replicas wait for (Serve routes to running ones).

        Every running job's heartbeat asks this once per beat (`runner.lease_s` / 3); one answer serves them all
        (and `GET /v1/status`) for that long, so Serve's controller gets one `serve.status()` per beat from this
        replica, however many jobs run. Blocks on that call (and on a concurrent caller making it): call it in a
        thread."""
        max_age_s = self.settings.runner.lease_s / 3
        with self._stage_check_lock:
            checked_at, found = self._stage_checked
            if time.monotonic() - checked_at >= max_age_s:
                found = self._query_stage_problems()
                self._stage_checked = (time.monotonic(), found)
        now = time.monotonic()
        return [problem._replace(waiting_s=now - problem.seen_at) for problem in found]

    def _query_stage_problems(self) -> list[StageProblem]:
        """`stage_problems`'s answer from one `serve.status()` call; keeps `_unplaced_since` (call under the lock)."""
        stages = [h for h in (self.text, self.denoiser, self.low_noise_denoiser, self.vae) if h is not None]
        names = [getattr(h, "deployment_name", None) for h in stages]
        app = getattr(stages[0], "app_name", None) if stages else None
        if app is None or not all(isinstance(n, str) for n in names):
            return []
        try:
            deployments = serve.status().applications[app].deployments
        except Exception:  # noqa: BLE001 - the controller restarting, or no such app: nothing to say now
            return []
        problems = []
        now = time.monotonic()
        for name in names:
            found = deployments.get(name)
            if found is None:
                continue
            status = getattr(found.status, "value", found.status)
            running = (found.replica_states or {}).get("RUNNING", 0)
            if status in UNAVAILABLE_STATUSES:
                problems.append(StageProblem(name, "failed", found.message, now, 0.0))
            elif running == 0 and SERVE_UNSCHEDULED_NOTE in (found.message or ""):
                seen_at = self._unplaced_since.setdefault(name, now)
                if seen_at == now:
                    logger.warning("the %s stage has no replica placed: %s", name, found.message)
                problems.append(StageProblem(name, "unplaced", found.message, seen_at, 0.0))
                continue
            self._unplaced_since.pop(name, None)
        return problems

    async def _render(self, job, progress: dict, owned: dict) -> Path | None:
        """text (and, for an image-to-video job, its first frame through the VAE stage) -> denoise (streamed
        progress) -> decode -> mp4 in the store's folder; None if the job was lost."""
        from vidray.data.video import write_mp4  # heavy: av, PIL

        generation = job.request  # the GenerationRequest the route built, as stored
        guided = generation.guided
        # 1. Encode the prompt (and the negative prompt for classifier-free guidance).
        calls = [self.text.encode.remote(generation.prompt)]
        if guided:
            calls.append(self.text.encode.remote(generation.negative_prompt))
        condition = None
        if job.input_reference is not None:  # image-to-video: the first frame's condition, by the VAE stage
            image = await asyncio.to_thread(self.store.read_input, job.id)
            if image is None:
                if await asyncio.to_thread(self.store.get, job.id) is None:
                    return None  # deleted (or expired) meanwhile: its input went with it
                raise InputReferenceGoneError(
                    "the input_reference image was deleted after an earlier attempt encoded it (the job was handed "
                    "back by a stopping replica); create the video again")
            condition = self.vae.encode_image.remote(image, tuple(generation.bucket), generation.seed)
        encoded = [await call for call in calls]
        condition = {} if condition is None else await condition  # inpaint_latents[, image_embeds]
        if job.input_reference is not None and job.attempts >= self.settings.runner.max_attempts:
            await self._release_input(job)  # encoded, and no later attempt can need it
        progress["value"] = 5
        # 2. Denoise, following the step events.
        prompt_embeds, prompt_attention_mask = encoded[0]
        request = {
            "request": generation, "prompt_embeds": prompt_embeds, "prompt_attention_mask": prompt_attention_mask,
            "negative_prompt_embeds": encoded[1][0] if guided else None,
            "negative_prompt_attention_mask": encoded[1][1] if guided else None,
            "inpaint_latents": None, **condition, "sent_at": time.time(),
        }
        # A two-expert model's high-noise stage hands its latents and step to the low-noise one.
        final = None
        for denoiser in filter(None, (self.denoiser, self.low_noise_denoiser)):
            if final is not None:
                request = {**request, "latents": final["latents"], "step": final["step"], "sent_at": time.time()}
            final = await self._denoise(denoiser, request, job, progress, owned)
            if final is None:
                return None
        latents = final["latents"]
        # 3. Decode and write the mp4 next to the store (same filesystem: the store moves it in atomically).
        frames = await self.vae.decode.remote(latents)
        mp4 = await asyncio.to_thread(self.store.temp_video)
        try:
            await asyncio.to_thread(write_mp4, frames, mp4, generation.fps, crf=self.settings.crf)
        except BaseException:  # failed or cancelled mid-write: its temp file goes now, not at the sweep
            mp4.unlink(missing_ok=True)
            raise
        progress["value"] = 99
        if not owned["value"]:
            mp4.unlink(missing_ok=True)
            return None
        return mp4

    async def _denoise(self, denoiser, request: dict, job, progress: dict, owned: dict) -> dict | None:
        """Stream `request` through one denoiser stage, following its step events into the job's progress; its
        last event ({"latents", "step"}), or None if the job was lost meanwhile. Raises RuntimeError when the
        stage ends without latents."""
        final = None
        stream = denoiser.options(stream=True).denoise.remote(request)
        try:
            async for event in stream:
                if "latents" in event:
                    final = event
                else:
                    progress["value"] = 5 + int(90 * event["step"] / event["num_inference_steps"])
                    now = time.monotonic()
                    if now - progress.get("written_at", 0.0) >= 0.2:  # progress reaches the store 5x/s at most
                        progress["written_at"] = now
                        owned["value"] = await asyncio.to_thread(
                            self.store.heartbeat, job.id, job.owner, progress=progress["value"],
                            lease_s=self.settings.runner.lease_s)
                if not owned["value"]:
                    return None
        finally:
            if final is None:
                # Left early (the job was dropped, or this task cancelled): an unconsumed stream is not cancelled
                # by Serve, and the Denoiser would step the request to its end for nobody. Best effort: a failure
                # here must not replace the error that ended the stream (a dead replica is handled by the caller).
                try:
                    stream.cancel()
                except Exception:  # noqa: BLE001
                    logger.warning("job %s: cancelling its denoise request failed", job.id, exc_info=True)
        if final is None:
            raise RuntimeError("the denoiser ended without latents")
        return final


def _runs_on(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether this thread is running `loop`."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:  # no loop runs in this thread (a worker thread of `run_in_threadpool`)
        return False


_service: VideoJobService | None = None
"""This replica's service (one ingress per replica process); None until the replica has started."""


def _stage_error(err: BaseException) -> BaseException:
    """The exception a stage raised: an error inside a stage reaches the ingress as a
    `ray.exceptions.RayTaskError`, whose `cause` is the stage's own exception."""
    if isinstance(err, ray.exceptions.RayTaskError) and err.cause is not None:
        return err.cause
    return err


def failure_message(err: BaseException, limit: int = 500) -> str:
    """A failed job's `error.message` for the client, at most `limit` characters.

    For a request that cannot be made (`failure_code` "invalid_request": a vidray `UserError` a stage raised) or a
    stage that no node can hold ("stage_unplaced"), "<type>: <message>" of that error, which says what to change.
    For anything else ("internal_error") a generic sentence with a short error id: the exception's text can hold server paths and host names, so it goes to the
    server log only, logged here at ERROR with the same id (the id is a hash of the text: equal errors, equal ids).
    `_stage_error` unwraps Ray's RayTaskError (its text is the remote traceback with terminal colour codes).
    """
    text = f"{type(_stage_error(err)).__name__}: {_stage_error(err)}"
    if failure_code(err) in ("invalid_request", "stage_unplaced"):
        return text[:limit]
    error_id = hashlib.sha256(text.encode("utf-8", "backslashreplace")).hexdigest()[:8]
    logger.error("internal error id %s: %s", error_id, text)
    return (f"internal error while making this video (error id {error_id}); the server log has the details under "
            "this id; create the video again, or report the id")[:limit]


def failure_code(err: BaseException) -> str:
    """A failed job's `error.code`: "invalid_request" when the stage's error is a vidray `UserError` (what the
    request asked for cannot be made, e.g. `NonFiniteLatentsError` from a huge guidance_scale: resending it fails
    again), "stage_unplaced" for a stage no node can hold (`StageUnplacedError`), else "internal_error"."""
    if isinstance(err, StageUnplacedError):
        return "stage_unplaced"
    return "invalid_request" if isinstance(_stage_error(err), UserError) else "internal_error"


def current_service() -> VideoJobService | None:
    """This replica's service. A module-level function on purpose: Serve pickles the ingress class and its app by
    value, and cloudpickle sends named module functions by reference, so the routes read this module's global in
    the replica (a lambda would carry a frozen copy of the globals)."""
    return _service


def count_http_error(status: int, code: str) -> None:
    """`build_api`'s `on_error`: counts an error answer in this replica's metrics (module-level, as
    `current_service`). Errors before the service exists (503 while starting) are not counted."""
    if _service is not None:
        _service.metrics.count_http_error(status, code)


api = build_api(current_service, on_error=count_http_error)


@serve.deployment(name="VideoIngress", max_ongoing_requests=256)
@serve.ingress(api)
class VideoIngress:
    """HTTP ingress: the OpenAI-compatible routes of `vidray.serve.routes` over this replica's `VideoJobService`."""

    def __init__(self, settings: dict[str, Any], auth_token: tuple[str, ...] | None, text, denoiser, vae,
                 low_noise_denoiser=None, *, admin_tokens: tuple[str, ...] = ()):
        import vidray.serve.app as module  # lazy: this class arrives pickled by value: set the real module's global

        # The Serve app's name owns store_dir: a second app on the same folder fails here, naming both.
        app_name = serve.get_replica_context().app_name
        self.service = VideoJobService(ServeSettings(**settings), auth_token, text, denoiser, vae, low_noise_denoiser,
                                       admin_tokens=admin_tokens, app_name=app_name)
        module._service = self.service
        try:
            self.service.ensure_runner()
        except RuntimeError:  # no running loop in this constructor: the first health check starts it
            logger.info("job runner starts with the first health check or request")

    async def check_health(self) -> None:
        """Serve's periodic health check (every 10 s); also (re)starts the runner, so queued jobs run after a
        restart without any request."""
        self.service.ensure_runner()

    async def __del__(self) -> None:
        """Serve's graceful stop of this replica (scale-down, redeploy, `serve run` interrupted, `serve shutdown`):
        its running jobs go back to the queue without using an attempt (`VideoJobService.shutdown`). A replica
        that dies instead leaves them to the lease rule (`JobStore.recover_expired`)."""
        await self.service.shutdown()


def _describe(err: ValidationError) -> str:
    """Each problem as `key: what is wrong`; an unknown key also lists the valid keys of its section and the
    closest one (a typo's fix)."""
    problems = []
    for e in err.errors():
        loc = [str(part) for part in e["loc"]]
        text = f"{'.'.join(loc)}: {e['msg']}"
        if e["type"] == "extra_forbidden":
            section: type[BaseModel] = ServeSettings
            for part in loc[:-1]:
                field = section.model_fields.get(part)
                section = field.annotation if field is not None else section
            valid = sorted(section.model_fields)
            close = difflib.get_close_matches(loc[-1], valid, n=1)
            text = (f"{'.'.join(loc)}: unknown key" + (f" (did you mean {close[0]}?)" if close else "")
                    + f"; valid: {', '.join(valid)}")
        problems.append(text)
    return "; ".join(problems)


def _open_store(settings: ServeSettings, app: str | None = None):
    """The job store the settings name: the head's store actor (`store_on: head`, needs a connected Ray), or a
    `JobStore` on this node's disk; owned by Serve app `app` (None: no owner check). Raises what `JobStore` raises
    when `store_dir` cannot hold a store or belongs to another app (`StoreOwnedError`), and
    `JobStoreUnavailableError` when the head's actor does not start."""
    hours = settings.retention.hours
    retention_s = None if hours is None else hours * 3600.0
    if settings.store_on == "head":
        return head_job_store(settings.store_dir, max_attempts=settings.runner.max_attempts, retention_s=retention_s,
                              app=app)
    return JobStore(settings.store_dir, max_attempts=settings.runner.max_attempts, retention_s=retention_s, app=app)


def _check_store(settings: ServeSettings) -> None:
    """Open the store once before Serve starts a replica (creates or migrates its schema). Without a connected Ray
    (a dry build), a head store is checked as a local folder. Raises ServeSettingsError naming `store_dir`."""
    where = f"store_dir {settings.store_dir} (store_on: {settings.store_on})"
    if settings.store_on == "head" and not ray.is_initialized():
        settings = settings.model_copy(update={"store_on": "replica"})
    try:
        _open_store(settings)
    except (ValueError, OSError, sqlite3.DatabaseError) as err:  # JobStoreUnavailableError is an OSError
        raise ServeSettingsError(f"{where}: {err}") from None


def build_app(args: dict[str, Any]) -> serve.Application:
    """The application for `serve run` / `serve deploy` (import path `serve.app:build_app`).

    `args` = ServeSettings. Checked here, before Serve starts any replica: unknown or out-of-range keys, the bearer
    token (unless auth.disabled), the model folder (config files only), the policy against the Denoiser's
    max_ongoing_requests. Raises ServeSettingsError naming the key and the fix.
    """
    try:
        settings = ServeSettings(**(args or {}))
    except ValidationError as err:
        raise ServeSettingsError(f"serve_config.yaml application args: {_describe(err)}") from None
    if problem := _memory_problem(settings.memory):
        raise ServeSettingsError(problem)
    auth_token = _read_tokens(settings.auth)
    admin_tokens = _read_admin_tokens(settings.auth)
    root = Path.cwd()
    settings = settings.model_copy(update={
        "model_path": (settings.model_path if is_uri(settings.model_path)  # a URI: fetched into the model cache
                       else str((root / settings.model_path).resolve())),
        "store_dir": str((root / settings.store_dir).resolve()),
        "lora_path": None if settings.lora_path is None else str((root / settings.lora_path).resolve()),
    })
    if settings.lora_path is not None:
        problem = lora_path_problem(settings.lora_path)
        if problem:
            raise ServeSettingsError(f"lora_path: {problem}")
    try:
        info = inspect_model(settings.model_path)
    except UserError as err:
        raise ServeSettingsError(f"model_path: {err}") from None
    if problem := sharded_checkpoint_problem(info):  # a DCP folder is pickle-based: serve its safetensors export
        raise ServeSettingsError(f"model_path: {problem}")
    model_spec(settings, info)
    experts = model_experts(info)
    if experts is not None and settings.lora_path is not None:
        raise ServeSettingsError(two_experts_lora_problem(settings.model_path, "lora_path"))
    try:
        policy = PolicyConfig(**settings.policy.model_dump())
    except ValueError as err:
        raise ServeSettingsError(f"policy: {err}") from None
    _check_store(settings)
    denoiser = Denoiser.options(max_ongoing_requests=max(16, 2 * policy.max_batch_size),
                                **_spanning_options(settings.denoiser, info, experts))
    logger.info("vidray serve: model %s, store %s, auth %s", settings.model_path, settings.store_dir,
                "off" if auth_token is None else f"{len(auth_token)} bearer token(s)")
    if settings.auth.disabled:
        logger.warning("auth.disabled: true: the video API takes requests without a bearer token, so anyone who "
                       "can reach its port can create, read and delete videos; remove auth.disabled and set "
                       "auth.token_env or auth.token_file to require a token")
    # A two-expert model (Wan 2.2 A14B): one deployment per expert, each placed by its own ray_actor_options.
    if experts is not None:
        logger.warning("model %s has two experts: the low-noise one runs in the %s deployment, whose actor options "
                       "(GPUs, label_selector) come from its own deployments entry (serve/serve_config_experts.yaml "
                       "has one); without one it gets Serve's defaults", settings.model_path, LOW_NOISE_DENOISER)
    args = (settings.model_path, settings.policy.model_dump(), settings.lora_path)
    memory = dataclasses.asdict(settings.memory)
    largest = (settings.limits.max_num_frames, settings.limits.max_height, settings.limits.max_width)
    kw = dict(memory=memory, largest_request=largest, gpus=settings.denoiser.gpus,
              processes=settings.denoiser.processes, cfg_parallel=settings.denoiser.cfg_parallel)
    denoisers = ([denoiser.bind(*args, **kw)] if experts is None else
                 [denoiser.bind(*args, "high", **kw),
                  denoiser.options(name=LOW_NOISE_DENOISER).bind(*args, "low", **kw)])
    return VideoIngress.bind(
        settings.model_dump(), auth_token,
        TextEncoder.bind(settings.model_path, memory=memory),
        denoisers[0],
        VaeDecoder.bind(settings.model_path, memory=memory),
        *denoisers[1:],
        admin_tokens=admin_tokens,
    )
