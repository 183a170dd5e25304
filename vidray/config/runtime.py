"""`memory:`, `placement:` (with the encode stages' `EncodePlacement`) and `storage:`: where weights and stages
live and how results are kept."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal

from pydantic.dataclasses import dataclass

from vidray.config.bounds import NonNegativeFloat, NonNegativeInt, PositiveFloat, Says
from vidray.config.common import _STRICT
from vidray.config.model import StagePlacement


@dataclass(config=_STRICT, kw_only=True)
class EncodePlacement(StagePlacement):
    num_cpus: Annotated[PositiveFloat, Says(
        "logical CPUs (default 0.1)", ": Ray Data with no CPU never runs the stage")] = 0.1
    """Logical CPUs of each of the stage's actors (one per training rank); also its torch threads, rounded, at
    least 1."""
    num_gpus: NonNegativeFloat = 0.0
    """GPUs (or a fraction) of each actor; > 0 encodes on CUDA."""
    memory: NonNegativeInt = 0
    """Bytes of memory Ray reserves for each actor (its `memory` resource; 0: no reservation)."""


STORAGE_DTYPES = ("auto", "fp32", "bf16", "fp8")
"""`memory.storage_dtype` choices (`vidray.models.storage` applies them)."""
INFERENCE_OFFLOADS = ("none", "model", "group", "sequential")
"""`memory.offload` choices (`vidray.models.offload` applies them)."""


@dataclass(config=_STRICT, kw_only=True)
class MemoryConfig:
    """Where the weights live and in which dtype: one schema for training (`memory:` of a job), generation
    (`vidray generate --storage-dtype/--offload`, validation) and serving (`memory:` of the serve config). The
    planner (`vidray plan`) counts every mode; `vidray train`, `vidray generate` and the Serve app refuse a mode the
    device cannot run, or that does not fit, before anything is reserved or loaded."""

    storage_dtype: Literal["auto", "fp32", "bf16", "fp8"] = "auto"
    """Storage dtype of every frozen weight: the text and image encoders, the VAE, the base under LoRA, a Wan2.2
    expert that is not training, and every weight at inference. `bf16`: stored and computed in bfloat16. `fp8`:
    stored as float8_e4m3fn and cast to bfloat16 one layer at a time for its computation (diffusers' layerwise
    casting; norms, embeddings and the output projection stay bf16), about half bf16's bytes at a measured quality
    cost (`benchmarks/memory_modes.py`). `auto`: bf16 on a CUDA device, fp32 on CPU. Trainable weights keep fp32
    masters in every mode. Training (`vidray.models.storage`): the base under `model.lora` with `scaling.strategy:
    ddp` (a sharded base stays FSDP's), and the encode stages' encoders (auto: bf16 on a GPU stage); a bf16 / fp8
    base computes under autocast, so it needs `train.mixed_precision: bf16` (auto then stays fp32), and fp8 needs
    `train.activation_checkpointing` (without recomputation autograd keeps each layer's bf16 weight copy for the
    backward). With `model.experts` layout groups a rank holds its own expert only; layout shared stores both."""
    block_swap: Annotated[NonNegativeInt, Says("blocks (0: off)")] = 0
    """Training on CUDA with `model.lora`: how many of the frozen base's transformer blocks (the last ones) live in
    pinned host memory and stream to the GPU one block ahead on a side stream, host-to-device only (they are frozen:
    nothing is copied back), for the forward and the backward: musubi-tuner's `blocks_to_swap`. 0: every block stays
    on the GPU. Must be below the model's block count (checked when the model is built). Needs
    `train.activation_checkpointing: full`: each swapped block is recomputed in the backward, which brings its
    weights back one block ahead (`vidray.train.block_swap`)."""
    fsdp_cpu_offload: bool = False
    """Training with `scaling.strategy: fsdp | hsdp`: FSDP2's `CPUOffloadPolicy`: sharded parameters, gradients and
    optimizer state live in pinned host memory, and the optimizer step runs on the CPU (full fine-tuning of a model
    that does not fit even sharded)."""
    activation_offload: bool = False
    """Training with `train.activation_checkpointing` (full or every_<n>): what autograd saves in the DiT's forward
    (the checkpointed blocks' inputs, what the layers outside the blocks save) is copied to pinned host memory and
    back for the backward, while each checkpointed block's recomputation stays on the device (torchtune's
    `enable_activation_offloading`; `vidray.train.step.ActivationOffload`, torch's `save_on_cpu`). Cost: one
    device-to-host copy of each saved tensor in the forward and one host-to-device copy in the backward, every
    step; the planner tries it after block swap. On CPU the tensors are in host memory already (nothing moves)."""
    offload: Literal["none", "model", "group", "sequential"] = "none"
    """Inference (`vidray generate`, validation samples, the serving stages) on CUDA: `none`: every component on
    the GPU; `model`: one component on the GPU at a time, the rest in host memory (what diffusers'
    `enable_model_cpu_offload` does, with a small accelerate hook per component, `vidray.models.offload`; a Wan2.2
    model holds one expert at a time); `group`: the transformer's blocks stream from host memory one block ahead
    on a side stream (diffusers' `apply_group_offloading`, block level), the other components as `model`;
    `sequential`: every layer is moved to the GPU for its own computation (accelerate's `cpu_offload`, as
    diffusers' `enable_sequential_cpu_offload`: the least GPU memory, the slowest). On CPU only `none` applies."""


@dataclass(config=_STRICT, kw_only=True)
class PlacementConfig:
    """Where each stage runs (`vidray.placement`): a label selector per stage. Resources: the DiT trainers'
    in `scaling`, the decode operator's in `data.loader_cpus`, the encode stages' here."""

    dit: StagePlacement = dataclasses.field(default_factory=StagePlacement)
    """The Ray Train workers (the DiT alone: they load neither the VAE nor the text encoder)."""
    decode: StagePlacement = dataclasses.field(default_factory=StagePlacement)
    """Each rank's Ray Data fetch + decode operator (`vidray.data.pipeline.ClipLoader`)."""
    vae: EncodePlacement = dataclasses.field(default_factory=EncodePlacement)
    """Each rank's VAE encode actor (`vidray.data.encode.EncodeStage`): frames -> latents."""
    text: EncodePlacement = dataclasses.field(default_factory=EncodePlacement)
    """Each rank's text encode actor: captions -> prompt_embeds (one actor with the VAE when both stages have
    the same selector and resources)."""


@dataclass(config=_STRICT, kw_only=True)
class StorageConfig:
    path: str = "outputs/runs"
    """Root of run outputs: `<path>/<name>/` holds Ray Train checkpoints, `diffusers/` weights and `samples/`."""
