"""The inference memory planner: the GPU and host bytes of generating one video, from shapes and dtypes alone (no
weights, no allocation), for each storage dtype x offload mode (`memory.storage_dtype`, `memory.offload`); which
fits a GPU; `check_inference_fits`, the check `vidray generate` and the Serve app run before loading anything on a
CUDA device. `vidray plan --inference` prints it.

| term | bytes | source |
|---|---|---|
| transformer | its parameters in the storage dtype: bf16 2 bytes; fp8 1 byte a castable Linear / conv parameter, 2 for the rest (`vidray.train.plan.frozen_bytes`); Wan2.2: each expert | the meta-device build (`count_model`) |
| text encoder, VAE | parameters x 2 (bf16) or 1 (fp8: nearly all of both are Linear / conv weights) | `vidray.shape_presets` (public checkpoints' counts) |
| denoising step | one block's working set (a = 2 bytes in bf16, no autograd): per token max(attention: 12 D x a + a fp32 norm copy 4 D, MLP: 4 D x a + 2 F x a), x 2 with classifier-free guidance (the batch doubles; 1 a GPU under CFG parallel), over this GPU's tokens (context parallel, degree cp: n_video / cp, and text / cp for the families whose text goes through the blocks, `vidray.train.plan.local_tokens`, as training counts them); + the latents (4 fp32 copies: noisy, predicted, guided, scheduler step) and prompt_embeds, whole on every GPU | the residual, norm output, both streams' q, k, v and their joint concatenation, the attention output; the MLP's input, hidden and GELU output; calibrated on the measured CPU step of the medium EasyAnimate preset (`benchmarks/_memory_planner.py`: 9 % low with 6 D x a and 2 D x a, within 4 % with these), not a census of Wan's blocks |
| VAE decode | 3 tensors of 8 frames x H x W x 128 channels (bf16): the full-resolution decoder stage of a temporal slice | EasyAnimate's MagVit (block_out_channels 128..512) decodes in temporal slices; Wan's VAE frame by frame with a 2-frame cache |

Per offload mode (diffusers' names; `vidray.models.offload.apply_inference_offload` applies them):
- none: every component on the GPU, + the larger of the denoising step and the VAE decode;
- model (`enable_model_cpu_offload`): one component at a time: the largest of (one transformer / expert + the
  denoising step, the text encoder, the VAE + its decode);
- group (`enable_group_offload`, block level): the transformer's non-block part + 2 blocks (one computing, one in
  flight) + the denoising step, + the largest other component (an upper bound);
- sequential (`enable_sequential_cpu_offload`): the largest single layer (a Linear, or the text encoder's token
  embedding) + the larger of the denoising step and the VAE decode.
Host bytes: 0 for none; every component otherwise (pinned for group), checked against the node like training's
(`vidray.train.plan.HOST_HEADROOM`).

Several GPUs generating one video (`vidray generate --gpus N`, a Denoiser replica spanning N GPUs;
`vidray.inference.parallel.generation_degrees` gives (cfg, context) for N): every GPU holds every component whole
(each rank loads the whole transformer), so only the denoising step is divided: by the guidance branches under CFG
parallel (`cfg` 2: batch 1 a GPU, not 2) and by the context degree (`context`: each GPU's blocks see its share of
the sequence; Ulysses' all-to-alls exchange heads for tokens, so the attention buffers are of the local tokens'
size). The VAE decode runs on one GPU, whole.

The pick: the first that fits in the order bf16 none < fp8 none < bf16 model < fp8 model < bf16 group < fp8 group <
bf16 sequential < fp8 sequential (no transfer first; within an offload mode, bf16 before fp8: fp8's quality cost,
measured by `benchmarks/memory_modes.py`, before more host-to-device traffic per step). The VAE decode term is an
approximation of the decoders' temporal slicing, not a census; the denoising step is checked against a measured CPU
forward (`benchmarks/_memory_planner.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from vidray.cards import get_card
from vidray.buckets import Bucket
from vidray.errors import UserError
from vidray.models.presets import ShapePreset, meta_model, planner_facts, preset_from_pretrained

__all__ = ["INFERENCE_MODES", "InferenceEstimate", "InferenceReport", "check_generation_fits", "check_inference_fits",
           "format_inference_report", "inference_preset", "plan_inference"]

Offload = Literal["none", "model", "group", "sequential"]
INFERENCE_MODES: tuple[Offload, ...] = ("none", "model", "group", "sequential")
"""`memory.offload`'s values, least transfer first."""

STORAGES = ("bf16", "fp8")
"""Storage dtypes planned for a GPU (fp32 is planned only when asked: CPU generation and the benchmark)."""

_TEXT_EMBEDDING = {
    8_291_375_616: 152_064 * 3584,  # Qwen2-VL-7B: vocab x hidden
    5_680_910_336: 256_384 * 4096,  # umT5-XXL: shared embedding
    22_713_216: 30_522 * 384,  # MiniLM-L6
}
"""Entries of the text encoder's token embedding (its largest single layer), by the preset's text encoder size."""

VAE_SLICE_FRAMES = 8
VAE_FULL_RES_CHANNELS = 128


@dataclass(frozen=True)
class InferenceEstimate:
    """GPU and host bytes of one generation in one storage dtype and offload mode."""

    storage: str
    offload: str
    device_bytes: int
    host_bytes: int
    components: dict
    """Bytes of each component in `storage`: transformer (all experts), text_encoder, vae."""
    denoise_bytes: int
    """One denoising step's activations on one GPU (both CFG branches, or one under CFG parallel; over the GPU's
    share of the sequence under context parallel)."""
    decode_bytes: int
    fits: bool = False
    fits_host: bool = True

    @property
    def name(self) -> str:
        return f"{self.storage} storage, offload {self.offload}"

    def keys(self) -> str:
        """The `memory.*` keys (and `vidray generate` flags) that ask for this mode."""
        return f"memory.storage_dtype={self.storage} memory.offload={self.offload}"


@dataclass(frozen=True)
class InferenceReport:
    preset_name: str
    bucket: Bucket
    guidance: bool
    num_experts: int
    gpu_memory_bytes: int
    host_memory_bytes: int | None
    estimates: tuple[InferenceEstimate, ...]
    chosen: InferenceEstimate | None
    cfg: int = 1
    """2: CFG parallel (each GPU runs one guidance branch, batch 1); 1: one GPU runs both (batch 2 with guidance)."""
    context: int = 1
    """Context-parallel degree: GPUs that split each branch's sequence (1: none)."""


def inference_preset(model: str | Path):
    """The shape preset of a diffusers folder (`transformer/config.json`), with `num_experts` 2 when it has a
    `transformer_2` (Wan2.2). Raises UserFileNotFound / UserError as `preset_from_pretrained`."""
    preset = preset_from_pretrained(model)
    if (Path(model) / "transformer_2" / "config.json").is_file():
        preset = ShapePreset(**{**preset.__dict__, "num_experts": 2})
    return preset


def _shape_terms(preset) -> tuple[int, int, int]:
    """(largest Linear weight of the transformer, its non-block parameters, text width) from the meta build."""
    import torch  # heavy: torch

    model = meta_model(preset)
    largest = max(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    blocks = getattr(model, get_card(preset.family).blocks)
    nonblock = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in blocks.parameters())
    text_width = int(preset.config.get(planner_facts(preset.family).text_width_key) or 4096)
    return largest, nonblock, text_width


def plan_inference(preset, *, bucket: Bucket, gpu_memory_bytes: int, guidance: bool = True,
                   text_tokens: int | None = None, host_memory_bytes: int | None = None,
                   storages: tuple[str, ...] = STORAGES, ranks_per_node: int = 1, cfg: int = 1,
                   context: int = 1) -> InferenceReport:
    """Every `storages` x `INFERENCE_MODES` estimate of generating one `bucket` video with `preset` (a
    `vidray.models.presets.ShapePreset`), classifier-free guidance doubling the batch when `guidance` (unless `cfg`
    is 2: CFG parallel, each GPU runs one branch, `vidray.inference.parallel`), each branch's sequence split over
    `context` GPUs (context parallel: the denoising step's tokens divided, the weights whole on every GPU; module
    docstring), on GPUs of `gpu_memory_bytes` each (fits within `vidray.train.plan.HEADROOM`) and, when
    `host_memory_bytes` is given, a node of that much host memory; the pick is the first that fits in the module
    docstring's order. Raises UserError for a bucket the VAE and patch do not divide, or a context degree above 1
    for a family whose card has no `context_parallel`; ValueError for a `cfg` other than 1, 2 or a `context` < 1."""
    from vidray.train.plan import (  # heavy: pydantic
        HEADROOM,
        HOST_HEADROOM,
        STORAGE_BYTES,
        count_model,
        frozen_bytes,
        local_tokens,
        sequence_lengths,
        text_in_blocks,
    )

    if cfg not in (1, 2):
        raise ValueError(f"cfg (the guidance branches' ranks) must be 1 or 2, got {cfg}")
    if context < 1:
        raise ValueError(f"context (the ranks splitting each sequence) must be >= 1, got {context}")
    if context > 1 and not get_card(preset.family).context_parallel:
        raise UserError(f"context degree {context}: model family {preset.family} has no context-parallel plan; "
                        "generate on 1 GPU, or 2 with guidance (CFG parallel)")

    counts = count_model(preset)
    n_video, latent_elems = sequence_lengths(preset, bucket)
    text_tokens = text_tokens or preset.text_seq_len
    largest_linear, nonblock, text_width = _shape_terms(preset)
    batch = 2 // cfg if guidance else 1  # per GPU
    local_video, local_text = local_tokens(preset.family, n_video, text_tokens, context)  # per GPU
    d, f = counts.dim, counts.ffn_dim
    estimates = []
    for offload in INFERENCE_MODES:
        for storage in storages:
            a = 4 if storage == "fp32" else 2
            # 1. The denoising step: one block's working set over this GPU's tokens, the latents and the prompt
            #    embeddings (whole: the split is inside the transformer, the output gathered).
            tokens = local_video + (local_text if text_in_blocks(preset.family) else 0)
            per_token = max(12 * d * a + 4 * d, 4 * d * a + 2 * f * a)
            denoise = batch * (tokens * per_token + text_tokens * text_width * a) + 4 * latent_elems * 4
            decode = 3 * min(bucket.num_frames, VAE_SLICE_FRAMES) * bucket.height * bucket.width * \
                VAE_FULL_RES_CHANNELS * a
            # 2. The components in the storage dtype.
            one_expert = frozen_bytes(counts, storage)
            per_param = STORAGE_BYTES[storage]
            text = preset.text_encoder_params * min(per_param, preset.text_encoder_bytes_per_param if storage != "fp32"
                                                    else 4)
            vae = preset.vae_params * per_param
            transformer = one_expert * preset.num_experts
            components = {"transformer": transformer, "text_encoder": text, "vae": vae}
            total = transformer + text + vae
            # 3. What the mode keeps on the GPU at its peak.
            if offload == "none":
                device, host = total + max(denoise, decode), 0
            elif offload == "model":
                device, host = max(one_expert + denoise, text, vae + decode), total
            elif offload == "group":
                block = max(frozen_bytes(counts, storage, i) for i in range(counts.num_layers))
                nonblock_bytes = nonblock * (a if storage != "fp8" else 2)
                device, host = nonblock_bytes + 2 * block + denoise + max(text, vae), total
            else:
                largest = max(largest_linear, _TEXT_EMBEDDING.get(preset.text_encoder_params, 0)) * a
                device, host = largest + max(denoise, decode), total
            fits_host = host_memory_bytes is None or host * ranks_per_node <= (1 - HOST_HEADROOM) * host_memory_bytes
            estimates.append(InferenceEstimate(
                storage=storage, offload=offload, device_bytes=device, host_bytes=host, components=components,
                denoise_bytes=denoise, decode_bytes=decode, fits_host=fits_host,
                fits=device <= (1 - HEADROOM) * gpu_memory_bytes and fits_host))
    chosen = next((e for e in estimates if e.fits), None)
    return InferenceReport(preset_name=preset.name, bucket=bucket, guidance=guidance, cfg=cfg, context=context,
                           num_experts=preset.num_experts,
                           gpu_memory_bytes=gpu_memory_bytes, host_memory_bytes=host_memory_bytes,
                           estimates=tuple(estimates), chosen=chosen)


def _cfg_words(report: InferenceReport) -> str:
    words = ("no CFG" if not report.guidance else
             "CFG parallel (batch 1 per GPU)" if report.cfg == 2 else "CFG (batch 2)")
    if report.context > 1:
        words += f", the sequence split over {report.context} GPUs (context degree {report.context})"
    return words


def _split_words(cfg: int, context: int, guidance: bool) -> str:
    """How one video is split over GPUs, for the error message ("" on one GPU)."""
    parts = (["one guidance branch a GPU"] if cfg == 2 and guidance else []) + (
        [f"the sequence split over {context} GPUs: context degree {context}"] if context > 1 else [])
    return f", on each of {cfg * context} GPUs ({'; '.join(parts)})" if parts else ""


def _gpus_flag(cfg: int, context: int, guidance: bool) -> str:
    """` --gpus N` when `vidray generate --gpus N` splits one video as (cfg, context) does ("" on one GPU, or for a
    split generate does not make: a Denoiser with `cfg_parallel: false` under guidance)."""
    from vidray.inference.parallel import generation_degrees  # heavy: torch

    n = cfg * context
    return f" --gpus {n}" if n > 1 and generation_degrees(n, guidance) == (cfg, context) else ""


def format_inference_report(report: InferenceReport) -> str:
    """The inference plan as a table (GiB), the pick and how to ask for it."""
    from vidray.train.plan import HEADROOM, format_bytes  # heavy: pydantic

    b = report.bucket
    gib = 2**30
    lines = [f"generation with {report.preset_name}"
             f"{f' ({report.num_experts} experts)' if report.num_experts > 1 else ''}: {b.num_frames}x{b.height}x"
             f"{b.width}, {_cfg_words(report)}; one GPU of "
             f"{format_bytes(report.gpu_memory_bytes)}, {100 * HEADROOM:.0f}% headroom", "",
             f"{'storage':<9}{'offload':<12}{'transformer':>12}{'text enc':>10}{'vae':>8}{'denoise':>9}"
             f"{'decode':>8}{'GPU':>8}{'host':>8}  fits"]
    for e in report.estimates:
        mark = "yes" if e.fits else ("no (host)" if not e.fits_host else "no")
        if report.chosen is e:
            mark += "  <- picked"
        c = e.components
        lines.append(f"{e.storage:<9}{e.offload:<12}{c['transformer'] / gib:>12.1f}{c['text_encoder'] / gib:>10.1f}"
                     f"{c['vae'] / gib:>8.1f}{e.denoise_bytes / gib:>9.1f}{e.decode_bytes / gib:>8.1f}"
                     f"{e.device_bytes / gib:>8.1f}{e.host_bytes / gib:>8.1f}  {mark}")
    lines += ["", "GiB; GPU = the mode's peak on the device, host = the components held in host memory"]
    if report.chosen is not None:
        c = report.chosen
        lines.append(f"picked: {c.name}: {format_bytes(c.device_bytes)} on the GPU, {format_bytes(c.host_bytes)} "
                     f"host memory ({c.keys()}; vidray generate --storage-dtype {c.storage} --offload {c.offload})")
    else:
        least = min(report.estimates, key=lambda e: e.device_bytes)
        lines.append(f"picked: none fits; the least is {least.name} at {format_bytes(least.device_bytes)}: use a GPU "
                     f"of {format_bytes(least.device_bytes / (1 - HEADROOM))} or more, or a smaller bucket")
    return "\n".join(lines)


def check_inference_fits(model, *, bucket: Bucket, gpu_memory_bytes: int, storage: str = "bf16",
                         offload: str = "none", guidance: bool = True, text_tokens: int | None = None,
                         host_memory_bytes: int | None = None, cfg: int = 1, context: int = 1) -> InferenceEstimate:
    """Refuse a generation predicted not to fit the GPU, before anything loads: `model` a diffusers folder (its
    `transformer/config.json`; `transformer_2` for a second expert) or a ShapePreset; `storage` bf16 or fp8,
    `offload` one of INFERENCE_MODES; `cfg` 2: CFG parallel, `context` the context-parallel degree (each GPU of
    cfg x context runs its share: `plan_inference`). Returns the estimate when it fits; raises UserError, one line,
    naming the bytes needed, the GPU, the split (its context degree) when there is one, and the storage and
    offload mode that would fit (or the GPU size the least-needing mode fits), and `--gpus 2` when on one GPU the
    asked mode fits under CFG parallel; UserFileNotFound for a folder without the transformer's config."""
    from vidray.train.plan import HEADROOM, format_bytes  # heavy: pydantic

    if offload not in INFERENCE_MODES:
        raise UserError(f"memory.offload {offload!r} is not one of {', '.join(INFERENCE_MODES)}")
    if storage not in ("fp32", "bf16", "fp8"):
        raise UserError(f"memory.storage_dtype {storage!r} is not one of fp32, bf16, fp8")
    preset = inference_preset(model) if isinstance(model, (str, Path)) else model
    storages = tuple(dict.fromkeys((storage, *STORAGES)))
    report = plan_inference(preset, bucket=bucket, gpu_memory_bytes=gpu_memory_bytes, guidance=guidance,
                            text_tokens=text_tokens, host_memory_bytes=host_memory_bytes, storages=storages, cfg=cfg,
                            context=context)
    wanted = next(e for e in report.estimates if (e.storage, e.offload) == (storage, offload))
    if wanted.fits:
        return wanted
    chosen = report.chosen
    if chosen is not None:
        fix = f"{chosen.keys()} fits ({format_bytes(chosen.device_bytes)}): vidray generate --storage-dtype " \
              f"{chosen.storage} --offload {chosen.offload}{_gpus_flag(cfg, context, guidance)}"
    else:
        least = min(report.estimates, key=lambda e: e.device_bytes)
        fix = (f"nothing fits: the least is {least.keys()} at {format_bytes(least.device_bytes)}, for a GPU of "
               f"{format_bytes(least.device_bytes / (1 - HEADROOM))} or more; or a smaller bucket")
    if guidance and cfg == 1 and context == 1:
        split = next(e for e in plan_inference(
            preset, bucket=bucket, gpu_memory_bytes=gpu_memory_bytes, guidance=guidance, text_tokens=text_tokens,
            host_memory_bytes=host_memory_bytes, storages=storages, cfg=2).estimates
            if (e.storage, e.offload) == (storage, offload))
        if split.fits:
            fix += (f"; or keep this mode on 2 GPUs with the guidance branches split (vidray generate --gpus 2: "
                    f"{format_bytes(split.device_bytes)} per GPU)")
    what = (f"{format_bytes(wanted.host_bytes)} of host memory, over the node's" if wanted.device_bytes <=
            (1 - HEADROOM) * gpu_memory_bytes else
            f"{format_bytes(wanted.device_bytes)} on the GPU, over {format_bytes((1 - HEADROOM) * gpu_memory_bytes)} "
            f"({100 - 100 * HEADROOM:.0f}% of {format_bytes(gpu_memory_bytes)})")
    raise UserError(f"predicted out of memory: generating {bucket.num_frames}x{bucket.height}x{bucket.width} with "
                    f"{preset.name} in {storage} storage, offload {offload}{_split_words(cfg, context, guidance)} "
                    f"needs {what}; {fix}")



def check_generation_fits(model_path, bucket: Bucket, device, *, storage: str = "auto", offload: str = "none",
                          guidance_scale: float = 1.0, cfg: int = 1, context: int = 1) -> InferenceEstimate | None:
    """The pre-load check of `vidray generate` and the Serve app: on a CUDA `device` (a torch.device or its name),
    `check_inference_fits` of the local diffusers folder `model_path` against that GPU's total memory; `storage`
    auto is bf16 there; `cfg` 2: this GPU runs one guidance branch of two (CFG parallel, `vidray generate --gpus
    2`), so its batch is 1, not 2; `context`: this GPU runs 1/context of each branch's sequence (context parallel;
    `vidray.inference.parallel.generation_degrees` gives both for N GPUs). Returns None, checking nothing, on any
    other device (CPU keeps working as before) or for a model that is not a local folder (a URI: checked once
    downloaded, by the caller). Raises UserError when the generation is predicted not to fit (see
    `check_inference_fits`)."""
    import torch  # heavy: torch

    device = torch.device(device)
    if device.type != "cuda" or not (Path(model_path) / "transformer" / "config.json").is_file():
        return None
    gpu_memory = torch.cuda.get_device_properties(device).total_memory
    return check_inference_fits(model_path, bucket=bucket, gpu_memory_bytes=gpu_memory,
                                storage="bf16" if storage == "auto" else storage, offload=offload,
                                guidance=guidance_scale > 1, cfg=cfg, context=context)
