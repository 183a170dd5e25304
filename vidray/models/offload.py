"""Inference placement: the device, the dtypes and the offload mode of a model's components for sampling
(`vidray generate`, the serving stages, validation samples), from the `memory:` section (`vidray.config.MemoryConfig`).

`prepare_for_inference(components, memory, device)` is the one entry: it stores each component's weights in the
configured dtype (`memory.storage_dtype`: auto -> bf16 on CUDA, fp32 on CPU; fp8 = float8_e4m3fn storage with bf16
compute, diffusers' layerwise casting), then places them by `memory.offload` (`apply_inference_offload`):

- `none`: every component on the device.
- `model`: one component on the device at a time (text encoder, image encoder, transformer, VAE; for a Wan2.2
  `TwoExperts` each expert is its own member, so only the expert in use is on the device). diffusers'
  `enable_model_cpu_offload` needs a `DiffusionPipeline`, which vidray's sampler does not hold, and accelerate's
  `cpu_offload_with_hook` chain offloads only the previous module of a fixed order (an image-to-video request runs
  the VAE before the text encoder, so two would stay resident). So each member gets `OneResidentHook`, a small
  accelerate `ModelHook`: before its forward it moves every other resident member of its group back to the host,
  itself to the device, and its inputs after it. Being an accelerate hook (`_hf_hook`), it also runs before a
  diffusers VAE's `encode` / `decode` (diffusers' `apply_forward_hook`).
- `group`: the transformer's blocks stream from host memory one group ahead (diffusers' `apply_group_offloading`,
  block level, one block per group, on a CUDA side stream when the device is CUDA), the other components as `model`.
- `sequential`: every component under accelerate's `cpu_offload` (each leaf module's weights go to the device for its
  own computation; diffusers' `enable_sequential_cpu_offload` is the same call): the least device memory.

The sampler reads where a component computes with `execution_device(module)` and in which dtype with
`compute_dtype(module)` (its parameters may sit on the host, on the meta device under `sequential`, or in float8),
not from its first parameter.

Offload modes need CUDA (`offload_problem`): on a CPU they would only copy between two places in one memory. The
hooks themselves take any device, so the unit tests run each mode with the CPU as the onload device and compare the
frames with `none`'s.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from accelerate import cpu_offload
from accelerate.hooks import ModelHook, add_hook_to_module
from accelerate.utils import send_to_device

from vidray.cards import get_card
from vidray.errors import UserError
from vidray.models.experts import TwoExperts
from vidray.models.storage import apply_storage_dtype, storage_dtype_name

__all__ = ["OFFLOAD_MODES", "OneResidentHook", "apply_inference_offload", "compute_dtype", "execution_device",
           "inference_device", "offload_problem", "prepare_for_inference", "inference_dtypes",
           "vae_compute_dtype"]

OFFLOAD_MODES = ("none", "model", "group", "sequential")
"""`memory.offload` values (`vidray.config.MemoryConfig.offload`)."""

STORAGE_DTYPES = ("auto", "fp32", "bf16", "fp8")
"""`memory.storage_dtype` values."""

# Which VAE computes in float32 is its family card's `fp32_vae` (`vidray.cards`): diffusers' Wan examples load
# `AutoencoderKLWan` with `torch_dtype=torch.float32` beside a bf16 pipeline (docs/source/en/api/pipelines/wan.md,
# 0.42.1). CogVideoX's, EasyAnimate's and AnimateDiff's examples run the whole pipeline, VAE included, in bf16 / fp16,
# so their VAE follows the storage dtype (bf16; fp8 storage is not used for a VAE: its convolutions are a small part
# of the bytes and the decode's quality is what the user sees).

_EXECUTION = "_vidray_execution"
"""Attribute holding a module's (device, compute dtype) once `prepare_for_inference` placed it."""


def offload_problem(mode: str, cuda: bool) -> str | None:
    """Why `memory.offload: mode` cannot run (None when it can): an unknown mode, or any mode but `none` without
    a CUDA device (`cuda`: whether the process has one). One line naming the mode and what to use instead."""
    if mode not in OFFLOAD_MODES:
        return f"memory.offload {mode!r} is not a mode: give one of {', '.join(OFFLOAD_MODES)}"
    if mode != "none" and not cuda:
        return (f"memory.offload: {mode} needs a CUDA GPU (it moves weights between host memory and the GPU) and "
                "none is visible here: use memory.offload: none (--offload none) on CPU")
    return None


def inference_device(gpu: bool | None = None) -> torch.device:
    """The device sampling runs on: `cuda` when `gpu` (default: `torch.cuda.is_available()`), else the CPU."""
    if gpu is None:
        gpu = torch.cuda.is_available()
    return torch.device("cuda") if gpu else torch.device("cpu")


def inference_dtypes(setting: str, device: torch.device | str) -> tuple[torch.dtype, torch.dtype]:
    """(storage dtype, compute dtype) of inference for `memory.storage_dtype: setting` on `device` (training's is
    `vidray.models.storage.resolve_storage_dtype`): auto -> bf16 on CUDA, fp32
    elsewhere; fp32 -> (float32, float32); bf16 -> (bfloat16, bfloat16); fp8 -> (float8_e4m3fn, bfloat16). Raises
    ValueError for another setting."""
    if setting not in STORAGE_DTYPES:
        raise ValueError(f"memory.storage_dtype {setting!r}: give one of {', '.join(STORAGE_DTYPES)}")
    if setting == "auto":
        setting = "bf16" if torch.device(device).type == "cuda" else "fp32"
    return {"fp32": (torch.float32, torch.float32), "bf16": (torch.bfloat16, torch.bfloat16),
            "fp8": (torch.float8_e4m3fn, torch.bfloat16)}[setting]


def vae_compute_dtype(family_name: str, compute: torch.dtype) -> torch.dtype:
    """The VAE's dtype for a model of `family_name` whose other components compute in `compute`: float32 for
    the family card says `fp32_vae` (Wan), else `compute`."""
    return torch.float32 if get_card(family_name).fp32_vae else compute


def _apply_storage(module: torch.nn.Module, setting: str, device: torch.device) -> None:
    """Store `module`'s weights per `memory.storage_dtype: setting` for inference: every parameter is frozen
    first (an inference module never trains), then `vidray.models.storage.apply_storage_dtype` casts them: bf16, or
    fp8 through diffusers' layerwise casting (float8_e4m3fn storage, bf16 compute; norms, embeddings, the output
    projection and a transformers encoder's `_keep_in_fp32_modules` stay bf16). fp32 leaves the module as it is."""
    storage, _ = inference_dtypes(setting, device)
    if storage == torch.float32:
        return
    module.requires_grad_(False)
    apply_storage_dtype(module, storage_dtype_name(storage), "cpu")  # cast in host memory, before any move
    for buf in module.buffers():  # floating buffers follow the weights, as `module.to(torch.bfloat16)` does
        if buf.is_floating_point() and buf.dtype == torch.float32:
            buf.data = buf.data.to(torch.bfloat16)


def _mark(module: torch.nn.Module | None, device: torch.device, dtype: torch.dtype) -> None:
    if module is not None:
        object.__setattr__(module, _EXECUTION, (torch.device(device), dtype))


def execution_device(module: torch.nn.Module) -> torch.device:
    """The device `module` computes on: the one `prepare_for_inference` placed it for, else its first parameter's
    (a module never prepared: training, tests)."""
    placed = getattr(module, _EXECUTION, None)
    if placed is not None:
        return placed[0]
    return next(module.parameters()).device


def compute_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype `module` computes in: the one `prepare_for_inference` chose, else its first floating parameter's
    (bfloat16 for a float8-stored one: layerwise casting computes in bf16)."""
    placed = getattr(module, _EXECUTION, None)
    if placed is not None:
        return placed[1]
    dtype = next(module.parameters()).dtype
    return torch.bfloat16 if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else dtype


def _experts(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """A `TwoExperts`' two experts (each offloaded on its own), else [transformer]."""
    if isinstance(transformer, TwoExperts):
        return [transformer.transformer, transformer.transformer_2]
    return [transformer]


class OneResidentHook(ModelHook):
    """`model` offload's hook: before its module's forward (or a diffusers VAE's `encode` / `decode`), every other
    member of `group` that is on the device goes back to the host, the module to `device`, and its inputs too.

    Args:
        device: where the module computes.
        group: the shared list of the hooks of one model's components (this hook appends itself).
    """

    def __init__(self, device: torch.device | str, group: list["OneResidentHook"]):
        super().__init__()
        self.execution_device = torch.device(device)  # the name accelerate's and diffusers' helpers read
        self.group = group
        self.module: torch.nn.Module | None = None
        self.resident = False
        group.append(self)

    def init_hook(self, module):
        self.module = module
        return module.to("cpu")

    def offload(self) -> None:
        """Move the module back to the host (nothing when it is not on the device)."""
        if self.resident and self.module is not None:
            self.module.to("cpu")
            self.resident = False

    def pre_forward(self, module, *args, **kwargs):
        if not self.resident:
            for other in self.group:
                if other is not self:
                    other.offload()
            module.to(self.execution_device)
            self.resident = True
        return (send_to_device(args, self.execution_device), send_to_device(kwargs, self.execution_device))


def _model_offload(modules: Iterable[torch.nn.Module], device: torch.device) -> list:
    """One `OneResidentHook` per module, all in one group: at most one of them on `device` at a time."""
    group: list[OneResidentHook] = []
    for module in modules:
        add_hook_to_module(module, OneResidentHook(device, group))
    return group


def apply_inference_offload(components: Any, mode: str, device: torch.device | str) -> None:
    """Place `components` (`vidray.models.base.Components`, or `Encoders`-like: any of transformer, text_encoder,
    image_encoder, vae may be None or absent) for sampling on `device` per `memory.offload: mode`
    (see the module docstring): none -> every component on `device`; model -> one at a time (each Wan2.2 expert
    its own); group -> the transformer('s experts) under diffusers' block-level group offloading (one block per
    group; a CUDA side stream on CUDA), the rest as model; sequential -> each component under accelerate's
    `cpu_offload`. Call it once, after the storage dtype is applied. Raises ValueError for an unknown mode; the
    CUDA check is the caller's (`offload_problem`): here any device is taken, so the CPU tests run each mode."""
    if mode not in OFFLOAD_MODES:
        raise ValueError(offload_problem(mode, True))
    device = torch.device(device)
    transformer = getattr(components, "transformer", None)
    others = [getattr(components, name, None) for name in ("text_encoder", "image_encoder", "vae")]
    others = [m for m in others if m is not None]
    experts = _experts(transformer) if transformer is not None else []
    if mode == "none":
        for module in [*experts, *others]:
            module.to(device)
    elif mode == "model":
        _model_offload([*others[:-1], *experts, *others[-1:]], device)
    elif mode == "group":
        from diffusers.hooks import apply_group_offloading  # heavy: torch, diffusers, transformers

        for expert in experts:
            apply_group_offloading(expert, onload_device=device, offload_device=torch.device("cpu"),
                                   offload_type="block_level", num_blocks_per_group=1,
                                   use_stream=device.type == "cuda")
        group = _model_offload(others, device)

        def offload_others(module, args) -> None:  # the text encoder leaves the device when denoising starts
            for hook in group:
                hook.offload()

        for expert in experts:
            expert.register_forward_pre_hook(offload_others)
    else:  # sequential
        for module in [*experts, *others]:
            cpu_offload(module, execution_device=device)


def prepare_for_inference(components: Any, memory: Any, device: torch.device | str, *,
                          family_name: str | None = None) -> torch.dtype:
    """Ready `components` for sampling on `device` per `memory` (`vidray.config.MemoryConfig`: storage_dtype and
    offload): each present component stored in the resolved dtype (the VAE in `vae_compute_dtype(family_name, ...)`,
    the tokenizer untouched), then placed (`apply_inference_offload`), and marked with the device and dtype it
    computes in (`execution_device`, `compute_dtype`). Returns the compute dtype of the transformer and encoders.
    On CPU with the defaults (auto, none) nothing changes: fp32 on the CPU, as sampling always ran there. Raises
    UserError for an offload mode the device cannot run (`offload_problem`), ValueError for an unknown dtype."""
    device = torch.device(device)
    problem = offload_problem(memory.offload, device.type == "cuda")
    if problem:
        raise UserError(problem)
    storage, compute = inference_dtypes(memory.storage_dtype, device)
    setting = memory.storage_dtype if memory.storage_dtype != "auto" else ("bf16" if compute != torch.float32
                                                                          else "fp32")
    transformer = getattr(components, "transformer", None)
    for name in ("transformer", "text_encoder", "image_encoder"):
        module = getattr(components, name, None)
        if module is not None:
            for part in (_experts(module) if name == "transformer" else [module]):
                _apply_storage(part, setting, device)
                _mark(part, device, compute)
    vae = getattr(components, "vae", None)
    if vae is not None:
        vae_dtype = vae_compute_dtype(family_name or "", compute)
        vae.to(vae_dtype)
        _mark(vae, device, vae_dtype)
    _mark(transformer, device, compute)
    apply_inference_offload(components, memory.offload, device)
    return compute
