"""Context (sequence) parallel training: one sample's tokens split over the `ulysses * ring` consecutive ranks of a
context group (`job.parallel.context`), with diffusers' context-parallel hooks and attention (0.42:
`diffusers.hooks.context_parallel.apply_context_parallel`, `diffusers.models.attention_dispatch`).

```python
mesh = context_parallel_mesh(ulysses=2, ring=1, device_type="cuda")   # ("dp", "ring", "ulysses")
apply_lora(transformer, job.model.lora)                                # 1. LoRA (if any)
enable_context_parallel(transformer, mesh, family="wan")               # 2. the plan's split/gather hooks
apply_activation_checkpointing(transformer, "full", blocks)            # 3. AC, then 4. DDP / FSDP
```

A family's *plan* (diffusers' format) says where the sequence is split (the first block's inputs, the rotary
embeddings) and where it is gathered again (`proj_out`'s output); inside, every self-attention exchanges heads for
tokens (Ulysses all-to-all) or passes keys and values round the ring, so it attends over the whole sequence. Wan
uses diffusers' own `WanTransformer3DModel._cp_plan` (video tokens split; cross-attention's text stays whole on
every rank). CogVideoX and EasyAnimate have no plan in diffusers, and their stock attention processors call
`F.scaled_dot_product_attention` themselves, so a plan alone would let each rank attend over its own chunk only:
silently wrong (probe: forward differs by 0.038 at max 2.4). Here they get plans that split text *and* video, and
processors that are copies of the stock ones ending in `dispatch_attention_fn` (which runs the context-parallel
attention). Their joint attention has no mask, so the all-to-all gathering each rank's [text_r; video_r] instead
of [text; video] only permutes the sequence, which unmasked attention does not mind.

Each rank's parameter gradients are partial sums (its share of the tokens); the full gradient is their sum over
the context group. DDP and FSDP average over every rank, so the training loop must scale the loss by the degree
(tests/unit/test_context_parallel.py checks twice the averaged gradient against the full one at degree 2).
Training needs the sequence split evenly and the heads divisible by `ulysses` (diffusers' "anything" modes have no
backward): checked here, one line each. Ring attention needs a backend that returns the log-sum-exp (flash,
cuDNN on GPU); diffusers' native SDPA backend (the CPU one) refuses it.
"""

from __future__ import annotations

import inspect
import warnings
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
from diffusers import WanTransformer3DModel
from diffusers.hooks.context_parallel import apply_context_parallel
from diffusers.models._modeling_parallel import (
    ContextParallelConfig,
    ContextParallelInput,
    ContextParallelOutput,
    ParallelConfig,
)
from diffusers.models.attention import AttentionModuleMixin
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry, dispatch_attention_fn
from diffusers.models.attention_processor import Attention
from diffusers.models.embeddings import apply_rotary_emb

from vidray.models.experts import ExpertSlot, TwoExperts

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["CONTEXT_PARALLEL_FAMILIES", "CogVideoXContextParallelAttnProcessor",
           "EasyAnimateContextParallelAttnProcessor", "check_context_group_in_node", "context_parallel_mesh",
           "context_parallel_plan", "enable_context_parallel"]

MESH_DIMS = ("dp", "ring", "ulysses")
"""The context-parallel mesh's dimensions, outermost first: a context group is `ring * ulysses` consecutive ranks."""


def context_parallel_mesh(ulysses: int, ring: int, *, device_type: str = "cpu") -> "DeviceMesh":
    """The DeviceMesh over the whole default process group, shape (world // (ulysses * ring), ring, ulysses), dims
    ("dp", "ring", "ulysses"): rank r is in context group r // (ulysses * ring), so a group is consecutive ranks
    (inside a node when the degree divides the node's GPUs). `device_type`: "cpu" (gloo) or "cuda" (NCCL).

    Needs an initialised default process group. Raises ValueError when `ulysses * ring` does not divide the world
    size or a degree is below 1."""
    from torch.distributed.device_mesh import init_device_mesh  # heavy: torch.distributed.tensor

    if ulysses < 1 or ring < 1:
        raise ValueError(f"parallel.context: ulysses and ring must be >= 1, got ulysses {ulysses}, ring {ring}")
    world, degree = dist.get_world_size(), ulysses * ring
    if world % degree:
        raise ValueError(f"parallel.context: degree {degree} (ulysses {ulysses} x ring {ring}) must divide the "
                         f"{world} workers; use a multiple of {degree} workers or another degree")
    return init_device_mesh(device_type, (world // degree, ring, ulysses), mesh_dim_names=MESH_DIMS)


def check_context_group_in_node(degree: int, local_world_size: int, cross_node: bool) -> None:
    """Refuse a context group larger than a node (`degree` > `local_world_size`, the workers of one node) unless
    `parallel.context.cross_node` allows it: its all-to-all would then cross the network in every attention.
    Raises ValueError."""
    if degree > local_world_size and not cross_node:
        raise ValueError(f"parallel.context: degree {degree} is larger than a node's {local_world_size} workers, so "
                         "each attention's all-to-all would cross nodes; use a degree <= the GPUs per node, or set "
                         "parallel.context.cross_node: true")


# ---- plans (diffusers' format: `diffusers.models._modeling_parallel.ContextParallelModelPlan`) ----

def _wan_plan() -> dict:
    """diffusers' own: the video tokens at `blocks.0` and the rotary embeddings split, `proj_out` gathered; the
    text (cross-attention's keys and values) stays whole on every rank."""

    return WanTransformer3DModel._cp_plan


def _joint_plan(rope: dict) -> dict:
    """Text and video both split at the first block (joint attention over [text; video], no mask), the rotary
    embeddings of the video tokens split with them (`rope`: where they come from), `proj_out` gathered."""

    return {
        **rope,
        "transformer_blocks.0": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3),
                                 "encoder_hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)},
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


def _cogvideox_plan() -> dict:
    """The rotary embeddings ((S_video, D) cos and sin) come in as the transformer's `image_rotary_emb`."""

    rope = ContextParallelInput(split_dim=0, expected_dims=2)
    return _joint_plan({"": {"image_rotary_emb": [rope, rope]}})


def _easyanimate_plan() -> dict:
    """The rotary embeddings ((S_video, D) cos and sin) are computed in `forward` by `rope_embedding`: its output
    is split."""

    rope = ContextParallelInput(split_dim=0, expected_dims=2, split_output=True)
    return _joint_plan({"rope_embedding": {0: rope, 1: rope}})


_PLANS: dict[str, Callable[[], dict]] = {"wan": _wan_plan, "cogvideox": _cogvideox_plan,
                                         "easyanimate": _easyanimate_plan}

CONTEXT_PARALLEL_FAMILIES = tuple(_PLANS)
"""The families with a context-parallel plan here; their cards say `context_parallel=True` (`vidray.cards`)."""


def context_parallel_plan(family: str) -> dict:
    """`family`'s plan in diffusers' format. Raises ValueError naming the family when it has none."""
    if family not in _PLANS:
        raise ValueError(f"parallel.context: model.family {family} has no context-parallel plan (its attention cannot "
                         f"be split; supported: {', '.join(CONTEXT_PARALLEL_FAMILIES)}); set parallel.context.ulysses "
                         "and .ring to 1")
    return _PLANS[family]()


# ---- the sequence a plan splits: checked at each forward, before diffusers' bare assert ----

def _video_tokens(family: str, config: Any, hidden_states: torch.Tensor) -> int:
    """Latent tokens of the video after patching: Wan and EasyAnimate take (B, C, F, H, W), CogVideoX (B, F, C, H, W)
    with an optional temporal patch."""
    if family == "wan":
        pt, ph, pw = config.patch_size
        _, _, frames, height, width = hidden_states.shape
        return (frames // pt) * (height // ph) * (width // pw)
    p = config.patch_size
    if family == "cogvideox":
        _, frames, _, height, width = hidden_states.shape
        pt = config.patch_size_t
        return ((frames + pt - 1) // pt if pt else frames) * (height // p) * (width // p)
    _, _, frames, height, width = hidden_states.shape
    return frames * (height // p) * (width // p)


def _argument(forward: Callable, name: str, args: tuple, kwargs: dict) -> Any:
    if name in kwargs:
        return kwargs[name]
    names = list(inspect.signature(forward).parameters)[1:]  # skip self
    index = names.index(name) if name in names else len(args)
    return args[index] if index < len(args) else None


def _sequence_check(family: str, degree: int, joint_text: bool) -> Callable:
    """A forward pre-hook for one transformer: ValueError when the video tokens (and, for a joint-attention family,
    the text tokens) do not divide `degree`."""

    def check(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        hidden_states = _argument(type(module).forward, "hidden_states", args, kwargs)
        if isinstance(hidden_states, torch.Tensor) and hidden_states.ndim == 5:
            tokens = _video_tokens(family, module.config, hidden_states)
            if tokens % degree:
                raise ValueError(f"parallel.context: {family}'s transformer got {tokens} video latent tokens (latents "
                                 f"{tuple(hidden_states.shape)}), not divisible by the context degree {degree} (each "
                                 f"worker takes an equal share); pick buckets whose latent tokens divide by {degree}")
        if joint_text:
            text = _argument(type(module).forward, "encoder_hidden_states", args, kwargs)
            if isinstance(text, torch.Tensor) and text.ndim == 3 and text.shape[1] % degree:
                raise ValueError(f"parallel.context: {family}'s transformer got {text.shape[1]} text tokens, not "
                                 f"divisible by the context degree {degree} (joint attention splits text with video); "
                                 f"set model.max_sequence_length to a multiple of {degree}")

    return check


# ---- attention processors that run the context-parallel attention ----

def _attend(processor: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            attention_mask: torch.Tensor | None) -> torch.Tensor:
    """(B, H, S, D) query, key, value -> (B, H, S, D): `F.scaled_dot_product_attention`'s result through diffusers'
    `dispatch_attention_fn` ((B, S, H, D) layout), which runs the context-parallel attention when the processor has
    a `_parallel_config`. Raises ValueError for a mask under context parallel (it would be the local chunk's)."""
    if attention_mask is not None and processor._parallel_config is not None:
        raise ValueError("context-parallel attention takes no attention mask (each rank holds a chunk of the "
                         "sequence); the stock CogVideoX and EasyAnimate transformers pass none")
    out = dispatch_attention_fn(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                attn_mask=attention_mask, backend=processor._attention_backend,
                                parallel_config=processor._parallel_config)
    return out.transpose(1, 2)


class CogVideoXContextParallelAttnProcessor:
    """diffusers' `CogVideoXAttnProcessor2_0` (attention_processor.py, 0.42.1) with its SDPA call replaced by
    `dispatch_attention_fn`, so `enable_context_parallel` can give it the parallel config: joint attention over
    [text; video], the rotary embedding on the video part; same inputs and outputs as the stock one."""

    _attention_backend = None
    _parallel_config = None

    def __call__(self, attn: Attention, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                 attention_mask: torch.Tensor | None = None,
                 image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
        text_seq_length = encoder_hidden_states.size(1)
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)  # (B, L + S, C)
        batch_size, sequence_length, _ = hidden_states.shape
        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
            attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])
        query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        head_dim = key.shape[-1] // attn.heads
        query, key, value = (x.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
                             for x in (query, key, value))  # (B, H, L + S, D)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if image_rotary_emb is not None:
            query[:, :, text_seq_length:] = apply_rotary_emb(query[:, :, text_seq_length:], image_rotary_emb)
            if not attn.is_cross_attention:
                key[:, :, text_seq_length:] = apply_rotary_emb(key[:, :, text_seq_length:], image_rotary_emb)
        hidden_states = _attend(self, query, key, value, attention_mask)
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))  # linear, dropout
        encoder_hidden_states, hidden_states = hidden_states.split(
            [text_seq_length, hidden_states.size(1) - text_seq_length], dim=1)
        return hidden_states, encoder_hidden_states


class EasyAnimateContextParallelAttnProcessor:
    """diffusers' `EasyAnimateAttnProcessor2_0` (transformer_easyanimate.py, 0.42.1) with its SDPA call replaced by
    `dispatch_attention_fn`: joint attention over [text; video] with the text's own projections in the MMDiT blocks
    (`add_q_proj`...) and shared ones in the others; same inputs and outputs as the stock one."""

    _attention_backend = None
    _parallel_config = None

    def __call__(self, attn: Attention, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                 attention_mask: torch.Tensor | None = None,
                 image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
        if attn.add_q_proj is None and encoder_hidden_states is not None:
            hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        # 1. QKV projections, (B, H, S, D)
        query, key, value = (proj(hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
                             for proj in (attn.to_q, attn.to_k, attn.to_v))
        # 2. QK normalization
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        # 3. Encoder condition QKV projection and normalization
        if attn.add_q_proj is not None and encoder_hidden_states is not None:
            encoder_query, encoder_key, encoder_value = (
                proj(encoder_hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
                for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
            if attn.norm_added_q is not None:
                encoder_query = attn.norm_added_q(encoder_query)
            if attn.norm_added_k is not None:
                encoder_key = attn.norm_added_k(encoder_key)
            query = torch.cat([encoder_query, query], dim=2)
            key = torch.cat([encoder_key, key], dim=2)
            value = torch.cat([encoder_value, value], dim=2)
        # 4. Rotary embedding of the video part
        if image_rotary_emb is not None:
            text = encoder_hidden_states.shape[1]
            query[:, :, text:] = apply_rotary_emb(query[:, :, text:], image_rotary_emb)
            if not attn.is_cross_attention:
                key[:, :, text:] = apply_rotary_emb(key[:, :, text:], image_rotary_emb)
        # 5. Attention
        hidden_states = _attend(self, query, key, value, attention_mask)
        hidden_states = hidden_states.transpose(1, 2).flatten(2, 3).to(query.dtype)
        # 6. Output projection
        if encoder_hidden_states is not None:
            text = encoder_hidden_states.shape[1]
            encoder_hidden_states, hidden_states = hidden_states[:, :text], hidden_states[:, text:]
            if getattr(attn, "to_out", None) is not None:
                hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
            if getattr(attn, "to_add_out", None) is not None:
                encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        elif getattr(attn, "to_out", None) is not None:
            hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        return hidden_states, encoder_hidden_states


# ---- applying it ----

_PROCESSORS: dict[str, tuple[str, type]] = {
    "cogvideox": ("CogVideoXAttnProcessor2_0", CogVideoXContextParallelAttnProcessor),
    "easyanimate": ("EasyAnimateAttnProcessor2_0", EasyAnimateContextParallelAttnProcessor),
}
"""family -> (the stock processor class's name, the vidray processor that replaces it) for the families whose stock
processors call SDPA themselves."""


def _experts(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    if isinstance(transformer, TwoExperts):
        return [transformer.transformer, transformer.transformer_2]
    if isinstance(transformer, ExpertSlot):
        return [transformer.first_expert]
    return [transformer]


def _attention_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:

    return [(name, m) for name, m in model.named_modules() if isinstance(m, (Attention, AttentionModuleMixin))]


def _check_backend(processor: Any, ring: int) -> None:
    """The processor's attention backend must support context parallel, and ring needs one that returns the LSE
    (diffusers' native SDPA backend does not)."""

    backend = processor._attention_backend
    backend = _AttentionBackendRegistry.get_active_backend()[0] if backend is None else AttentionBackendName(backend)
    if not _AttentionBackendRegistry._is_context_parallel_available(backend):
        raise ValueError(f"parallel.context: attention backend {backend.value} has no context-parallel path; set "
                         "DIFFUSERS_ATTN_BACKEND to one of "
                         f"{', '.join(sorted(_AttentionBackendRegistry._supports_context_parallel))}")
    if ring > 1 and backend == AttentionBackendName.NATIVE:
        raise ValueError(f"parallel.context.ring: {ring} needs an attention backend that returns the log-sum-exp; "
                         "the native SDPA backend does not: set DIFFUSERS_ATTN_BACKEND=_native_cudnn (or flash) in "
                         "the workers' environment on GPUs, or use parallel.context.ulysses")


def enable_context_parallel(transformer: torch.nn.Module, mesh: "DeviceMesh", *, family: str) -> None:
    """Split each sample's sequence over the context groups of `mesh` (`context_parallel_mesh`): applies `family`'s
    plan in place to `transformer`, or to each expert of a `TwoExperts` / the expert of an `ExpertSlot`, swapping
    in processors that call `dispatch_attention_fn` where the stock ones call SDPA themselves (CogVideoX,
    EasyAnimate), and giving every attention processor diffusers' `ParallelConfig` (its
    `ContextParallelConfig(ulysses_degree, ring_degree, mesh=mesh)`). Afterwards the transformer takes the whole
    sample on every rank of a group and returns the whole output on every rank; inside, each rank holds
    1/degree of the tokens, and its parameter gradients are partial sums (the full gradient: their sum over the
    group). A forward whose split sequence does not divide the degree raises ValueError before any rank splits.

    Order: call it after LoRA (`vidray.models.lora.apply_lora`; adapters in the attention layers are fine) and
    before activation checkpointing (`checkpoint_wrapper` would hide the first block's `hidden_states` argument from
    the plan's hook) and before DDP / FSDP. `mesh` must have dims "ring" and "ulysses" (e.g. ("dp", "ring",
    "ulysses")); with both of size 1 nothing is changed. Needs an initialised process group.

    Raises ValueError (one line each): a family without a plan (naming it), attention heads not divisible by
    ulysses, an attention processor that is not the family's stock one (it would bypass the context-parallel
    attention), an attention backend without a context-parallel path or, for ring, without the log-sum-exp, a
    transformer already made context-parallel, a mesh without "ring" / "ulysses" dims.
    """

    plan = context_parallel_plan(family)
    names = mesh.mesh_dim_names or ()
    if "ring" not in names or "ulysses" not in names:
        raise ValueError(f"enable_context_parallel: the mesh needs dims 'ring' and 'ulysses' (context_parallel_mesh), "
                         f"got {names}")
    ring, ulysses = mesh["ring"].size(), mesh["ulysses"].size()
    if ring * ulysses == 1:
        return
    experts = _experts(transformer)
    for expert in experts:
        heads = expert.config.num_attention_heads
        if heads % ulysses:
            raise ValueError(f"parallel.context.ulysses: {ulysses} must divide the transformer's {heads} attention "
                             "heads (each worker attends with heads / ulysses of them); pick a divisor of "
                             f"{heads}, or use ring")
        if getattr(expert, "_parallel_config", None) is not None:
            raise ValueError(f"enable_context_parallel: this {type(expert).__name__} is already parallel; call it "
                             "once per model")
    # diffusers 0.42's gather calls a function torch 2.13 deprecates, once per forward: not the user's to act on
    warnings.filterwarnings("ignore", message=r".*all_gather_tensor` is deprecated", category=FutureWarning)
    cp_config = ContextParallelConfig(ring_degree=ring, ulysses_degree=ulysses, mesh=mesh)
    config = ParallelConfig(context_parallel_config=cp_config)
    device = (torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda"
              else torch.device(mesh.device_type))
    config.setup(dist.get_rank(), dist.get_world_size(), device, mesh=mesh)
    stock, replacement = _PROCESSORS.get(family, (None, None))
    for expert in experts:
        attention = _attention_modules(expert)
        for name, module in attention:
            processor = module.processor
            if stock is not None and type(processor).__name__ == stock:
                processor = replacement()
                module.set_processor(processor)
            if not hasattr(processor, "_parallel_config"):
                raise ValueError(f"parallel.context: {family}'s attention {name} runs {type(processor).__name__}, "
                                 "which does not call diffusers' dispatch_attention_fn, so it would attend over its "
                                 "own chunk only; keep the family's stock attention processor")
        _check_backend(attention[0][1].processor, ring)
        for _, module in attention:
            module.processor._parallel_config = config
        apply_context_parallel(expert, cp_config, plan)
        expert._parallel_config = config
        expert.register_forward_pre_hook(_sequence_check(family, ring * ulysses, joint_text=family != "wan"),
                                         with_kwargs=True)
