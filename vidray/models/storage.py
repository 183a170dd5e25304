"""The storage dtype of frozen weights (`memory.storage_dtype`): fp32, bf16, or fp8 stored / bf16 computed.

```python
dtype = resolve_storage_dtype("auto", device)          # fp32 on CPU, bf16 on CUDA (bf16-capable)
apply_storage_dtype(transformer, "fp8", device)        # frozen weights fp8 / bf16, LoRA adapters stay fp32
module_storage_bytes(transformer)                      # bytes of its parameters and buffers, as stored
```

- `fp32`: nothing changes.
- `bf16`: every frozen parameter (`requires_grad` False, name without `lora_`) is stored and computed in bfloat16.
- `fp8`: as bf16, then diffusers' layerwise casting (`diffusers.hooks.apply_layerwise_casting`, diffusers 0.42.1
  `hooks/layerwise_casting.py`) on the frozen `Linear` / `Conv*` / `Embedding` layers: their weights are stored as
  `torch.float8_e4m3fn` and cast to bfloat16 for their own forward, one layer at a time (a pre-forward hook casts
  up, a post-forward hook casts back down). Skipped (kept bf16): diffusers' default patterns (`pos_embed`,
  `patch_embed`, `norm`, `^proj_in$`, `^proj_out$`), the model class's `_skip_layerwise_casting_patterns` and
  `_keep_in_fp32_modules` (Wan: `patch_embedding`, `condition_embedder`, `norm`), as
  `ModelMixin.enable_layerwise_casting` adds them; and always every layer holding a trainable parameter and every
  peft adapter (`lora_A`, `lora_B`, ...): trainable weights keep fp32 masters.

Why diffusers' layerwise casting and not torchao or optimum-quanto: neither is installed (vidray's pinned set has
diffusers 0.42.1, peft and torch only), and neither is needed: fp8 *storage* with bf16 *compute* casts a layer's
weight up before its matmul, so it needs no fp8 kernels and runs wherever torch has the float8 dtypes (every CPU and
CUDA device of torch >= 2.1); torchao's float8 training (fp8 matmuls) needs sm89+ (Ada, Hopper), and quanto's qfloat8
is EasyAnimate's inference path, not a training one. It is also what finetrainers uses for LoRA on a frozen fp8
base, and it composes with peft: the adapters' own layers are skipped, and diffusers disables peft's input cast so
the adapters see bf16 activations, not fp8 ones.

Compute: the frozen weights are bf16 at compute time and the activations that meet them must be too: a training
forward runs under `torch.autocast(bf16 | fp16)` (`train.mixed_precision`), and inference modules (VAE, text and
image encoders) run whole in bf16. So `auto` resolves to fp32 where there is no autocast (`mixed_precision="no"`),
and an explicit `bf16` / `fp8` there is refused. No device refusal is needed for fp8: the casts run on any device;
a CUDA device without bf16 (compute capability < 8.0) is refused for `bf16` / `fp8` and `auto` gives fp32 there.
"""

from __future__ import annotations

import re

import torch

__all__ = ["STORAGE_DTYPES", "apply_storage_dtype", "frozen_parameter_names", "input_dtype",
           "module_storage_bytes", "resolve_storage_dtype", "storage_dtype_name"]

STORAGE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
"""`memory.storage_dtype` (other than `auto`) -> the dtype frozen weights are stored in."""

COMPUTE_DTYPE = torch.bfloat16
"""The dtype bf16- and fp8-stored weights compute in."""

ADAPTER_PATTERN = "lora_"
"""Parameters and modules whose name holds this are peft adapters: never cast, whatever their requires_grad."""

def _bf16_capable(device: torch.device) -> bool:
    """False only for a CUDA device without native bf16 (compute capability < 8.0)."""
    return device.type != "cuda" or torch.cuda.is_bf16_supported(including_emulation=False)


def resolve_storage_dtype(setting: str, device: torch.device | str, *, mixed_precision: str = "bf16") -> torch.dtype:
    """The dtype frozen weights are stored in for `memory.storage_dtype` = `setting` on `device`.

    `auto`: bf16 on a bf16-capable CUDA device when the modules' computation is bf16-ready (`mixed_precision` is
    `bf16` or `fp16`: a training forward under autocast, or an inference module that runs whole in bf16), else fp32
    (CPU: the existing fp32 numerics stay). Args: setting `auto | fp32 | bf16 | fp8`; device a torch device or its
    name; mixed_precision `train.mixed_precision` of the forward that uses the weights (default `bf16`: inference
    modules). Raises ValueError for an unknown setting, for `bf16` / `fp8` with `mixed_precision="no"` (fp32
    activations would meet bf16 weights) or on a CUDA device without bf16."""
    device = torch.device(device)
    if setting == "auto":
        if device.type == "cuda" and mixed_precision != "no" and _bf16_capable(device):
            return torch.bfloat16
        return torch.float32
    if setting not in STORAGE_DTYPES:
        raise ValueError(f"memory.storage_dtype must be one of auto, {', '.join(STORAGE_DTYPES)}, got {setting!r}")
    if setting == "fp32":
        return torch.float32
    if mixed_precision == "no":
        raise ValueError(f"memory.storage_dtype: {setting} computes the frozen weights in bf16: set "
                         "train.mixed_precision: bf16 (autocast), or use memory.storage_dtype: fp32")
    if not _bf16_capable(device):
        raise ValueError(f"memory.storage_dtype: {setting} computes in bf16, which {device} (compute capability < 8.0) "
                         "lacks: use memory.storage_dtype: fp32")
    return STORAGE_DTYPES[setting]


def storage_dtype_name(dtype: torch.dtype) -> str:
    """`fp32` / `bf16` / `fp8` for a dtype of `STORAGE_DTYPES` (the name identities and logs use)."""
    return {v: k for k, v in STORAGE_DTYPES.items()}[dtype]


def frozen_parameter_names(module: torch.nn.Module) -> list[str]:
    """Names of `module`'s parameters a storage dtype applies to: `requires_grad` False and not a peft adapter's."""
    return [name for name, param in module.named_parameters()
            if not param.requires_grad and ADAPTER_PATTERN not in name]


def _skip_patterns(module: torch.nn.Module) -> tuple[str, ...]:
    """Layerwise casting's skip patterns for `module`: diffusers' defaults, the class's own
    (`_skip_layerwise_casting_patterns`, `_keep_in_fp32_modules`, as `ModelMixin.enable_layerwise_casting` adds
    them, for every diffusers model inside `module`, prefixed by its name), the peft adapters, and each module
    that holds a trainable parameter (exact name)."""
    from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN as default  # heavy: diffusers
    patterns = list(default) + [ADAPTER_PATTERN]
    for prefix, sub in module.named_modules():
        if not hasattr(sub, "_skip_layerwise_casting_patterns") and not hasattr(sub, "_keep_in_fp32_modules"):
            continue  # neither a diffusers nor a transformers model (UMT5 casts its inputs to `wo`'s dtype)
        own = [*default, *(getattr(sub, "_skip_layerwise_casting_patterns", None) or []),
               *(getattr(sub, "_keep_in_fp32_modules", None) or [])]
        for pattern in own:  # relative to that model: anchored ones re-anchored under its name
            patterns.append(f"^{re.escape(prefix)}\\.{pattern[1:]}" if prefix and pattern.startswith("^") else pattern)
    trainable = {name.rpartition(".")[0] for name, param in module.named_parameters() if param.requires_grad}
    patterns += [f"^{re.escape(name)}$" for name in sorted(trainable) if name]
    return tuple(dict.fromkeys(patterns))


def apply_storage_dtype(module: torch.nn.Module, setting: str, device: torch.device | str, *,
                        mixed_precision: str = "bf16") -> torch.dtype:
    """Store `module`'s frozen weights in the dtype `setting` resolves to on `device` (`resolve_storage_dtype`), in
    place; trainable parameters and peft adapters keep their dtype (fp32 masters). Call it before moving a large
    module to the GPU (the cast then happens in host memory) and after `apply_lora` (so the adapters exist and are
    trainable). Returns the resolved dtype. fp8: diffusers' layerwise casting (module docstring); the module must
    then run its forward with bf16 activations (autocast in training). Raises ValueError as
    `resolve_storage_dtype`."""
    dtype = resolve_storage_dtype(setting, device, mixed_precision=mixed_precision)
    if dtype == torch.float32:
        return dtype
    frozen = set(frozen_parameter_names(module))
    for name, param in module.named_parameters():
        if name in frozen and param.is_floating_point() and param.dtype != COMPUTE_DTYPE:
            param.data = param.data.to(COMPUTE_DTYPE)
    if dtype == torch.float8_e4m3fn:
        from diffusers.hooks import apply_layerwise_casting  # heavy: torch, diffusers, transformers

        apply_layerwise_casting(module, storage_dtype=dtype, compute_dtype=COMPUTE_DTYPE,
                                skip_modules_pattern=_skip_patterns(module), non_blocking=False)
    return dtype


def input_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype a family's probe makes its inputs in, from the model's first parameter `param`: its dtype, but
    fp32 when it is a frozen weight stored in bf16 / fp8 (the model then runs under bf16 autocast)."""
    if param.dtype == torch.float8_e4m3fn or (param.dtype == COMPUTE_DTYPE and not param.requires_grad):
        return torch.float32
    return param.dtype


def module_storage_bytes(module: torch.nn.Module) -> int:
    """Bytes `module`'s parameters and buffers take as stored now (numel x element size, each tensor once)."""
    seen: set[int] = set()
    total = 0
    for tensor in (*module.parameters(), *module.buffers()):
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        total += tensor.numel() * tensor.element_size()
    return total
