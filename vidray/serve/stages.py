"""The model deployments of the serve plane: text encoder, step-batched DiT denoiser, VAE decoder.

A request travels ingress -> `TextEncoder.encode` (prompt_embeds (1, L, D) + mask) -> `Denoiser.denoise` (a
stream of progress events, then latents (1, C, F_lat, H_lat, W_lat)) -> `VaeDecoder.decode` (uint8 frames
(F, H, W, 3)). Each deployment loads only its own component of the model folder (`vidray.models.export.load_model`
with `components`: the text encoder, the transformer, the VAE) and has its own
`ray_actor_options` (label selector, GPUs, CPUs) and autoscaling in `serve/serve_config.yaml`. A replica with a GPU
runs its component there in the serve config's `memory.storage_dtype` (auto: bf16; Wan's VAE in fp32) and
`memory.offload`; one without, on the CPU in fp32 (`vidray.models.offload.prepare_for_inference`).

The denoiser runs continuous batching at the denoising step (iteration-level batching, Orca, Yu et al. OSDI 2022):
requests of one latent shape share a running batch; between two steps finished requests leave and waiting ones
join, so a request never waits for another request's whole denoising loop. How many may run at once and how long
to wait for arrivals before stepping a fresh batch is decided before every step by `BatchPolicy`, from the step
times, transfer costs and queue depth it measures, for a request of the most steps any running or queued request
has left (the one an admission is about) and how far each running request has got (so no admission makes a
running request miss the target; `policy_inputs`); `reconfigure(user_config)` can pin either.
Serve caps the requests inside one replica at `max_ongoing_requests`, so that must be >= the policy's
`max_batch_size` (checked at start-up: ray issue 43288, NOTES.md).

Transfer cost: every request to the denoiser carries `sent_at` (unix seconds, stamped by the caller) and the size of
its tensors; the time from `sent_at` to arrival is one transfer measurement. Each finished request also reports its
time in the step loop against its steps' seconds (`observe_service`). `user_config.boundary_delay_s` and
`boundary_bytes_per_s` inject a delay at this stage boundary (benchmarks; this kernel has no netem, NOTES.md).
"""

from __future__ import annotations

import asyncio
import io
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, AsyncIterator

from ray import serve

from vidray.buckets import Bucket
from vidray.inference.request import GenerationRequest
from vidray.plan_inference import check_generation_fits
from vidray.serve.images import IMAGE_FORMATS
from vidray.serve.metrics import DenoiserMetrics, gauge_refresh_s
from vidray.serve.policy import BatchPolicy, PolicyConfig, check_max_ongoing_requests

__all__ = ["Denoiser", "TextEncoder", "VaeDecoder", "policy_inputs", "tensor_bytes"]

logger = logging.getLogger("ray.serve")

ARRIVAL_GAPS_KEPT = 32
"""Most recent gaps between arrivals the denoiser keeps for the policy's wait (`BatchPolicy.decide`)."""

PROGRESS_EVERY_S = 0.25
"""Least seconds between two progress events of one request (each is a message back through Ray)."""


def tensor_bytes(*tensors) -> int:
    """Total bytes of the given tensors (None entries count 0)."""
    return sum(int(t.numel() * t.element_size()) for t in tensors if t is not None)


def _max_ongoing_requests() -> int | None:
    """This replica's max_ongoing_requests (None outside a replica). Reads Serve's replica context."""
    try:
        return int(serve.get_replica_context()._deployment_config.max_ongoing_requests)
    except Exception:  # noqa: BLE001 - not in a replica, or Serve moved the field: skip the check
        return None


def _load(model_path: str, component: str, lora_path: str | None = None, *, also: tuple[str, ...] = (),
          expert: str | None = None, memory: dict[str, Any] | None = None):
    """The model folder's `component` alone ("transformer", "vae" or "text_encoder" with its tokenizer; the
    others are None and never read: `vidray.models.export.load_model`), and the components named in `also`
    (the VAE stage's "image_encoder": None for a model without one), with the LoRA at `lora_path` merged into the
    transformer when given, the transformer as the one `expert` of two when given, on this replica's GPU when it
    has one (`ray_actor_options.num_gpus`), else the CPU, stored and placed per `memory` (the serve config's
    `memory:`, a `vidray.config.MemoryConfig` as a dict; None: the defaults, bf16 on a GPU and fp32 on CPU:
    `vidray.models.offload.prepare_for_inference`). Raises UserError for an offload mode on a replica without a
    GPU."""
    from vidray.config import MemoryConfig  # heavy: pydantic
    from vidray.models.export import load_model  # heavy: pydantic
    from vidray.models.offload import inference_device, prepare_for_inference  # heavy: torch, accelerate, safetensors

    model = load_model(model_path, lora_path=lora_path, components=(component, *also), expert=expert)
    device = inference_device()
    compute = prepare_for_inference(model.components, MemoryConfig(**(memory or {})), device,
                                    family_name=model.family.name)
    logger.info("%s of %s on %s in %s", component, model_path, device, str(compute).removeprefix("torch."))
    return model


def _check_fits(model_path: str, largest_request: tuple[int, int, int], memory: dict[str, Any] | None,
                cfg: int = 1, context: int = 1) -> None:
    """On a replica with a GPU, refuse (UserError, one line naming the mode that would fit) a model whose largest
    request (num_frames, height, width: the serve config's `limits.max_*`), with guidance, is predicted not to fit
    its GPU in the configured `memory` modes (`vidray.plan_inference.check_generation_fits`; one request: a batch
    of several adds their activations). A replica spanning GPUs splits that request, it does not copy it: `cfg` 2
    (CFG parallel) gives each GPU one guidance branch (batch 1, not 2), `context` > 1 each GPU 1/context of the
    sequence (context parallel); every GPU still holds the whole transformer. Nothing is checked on CPU."""
    from vidray.config import MemoryConfig  # heavy: pydantic
    from vidray.models.offload import inference_device  # heavy: torch, accelerate, safetensors

    mem = MemoryConfig(**(memory or {}))
    check_generation_fits(model_path, Bucket(*largest_request), inference_device(), storage=mem.storage_dtype,
                          offload=mem.offload, guidance_scale=2.0, cfg=cfg, context=context)


@serve.deployment(name="TextEncoder", max_ongoing_requests=32)
class TextEncoder:
    """prompts -> prompt_embeds (1, L, D) float32 and prompt_attention_mask (1, L) bool, L the model's
    max_sequence_length; prompts of concurrent requests are encoded in one batch (`@serve.batch`)."""

    def __init__(self, model_path: str, memory: dict[str, Any] | None = None):
        model = _load(model_path, "text_encoder", memory=memory)
        self.family = model.family
        self.text_encoder = model.components.text_encoder
        self.tokenizer = model.components.tokenizer
        self.max_sequence_length = model.max_sequence_length
        del model

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.005)
    async def _encode_batch(self, prompts: list[str]) -> list[tuple[Any, Any]]:
        embeds, mask = await asyncio.to_thread(
            self.family.encode_prompt, self.text_encoder, self.tokenizer, list(prompts),
            max_sequence_length=self.max_sequence_length, device="cpu",
        )  # (B, L, D), (B, L) on the CPU: they travel to the Denoiser through Ray's object store
        return [(embeds[i : i + 1].clone(), mask[i : i + 1].clone()) for i in range(len(prompts))]

    async def encode(self, prompt: str) -> tuple[Any, Any]:
        """One prompt -> (prompt_embeds (1, L, D) float32, prompt_attention_mask (1, L) bool) on CPU."""
        return await self._encode_batch(prompt)


@serve.deployment(name="VaeDecoder", max_ongoing_requests=8)
class VaeDecoder:
    """latents (1, C_lat, F_lat, H_lat, W_lat) -> uint8 frames (F, H, W, 3) RGB; and for an image-to-video model
    a first-frame image -> its condition (`encode_image`), with the same VAE (and, for a model that takes image
    embeddings, Wan 2.1 I2V's CLIP, the image encoder this stage also loads).

    One decode at a time per replica: the VAE is not re-entrant. diffusers' `AutoencoderKLMagvit` (EasyAnimate)
    keeps each call's causal-convolution state in its modules (`prev_features`, carried from one temporal chunk to
    the next), so two decodes in two threads mixed each other's chunks: wrong videos, wrong frame counts, or
    "Sizes of tensors must match" for two sizes (a new user's trial). Requests beyond the one decoding wait on an
    `asyncio.Lock`, not in threads; more throughput comes from more replicas (`autoscaling_config`).
    """

    def __init__(self, model_path: str, memory: dict[str, Any] | None = None):
        model = _load(model_path, "vae", also=("image_encoder",), memory=memory)
        self.family = model.family
        self.vae = model.components.vae
        self.image_encoder = model.components.image_encoder  # None unless the model takes image embeddings
        self.image_processor = model.components.image_processor
        self._decoding = asyncio.Lock()
        del model

    async def encode_image(self, image: bytes, bucket: tuple[int, int, int], seed: int = 0) -> Any:
        """An image-to-video request's condition: `image` (the `input_reference` file's bytes: PNG, JPEG, ...) ->
        {"inpaint_latents": (1, C_in, F_lat, H_lat, W_lat) float32} for a `bucket` (F, H, W) video, the image
        resized to the bucket as the family's stock pipeline does (`ModelFamily.condition`, what `vidray generate
        --image` samples with; the family gets a CPU generator seeded with the request's `seed`, as generate gives
        it, which CogVideoX samples the image's posterior from), plus "image_embeds" (1, T, D_img) float32 when the
        model has an image encoder (Wan 2.1 I2V): `ImageCondition.predict_kwargs()`, the request keys the
        `Denoiser` reads. Raises ValueError for bytes PIL cannot decode."""
        import torch  # heavy: torch
        from PIL import Image, UnidentifiedImageError  # heavy: PIL

        try:
            with Image.open(io.BytesIO(bytes(image)), formats=tuple(IMAGE_FORMATS)) as opened:  # as the ingress took
                picture = opened.convert("RGB")
        except UnidentifiedImageError:
            raise ValueError("input_reference is not an image PIL can decode") from None

        def run():
            with torch.inference_mode():
                condition = self.family.condition(  # None: the ingress sends images to image-to-video models only
                    None, encoders=self, image=picture, bucket=Bucket(*bucket),
                    generator=torch.Generator("cpu").manual_seed(int(seed)))
                return {name: tensor.float().cpu() for name, tensor in condition.predict_kwargs().items()}

        async with self._decoding:  # the VAE is not re-entrant (class docstring)
            return await asyncio.to_thread(run)

    async def decode(self, latents) -> Any:
        """Decode one request's latents (see class docstring); numpy uint8 (F, H, W, 3)."""
        from vidray.models.vae import video_to_frames  # heavy: torch, accelerate, safetensors

        def run():
            return video_to_frames(self.family.decode_latents(self.vae, latents))[0]

        async with self._decoding:
            return await asyncio.to_thread(run)


@dataclass
class _Request:
    """One request in the denoiser's queue or running batch: its `GenerationRequest` (as the ingress built it) and
    the batching state around it."""

    state: Any  # vidray.inference.sampler.DenoiseState
    events: asyncio.Queue
    arrived_at: float
    request: GenerationRequest | None = None
    """What to generate, received as-is (None only in tests that build a bare state)."""
    last_step_at: float = 0.0
    admitted_at: float = 0.0
    stepped_s: float = 0.0
    """Seconds of the denoising steps this request ran in (the compute the policy's step times account for)."""
    model_s: float | None = 0.0
    """The policy's predicted seconds for those steps (`BatchPolicy.predict_step_s`); None when a step ran before
    any was measured."""
    last_event_at: float = 0.0
    cancelled: bool = False
    outcome: str | None = None
    """`completed` or `failed` once the step loop is done with it (counted in `DenoiserMetrics`)."""


def policy_inputs(running: list[_Request], pending: deque[_Request] | list[_Request], now: float) -> dict[str, Any]:
    """`BatchPolicy.decide`'s keyword arguments for the next step from the running batch and the queue:
    queue_depth, num_running, num_steps, bytes_per_item and running_progress. `now`: `time.monotonic()` seconds.

    - `num_steps`: the most steps any running or queued request has left (1 when there is none): the request an
      admission is about. (The mean undercounted it: next to requests near their end, a fresh one looked half as
      long, and the policy admitted it into batches whose 16 steps missed the target.)
    - `bytes_per_item`: one request's conditioning in plus its latents out (the first queued one, else the first
      running one; 0 when there is none).
    - `running_progress`: per running request, (seconds since it arrived, steps left).
    """
    remaining = [r.state.steps_left for r in [*running, *pending]]
    first = pending[0].state if pending else (running[0].state if running else None)
    nbytes = 0 if first is None else tensor_bytes(first.prompt_embeds, first.negative_prompt_embeds, first.latents)
    return {
        "queue_depth": len(pending), "num_running": len(running),
        "num_steps": max(1, max(remaining)) if remaining else 1, "bytes_per_item": nbytes,
        "running_progress": [(max(0.0, now - r.arrived_at), r.state.steps_left) for r in running],
    }


@serve.deployment(name="Denoiser", max_ongoing_requests=16)
class Denoiser:
    """The DiT denoising loop of every request on this replica, batched across requests at each step.

    `denoise(request)` streams `{"step": i, "num_inference_steps": n}` after the request's steps (at most every
    PROGRESS_EVERY_S seconds), then
    `{"latents": (1, C, F_lat, H_lat, W_lat) float32, "step": the step they are at}`. request keys: request (the
    `vidray.inference.request.GenerationRequest`, as stored: its bucket, num_inference_steps, guidance_scale and
    seed), prompt_embeds (1, L, D), prompt_attention_mask (1, L), negative_prompt_embeds /
    negative_prompt_attention_mask (or None), sent_at (unix seconds). Noise is drawn as `vidray generate` draws it
    (`initial_noise(latent_shape, seed)`, the latent shape the family's for the request's bucket).

    Two experts (Wan 2.2 A14B, `expert`): a model of two is served by two deployments of this class, each loading
    its expert alone (`expert="high"`, deployment `Denoiser`; `expert="low"`, `LowNoiseDenoiser`), each batching
    its own steps. The high-noise one draws the noise and takes the steps whose timestep is >= the boundary
    (`vidray.models.experts.expert_steps`), then hands its latents and step on; the low-noise one takes the
    request's `latents` and `step` (keys it requires) and the steps after. Without `expert`, a two-expert model is
    one `TwoExperts` that switches per step itself (both experts in one replica).
    """

    def __init__(self, model_path: str, policy: dict[str, Any], lora_path: str | None = None,
                 expert: str | None = None, memory: dict[str, Any] | None = None,
                 largest_request: tuple[int, int, int] | None = None, gpus: int = 1, processes: int = 1,
                 cfg_parallel: bool = True):
        if gpus > 1 and processes > 1:
            raise ValueError(f"Denoiser: gpus ({gpus}) and processes ({processes}) cannot both be above 1; "
                             "use gpus on GPU nodes, processes (gloo, CPU) for tests")
        self.ranks = max(gpus, processes)
        """Processes this replica spans (`vidray.serve.replica_group`): 1, or the GPUs / CPU processes."""
        if largest_request is not None:  # before any weight loads: a GPU too small for the limits' largest video
            from vidray.inference.parallel import generation_degrees  # heavy: torch

            cfg, context = generation_degrees(self.ranks, cfg_parallel)  # how each request is split over the ranks
            _check_fits(model_path, largest_request, memory, cfg=cfg, context=context)
        model = _load(model_path, "transformer", lora_path, expert=expert, memory=memory)
        self.family, self.flow = model.family, model.flow
        self.transformer = model.components.transformer.eval()
        self.group = None
        if self.ranks > 1:  # the other ranks load the same transformer and step every batch with this one
            from vidray.serve.replica_group import ReplicaGroup  # heavy: torch.distributed

            self.group = ReplicaGroup(self.ranks, "nccl" if gpus > 1 else "gloo", cfg_parallel)
            self.group.start(self.transformer, model.family.name, _load, (model_path, "transformer", lora_path),
                             {"expert": expert, "memory": memory})
        self.expert = expert
        self.boundary_timestep = (None if expert is None
                                  else model.experts.boundary_ratio * self.flow.num_train_timesteps)
        del model
        self.policy_config = PolicyConfig(**policy)
        self.policy = BatchPolicy(self.policy_config)
        max_ongoing = _max_ongoing_requests()
        if max_ongoing is not None:  # Serve caps a replica's requests there, and so every batch (NOTES.md)
            check_max_ongoing_requests(self.policy_config, max_ongoing)
        self.boundary_delay_s = 0.0
        self.boundary_bytes_per_s = 0.0
        self._pending: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._last_arrival: float | None = None
        self._arrival_gaps_s: deque[float] = deque(maxlen=ARRIVAL_GAPS_KEPT)
        self._stats = {"completed": 0, "busy_s": 0.0, "started_at": time.time()}
        self._steps_by_batch_size: dict[int, int] = {}  # steps run per batch size; `stats` derives the totals
        self.metrics = DenoiserMetrics()
        self._last_decision = None  # the policy's last `Decision`, re-set in the gauges while idle

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """user_config keys (all optional): batch_size / wait_s (pin the policy's choice; null = adaptive),
        boundary_delay_s (seconds added to every request's arrival), boundary_bytes_per_s (a simulated link:
        each request also waits its tensor bytes / this; 0 = off). Unknown keys raise ValueError."""
        known = {"batch_size", "wait_s", "boundary_delay_s", "boundary_bytes_per_s"}
        unknown = set(user_config) - known
        if unknown:
            raise ValueError(f"Denoiser user_config: unknown keys {sorted(unknown)}; valid: {sorted(known)}")
        self.policy.override(batch_size=user_config.get("batch_size"), wait_s=user_config.get("wait_s"))
        delay = float(user_config.get("boundary_delay_s") or 0.0)
        rate = float(user_config.get("boundary_bytes_per_s") or 0.0)
        if delay < 0 or rate < 0:
            raise ValueError(f"Denoiser user_config: boundary_delay_s ({delay}) and boundary_bytes_per_s ({rate}) "
                             "must be >= 0")
        self.boundary_delay_s, self.boundary_bytes_per_s = delay, rate

    def stats(self) -> dict[str, Any]:
        """Counters for benchmarks and logs: steps run per batch size ({b: steps}) and, derived from it, steps run
        and items stepped (sum of batch sizes); the processes the replica spans (`ranks`) and its CFG-parallel and
        context-parallel degrees (a batch is split over them, not copied: under CFG parallel each GPU runs B
        samples, not 2B); requests completed, busy seconds, queue depth, running, and the
        policy's fitted terms."""
        hist = dict(sorted(self._steps_by_batch_size.items()))
        parallel = None if self.group is None else self.group.parallel
        return {**self._stats, "steps": sum(hist.values()), "items_stepped": sum(b * n for b, n in hist.items()),
                "steps_by_batch_size": hist, "ranks": self.ranks,
                "cfg_parallel": 1 if parallel is None else parallel.cfg,
                "context_parallel": 1 if parallel is None else parallel.context,
                "pending": len(self._pending), "running": len(self._running), "policy": self.policy.snapshot()}

    async def denoise(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Stream progress events, then the latents (see the class docstring)."""
        from vidray.inference.sampler import DenoiseState, initial_noise  # heavy: torch, accelerate, safetensors

        # 1. The stage boundary: injected delay (benchmarks), then one transfer measurement.
        num_bytes = tensor_bytes(request["prompt_embeds"], request.get("negative_prompt_embeds"),
                                 request.get("inpaint_latents"), request.get("image_embeds"), request.get("latents"))
        delay = self.boundary_delay_s + (num_bytes / self.boundary_bytes_per_s if self.boundary_bytes_per_s else 0)
        if delay:
            await asyncio.sleep(delay)
        transfer_s = max(0.0, time.time() - float(request["sent_at"]))
        self.policy.observe_transfer(num_bytes, transfer_s)
        self.metrics.observe_transfer(transfer_s)

        # 2. Queue the request's state for the step loop (at once done when this expert takes none of its steps).
        generation: GenerationRequest = request["request"]
        latent_shape = self.family.latent_shape(generation.bucket, 1)
        sigmas = self.family.objective.inference_sigmas(generation.num_inference_steps, shift=self.flow.shift,
                                                        num_train_timesteps=self.flow.num_train_timesteps)
        start, end = self._steps(request, sigmas)
        state = DenoiseState(
            latents=initial_noise(latent_shape, generation.seed) if start == 0 else request["latents"],
            sigmas=sigmas, step=start, end_step=end,
            prompt_embeds=request["prompt_embeds"],
            prompt_attention_mask=request["prompt_attention_mask"],
            guidance_scale=generation.guidance_scale,
            negative_prompt_embeds=request.get("negative_prompt_embeds"),
            negative_prompt_attention_mask=request.get("negative_prompt_attention_mask"),
            **self._condition(request, latent_shape),
        )
        if state.done:
            self.metrics.count_request("completed")
            yield {"latents": state.latents.float().cpu(), "step": state.step}
            return
        now = time.monotonic()
        if self._last_arrival is not None:  # the recent gaps between arrivals, for the policy's wait
            self._arrival_gaps_s.append(now - self._last_arrival)
        self._last_arrival = now
        entry = _Request(state, asyncio.Queue(), now, request=generation)
        self._pending.append(entry)
        self._wake.set()
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._step_loop())

        # 3. Relay its events until the latents come (or the caller goes away: then it leaves the batch).
        try:
            while True:
                event = await entry.events.get()
                if isinstance(event, BaseException):
                    raise event
                yield event
                if "latents" in event:
                    return
        finally:
            entry.cancelled = True
            self.metrics.count_request(entry.outcome or "cancelled")

    def _steps(self, request: dict[str, Any], sigmas: Any) -> tuple[int, int | None]:
        """[start, end) of the request's steps this replica takes: all (0, None) without an expert, else its
        expert's (`expert_steps`). Raises ValueError when the low-noise expert gets no `latents` at the step it
        starts from."""
        if self.expert is None:
            return 0, None
        from vidray.models.experts import expert_steps  # heavy: torch

        timesteps = self.family.objective.model_timesteps(sigmas[:-1], self.flow.num_train_timesteps)
        start, end = expert_steps(timesteps, self.boundary_timestep, self.expert)
        if start > 0 and (request.get("latents") is None or request.get("step") != start):
            raise ValueError(f"the low-noise expert starts at step {start} of {len(timesteps)}: the request must carry "
                             f"the high-noise expert's latents and step {start}, got step {request.get('step')}")
        return start, end

    def _condition(self, request: dict[str, Any], latent_shape: tuple[int, ...]) -> dict[str, Any]:
        """An image-to-video model's condition for `request`, as `DenoiseState`'s keywords: its "inpaint_latents"
        (1, C_in, F_lat, H_lat, W_lat) (and "image_embeds" (1, T, D_img) for a model that takes them, Wan 2.1 I2V),
        encoded from the first frame by the `VaeDecoder`, or the family's empty condition (text-to-video through the
        image-to-video model, as `vidray generate` without `--image`); nothing for a text-to-video model. Raises
        ValueError for a condition the model does not take."""
        given = {name: request[name] for name in ("inpaint_latents", "image_embeds") if request.get(name) is not None}
        empty = self.family.condition(self.transformer, latent_shape=latent_shape)
        if empty is None:
            if given:
                raise ValueError(f"this model is text-to-video: a request carries no {' or '.join(given)}")
            return {}
        want = empty.predict_kwargs()
        if set(given) - set(want):
            raise ValueError("this model takes no image embeddings: a request carries no image_embeds")
        return {**want, **given}  # what the VaeDecoder encoded, the empty condition for the rest

    async def _step_loop(self) -> None:
        """Admit, step, release, forever (one task per replica). A failure outside a step (a bug) is logged and
        the loop goes on, so the requests it holds are not stranded."""
        while True:
            try:
                await self._loop_once()
            except Exception:  # noqa: BLE001
                logger.exception("denoiser step loop failed; continuing")
                await asyncio.sleep(0.1)

    async def _loop_once(self) -> None:
        """One turn: wait for work, admit per the policy (waiting for arrivals when it says so), one step."""
        self._drop_cancelled()
        if not self._running and not self._pending:
            self._publish_queue()
            self._wake.clear()
            try:  # woken by an arrival; else the gauges are set again (Ray drops one unset for 2 report intervals)
                await asyncio.wait_for(self._wake.wait(), timeout=gauge_refresh_s())
            except asyncio.TimeoutError:
                pass
            return
        decision = self._decide()
        # A fresh batch waits up to wait_s for arrivals until it is full (never while requests are mid-way),
        # deciding again at each arrival. (Stepping at the first arrival started a burst's requests a step or more
        # apart: they left and came back staggered, and the batch never filled again.)
        if not self._running and len(self._pending) < decision.batch_size and decision.wait_s > 0:
            deadline = time.monotonic() + decision.wait_s
            while len(self._pending) < decision.batch_size and decision.wait_s > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=left)
                except asyncio.TimeoutError:
                    pass
                decision = self._decide()
        while self._pending and len(self._running) < decision.batch_size:
            entry = self._pending.popleft()
            entry.admitted_at = time.monotonic()
            self._running.append(entry)
        self._last_decision = decision
        self._publish_queue()
        if not self._running:
            return
        await self._step_once()

    def _publish_queue(self) -> None:
        """The queue, running batch and last policy decision into the gauges (`DenoiserMetrics.set_queue`)."""
        decision = self._last_decision
        self.metrics.set_queue(pending=len(self._pending), running=len(self._running),
                               policy_batch_size=None if decision is None else decision.batch_size,
                               policy_wait_s=None if decision is None else decision.wait_s)

    def _drop_cancelled(self) -> None:
        self._running = [r for r in self._running if not r.cancelled]
        self._pending = deque(r for r in self._pending if not r.cancelled)

    def _decide(self):
        return self.policy.decide(**policy_inputs(self._running, self._pending, time.monotonic()),
                                  arrival_gaps_s=self._arrival_gaps_s)

    async def _step_once(self) -> None:
        """One denoising step for the running group that stepped least recently (round robin over shapes)."""
        from vidray.inference.sampler import (  # heavy: torch, accelerate, safetensors
            NonFiniteLatentsError,
            check_finite_latents,
            step_states,
        )

        groups: dict[tuple, list[_Request]] = {}
        for r in self._running:
            groups.setdefault(r.state.batch_key(), []).append(r)
        batch = min(groups.values(), key=lambda g: min(r.last_step_at for r in g))
        predicted = self.policy.predict_step_s(len(batch))
        start = time.perf_counter()
        try:
            states = [r.state for r in batch]
            # A spanning replica: every other rank gets the states as they are before this step (sent now, awaited
            # after it), and steps them with this one (replica_group's docstring).
            ranks = [] if self.group is None else self.group.step_remote(states)
            await asyncio.to_thread(step_states, self.family, self.transformer, states,
                                    num_train_timesteps=self.flow.num_train_timesteps,
                                    parallel=None if self.group is None else self.group.parallel)
            await asyncio.gather(*ranks)
        except Exception as err:  # noqa: BLE001 - a failed step fails its requests, not the replica
            logger.exception("denoising step failed for %d requests", len(batch))
            for r in batch:
                r.events.put_nowait(RuntimeError(f"denoising step failed: {type(err).__name__}: {err}"))
                r.cancelled = True
                r.outcome = "failed"
            return
        seconds = time.perf_counter() - start
        self.policy.observe_step(len(batch), seconds)
        self.metrics.observe_step(len(batch), seconds)
        self._steps_by_batch_size[len(batch)] = self._steps_by_batch_size.get(len(batch), 0) + 1
        self._stats["busy_s"] += seconds
        now = time.monotonic()
        for r in batch:
            r.last_step_at = now
            r.stepped_s += seconds
            r.model_s = None if predicted is None or r.model_s is None else r.model_s + predicted
            if r.state.done:
                try:
                    check_finite_latents(r.state.latents, r.state.guidance_scale)
                    r.events.put_nowait({"latents": r.state.latents.float().cpu(), "step": r.state.step})
                    r.outcome = "completed"
                except NonFiniteLatentsError as err:  # the request fails with it; the others go on
                    r.events.put_nowait(err)
                    r.outcome = "failed"
                self._stats["completed"] += 1
                self.policy.observe_service(r.stepped_s, now - r.admitted_at, model_s=r.model_s)
            elif now - r.last_event_at >= PROGRESS_EVERY_S:  # progress travels at most ~4x/s per request
                r.last_event_at = now
                r.events.put_nowait({"step": r.state.step, "num_inference_steps": r.state.num_inference_steps})
        self._running = [r for r in self._running if not r.state.done]
