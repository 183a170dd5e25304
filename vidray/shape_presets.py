"""Shape presets of the transformers vidray plans for, as plain data: the config of the family's diffusers class,
nothing else (no weights). Each family card lists its own (`vidray.cards.PlannerFacts.presets`); the built-in
families' are below. `vidray.models.presets.get_preset` finds one by name across the registered cards and
`vidray.train.plan` builds it on the meta device to count its parameters exactly.

| preset | class | layers x width | parameters (meta build) | source of the config |
|---|---|---|---|---|
| tiny | EasyAnimateTransformer3DModel | 3 x 128 | 1,915,712 | `vidray.models.easyanimate.TINY_TRANSFORMER`, text 384 (MiniLM) |
| medium | EasyAnimateTransformer3DModel | 6 x 512 | 38,567,232 | vidray's own: CPU-sized, same class |
| easyanimate-v5-7b | EasyAnimateTransformer3DModel | 36 x 3072 (18 MMDiT) | 6,814,462,016 | alibaba-pai/EasyAnimateV5.1-7b-zh transformer/config.json |
| easyanimate-v5.1-12b | EasyAnimateTransformer3DModel | 48 x 3072 | 11,799,056,960 | alibaba-pai/EasyAnimateV5.1-12b-zh transformer/config.json (= diffusers' defaults) |
| wan2.1-14b | WanTransformer3DModel | 40 x 5120 | 14,288,491,584 | Wan-AI/Wan2.1-T2V-14B(-Diffusers) |
| wan2.2-a14b | WanTransformer3DModel, 2 experts | 40 x 5120 each | 2 x 14,288,491,584 | Wan-AI/Wan2.2-T2V-A14B(-Diffusers) |
| wan-tiny | WanTransformer3DModel | 2 x 32 | 52,128 | `vidray.models.wan.TINY_TRANSFORMER`, text 384 (MiniLM) |
| cogvideox-tiny | CogVideoXTransformer3DModel | 2 x 32 | see `vidray plan` | `vidray.models.cogvideox.TINY_TRANSFORMER`, text 384 (MiniLM) |

Where the numbers come from (each checked by building the class on the meta device and comparing the parameter
count with the published checkpoint's, where one was found):
- EasyAnimate V5.1: 48 heads x 64 = 3072 wide, patch 2, time_embed_dim 512, Qwen2-VL-7B text encoder (hidden 3584)
  behind an RMSNorm (`add_norm_text_encoder: true`); 12B: 48 layers, all MMDiT; 7B: 36 layers, the first 18 MMDiT.
  The InP checkpoints take in_channels 33 (16 latents + 16 masked latents + 1 mask): built that way these configs
  give 11,799,265,856 and 6,814,670,912 parameters, exactly the counts of alibaba-pai/EasyAnimateV5.1-12b-zh-InP and
  -7b-zh-InP's safetensors (as tabulated in a public survey of video backbones; the layer counts and widths there
  agree with aigc-apps/EasyAnimate `config/easyanimate_video_v5.1_magvit_qwen.yaml` and diffusers' defaults). The
  presets here are the text-to-video variants vidray trains (in_channels 16). EasyAnimateV5-7b (V5, not V5.1) has
  the same transformer dimensions with a BERT + T5 text path whose projection differs by 1,573,376 parameters
  (0.023 %); vidray's easyanimate family loads the V5.1 layout, so `easyanimate-v5-7b` is that layout.
- Wan 2.1 14B: dim 5120 (40 heads x 128), ffn_dim 13824, 40 layers, freq_dim 256, text_dim 4096 (umT5-XXL),
  patch (1, 2, 2), qk_norm rms_norm_across_heads, cross_attn_norm, eps 1e-6 (Wan-AI/Wan2.1 `wan/configs/
  wan_t2v_14B.py`, mirrored in ml-explore/mlx-examples `video/Wan2.1/wan/configs/wan_t2v_14B.py`; diffusers'
  `WanTransformer3DModel` names them num_attention_heads, attention_head_dim, ffn_dim, ...).
- Wan 2.2 A14B: two experts (high-noise and low-noise), each the Wan 2.1 14B transformer (Wan-AI/Wan2.2
  `wan/configs/wan_t2v_A14B.py`: same dim, ffn_dim, heads and layers; boundary 0.875). Planned as the job lays
  the experts out (`vidray.train.plan.plan_job`): `model.experts.layout: groups` (or no `model.experts`) puts one
  14B transformer on each GPU (each expert on its half of the GPUs; the other expert is not on that GPU at all),
  `shared` two on every GPU; generation (`vidray.plan_inference`) holds both without offload, one with model
  offload.

The frozen encoders' sizes (used only when they share the trainer's GPU) are parameter counts of the public
checkpoints, in the dtype they run in: Qwen2-VL-7B-Instruct 8.29 B (bf16), umT5-XXL encoder 5.68 B (bf16),
MiniLM-L6 22.7 M (fp32); VAEs: EasyAnimate's AutoencoderKLMagvit (block_out_channels 128/256/512/512) ~0.21 B,
Wan 2.1 VAE 0.127 B (fp32 as vidray runs them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["COGVIDEOX_PRESETS", "EASYANIMATE_PRESETS", "ShapePreset", "WAN_PRESETS"]


@dataclass(frozen=True)
class ShapePreset:
    """A transformer's shape: enough to count its parameters and model its activations, no weights."""

    name: str
    family: str
    """The family whose card lists the preset (`vidray.cards.PlannerFacts.presets`): its planner facts say which
    diffusers class the config builds and how tokens flow through a block."""
    config: dict[str, Any]
    """Keyword arguments of the diffusers class (its `config.json` without the `_`-keys)."""
    text_encoder_params: int = 0
    """Parameters of the frozen text encoder (0: not planned)."""
    text_encoder_bytes_per_param: int = 2
    vae_params: int = 0
    """Parameters of the frozen VAE (0: not planned); the VAE runs in fp32."""
    text_seq_len: int = 256
    """Text tokens the transformer attends to (the pipeline's `max_sequence_length`) when the job does not say."""
    num_experts: int = 1
    """Transformers of the model (Wan 2.2 A14B: 2); one trains per process (see the module docstring)."""
    note: str = ""
    config_from: str | None = None
    """"module:ATTRIBUTE" of a config dict that lives with the family (its tiny transformer, in a module that imports
    diffusers): `vidray.models.presets.get_preset` imports it on use and lays `config` over it. None: `config` is
    the whole config."""

    @property
    def key(self) -> str:
        """A hashable identity of the shape (its family and config), for caching meta builds."""
        return f"{self.family}:{json.dumps(self.config, sort_keys=True)}"


_QWEN2_VL_7B = 8_291_375_616  # Qwen/Qwen2-VL-7B-Instruct safetensors (incl. the vision tower EasyAnimate loads)
_UMT5_XXL_ENCODER = 5_680_910_336  # google/umt5-xxl encoder (Wan's text_encoder)
_MINILM_L6 = 22_713_216  # sentence-transformers/all-MiniLM-L6-v2 (vidray's minilm)
_MAGVIT_VAE = 209_000_000  # AutoencoderKLMagvit, block_out_channels (128, 256, 512, 512): ~0.21 B
_WAN_VAE = 126_892_531  # Wan2.1_VAE.pth

_EASYANIMATE_V51 = dict(
    num_attention_heads=48, attention_head_dim=64, in_channels=16, out_channels=16, patch_size=2,
    sample_width=128, sample_height=128, time_embed_dim=512, text_embed_dim=3584, add_norm_text_encoder=True,
)
_WAN_14B = dict(
    patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6,
)


EASYANIMATE_PRESETS = (
    ShapePreset("tiny", "easyanimate", {"text_embed_dim": 384}, text_encoder_params=_MINILM_L6,
                text_encoder_bytes_per_param=4, vae_params=200_000, text_seq_len=32,
                config_from="vidray.models.easyanimate:TINY_TRANSFORMER"),
    ShapePreset(
        "medium", "easyanimate",
        dict(num_attention_heads=8, attention_head_dim=64, in_channels=16, out_channels=16, patch_size=2,
             num_layers=6, mmdit_layers=3, time_embed_dim=256, text_embed_dim=384),
        text_encoder_params=_MINILM_L6, text_encoder_bytes_per_param=4, vae_params=200_000, text_seq_len=32,
        note="vidray's CPU-sized preset: 6 blocks x 512 wide (3 MMDiT), 38.6 M parameters"),
    ShapePreset(
        "easyanimate-v5-7b", "easyanimate", dict(_EASYANIMATE_V51, num_layers=36, mmdit_layers=18),
        text_encoder_params=_QWEN2_VL_7B, vae_params=_MAGVIT_VAE,
        note="EasyAnimateV5(.1)-7b: 36 blocks x 3072 wide, the first 18 MMDiT"),
    ShapePreset(
        "easyanimate-v5.1-12b", "easyanimate", dict(_EASYANIMATE_V51, num_layers=48, mmdit_layers=48),
        text_encoder_params=_QWEN2_VL_7B, vae_params=_MAGVIT_VAE, note="EasyAnimateV5.1-12b: 48 MMDiT blocks x 3072"),
)
WAN_PRESETS = (
    ShapePreset("wan2.1-14b", "wan", dict(_WAN_14B), text_encoder_params=_UMT5_XXL_ENCODER,
                vae_params=_WAN_VAE, text_seq_len=512, note="Wan2.1-T2V-14B: 40 blocks x 5120"),
    ShapePreset(
        "wan2.2-a14b", "wan", dict(_WAN_14B), text_encoder_params=_UMT5_XXL_ENCODER, vae_params=_WAN_VAE,
        text_seq_len=512, num_experts=2,
        note="Wan2.2-T2V-A14B: 2 experts of 14.3 B; one trains per process (the other is not on the GPU)"),
    ShapePreset("wan-tiny", "wan", {"text_dim": 384}, text_encoder_params=_MINILM_L6,
                text_encoder_bytes_per_param=4, vae_params=22_000, text_seq_len=32,
                note="the wan family's tiny preset (model.preset: tiny)",
                config_from="vidray.models.wan:TINY_TRANSFORMER"),
)
COGVIDEOX_PRESETS = (
    ShapePreset(
        "cogvideox-tiny", "cogvideox", {"text_embed_dim": 384}, text_encoder_params=_MINILM_L6,
        text_encoder_bytes_per_param=4, vae_params=77_000, text_seq_len=32,
        note="the cogvideox family's tiny preset (model.preset: tiny)",
        config_from="vidray.models.cogvideox:TINY_TRANSFORMER"),
)
"""The built-in families' presets, listed by their cards (`vidray.cards.BUILTIN_CARDS`)."""
