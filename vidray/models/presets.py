"""Shape presets of the transformers vidray plans for: the diffusers class and its config, nothing else (no
weights). `vidray.train.plan` builds each on the meta device to count its parameters exactly.

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

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vidray.cards import all_cards, get_card
from vidray.errors import UserError, UserFileNotFound

__all__ = ["PRESETS", "ShapePreset", "get_preset", "model_preset", "planner_facts", "preset_from_pretrained"]

@dataclass(frozen=True)
class ShapePreset:
    """A transformer's shape: enough to count its parameters and model its activations, no weights."""

    name: str
    family: str
    """A family whose card has planner facts (`vidray.cards.PlannerFacts`): `easyanimate`
    (EasyAnimateTransformer3DModel: MMDiT, text tokens in every block), `wan` (WanTransformer3DModel:
    self-attention over video tokens, cross-attention to the text) or `cogvideox` (CogVideoXTransformer3DModel:
    text and video tokens through the same attention and MLP in every block)."""
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

    @property
    def class_name(self) -> str:
        """The diffusers transformer class (the family card's `planner.transformer_class`)."""
        return planner_facts(self.family).transformer_class

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


def _tiny_config() -> dict[str, Any]:
    from vidray.models.easyanimate import TINY_TRANSFORMER  # heavy: torch, diffusers, transformers

    return dict(TINY_TRANSFORMER, text_embed_dim=384)


def _cogvideox_tiny_config() -> dict[str, Any]:
    from vidray.models.cogvideox import TINY_TRANSFORMER  # heavy: torch, diffusers, transformers

    return dict(TINY_TRANSFORMER, text_embed_dim=384)


def _wan_tiny_config() -> dict[str, Any]:
    from vidray.models.wan import TINY_TRANSFORMER  # heavy: torch, diffusers, transformers

    return dict(TINY_TRANSFORMER, text_dim=384)


_FILLED_ON_USE = {"tiny": _tiny_config, "wan-tiny": _wan_tiny_config, "cogvideox-tiny": _cogvideox_tiny_config}
"""Presets whose config lives with the family (imports diffusers): filled in by `get_preset`."""


def planner_facts(family: str):
    """The planner facts of `family`'s card (`vidray.cards.PlannerFacts`). Raises UserError when the family
    has none (it is planned by measuring: `vidray.train.plan.plan_measured`) or is unknown."""
    try:
        facts = get_card(family).planner
    except ValueError as err:
        raise UserError(str(err)) from None
    if facts is None:
        raise UserError(f"model family {family} has no planner facts in its card (its model is planned by "
                        "measuring a step)")
    return facts


PRESETS: dict[str, ShapePreset] = {
    "tiny": ShapePreset("tiny", "easyanimate", {}, text_encoder_params=_MINILM_L6, text_encoder_bytes_per_param=4,
                        vae_params=200_000, text_seq_len=32),
    "medium": ShapePreset(
        "medium", "easyanimate",
        dict(num_attention_heads=8, attention_head_dim=64, in_channels=16, out_channels=16, patch_size=2,
             num_layers=6, mmdit_layers=3, time_embed_dim=256, text_embed_dim=384),
        text_encoder_params=_MINILM_L6, text_encoder_bytes_per_param=4, vae_params=200_000, text_seq_len=32,
        note="vidray's CPU-sized preset: 6 blocks x 512 wide (3 MMDiT), 38.6 M parameters"),
    "easyanimate-v5-7b": ShapePreset(
        "easyanimate-v5-7b", "easyanimate", dict(_EASYANIMATE_V51, num_layers=36, mmdit_layers=18),
        text_encoder_params=_QWEN2_VL_7B, vae_params=_MAGVIT_VAE,
        note="EasyAnimateV5(.1)-7b: 36 blocks x 3072 wide, the first 18 MMDiT"),
    "easyanimate-v5.1-12b": ShapePreset(
        "easyanimate-v5.1-12b", "easyanimate", dict(_EASYANIMATE_V51, num_layers=48, mmdit_layers=48),
        text_encoder_params=_QWEN2_VL_7B, vae_params=_MAGVIT_VAE, note="EasyAnimateV5.1-12b: 48 MMDiT blocks x 3072"),
    "wan2.1-14b": ShapePreset("wan2.1-14b", "wan", dict(_WAN_14B), text_encoder_params=_UMT5_XXL_ENCODER,
                              vae_params=_WAN_VAE, text_seq_len=512, note="Wan2.1-T2V-14B: 40 blocks x 5120"),
    "wan2.2-a14b": ShapePreset(
        "wan2.2-a14b", "wan", dict(_WAN_14B), text_encoder_params=_UMT5_XXL_ENCODER, vae_params=_WAN_VAE,
        text_seq_len=512, num_experts=2,
        note="Wan2.2-T2V-A14B: 2 experts of 14.3 B; one trains per process (the other is not on the GPU)"),
    "wan-tiny": ShapePreset("wan-tiny", "wan", {}, text_encoder_params=_MINILM_L6, text_encoder_bytes_per_param=4,
                            vae_params=22_000, text_seq_len=32, note="the wan family's tiny preset (model.preset: tiny)"),
    "cogvideox-tiny": ShapePreset(
        "cogvideox-tiny", "cogvideox", {}, text_encoder_params=_MINILM_L6, text_encoder_bytes_per_param=4,
        vae_params=77_000, text_seq_len=32, note="the cogvideox family's tiny preset (model.preset: tiny)"),
}
"""Built-in shape presets by name (`vidray plan --preset NAME`); `tiny`'s config is filled in by `get_preset`."""


def get_preset(name: str) -> ShapePreset:
    """The preset called `name`. Raises UserError listing the presets for an unknown name."""
    try:
        preset = PRESETS[name]
    except KeyError:
        raise UserError(f"unknown preset {name!r}; valid: {', '.join(PRESETS)}") from None
    if name in _FILLED_ON_USE:  # TINY_TRANSFORMER lives with the family (imports diffusers): filled in on use
        preset = ShapePreset(**{**preset.__dict__, "config": _FILLED_ON_USE[name]()})
    return preset


def model_preset(family: str, preset: str, text_encoder: str) -> ShapePreset:
    """The shape of a job's `init: random` model: `model.family` + `model.preset` (e.g. wan + tiny -> `wan-tiny`),
    its text width set for `model.text_encoder` (`tiny_random`: 64, `minilm`: the preset's 384). Raises UserError
    naming the valid (family, preset) pairs."""
    tiny = {card.name: card.planner.tiny_preset for card in all_cards() if card.planner and card.planner.tiny_preset}
    if preset != "tiny" or family not in tiny:
        valid = ", ".join(f"{f}/tiny" for f in tiny)
        raise UserError(f"no shape preset for model.family={family} model.preset={preset}; valid: {valid}")
    shape = get_preset(tiny[family])
    if text_encoder == "tiny_random":
        width_key = planner_facts(family).text_width_key
        shape = ShapePreset(**{**shape.__dict__, "config": {**shape.config, width_key: 64}})
    return shape


def preset_from_pretrained(path: str | Path) -> ShapePreset:
    """The shape of the transformer in a local diffusers folder: `<path>/transformer/config.json`.

    Its `_class_name` picks the family (EasyAnimateTransformer3DModel, WanTransformer3DModel or
    CogVideoXTransformer3DModel). Raises
    UserFileNotFound when the file is missing, UserError for another class or a file that is not JSON.
    Encoder sizes are left 0 (not planned) unless the class is known to go with them.
    """
    config_path = Path(path) / "transformer" / "config.json"
    if not config_path.is_file():
        raise UserFileNotFound(f"{config_path} does not exist: model.pretrained_path must be a local diffusers "
                               f"folder with transformer/config.json")
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{config_path} is not a readable JSON config: {err}") from None
    families = {card.planner.transformer_class: card.name for card in all_cards() if card.planner}
    class_name = raw.get("_class_name")
    if class_name not in families:
        raise UserError(f"{config_path}: _class_name {class_name!r} is not one the planner knows; valid: "
                        f"{', '.join(families)}")
    config = {k: (tuple(v) if isinstance(v, list) else v) for k, v in raw.items() if not k.startswith("_")}
    return ShapePreset(name=str(path), family=families[class_name], config=config,
                       note=f"from {config_path}")


@functools.lru_cache(maxsize=16)
def _meta_model(key: str):
    family, config_json = key.split(":", 1)
    import torch  # heavy: torch, numpy
    import diffusers  # heavy: torch, diffusers, safetensors

    config = {k: (tuple(v) if isinstance(v, list) else v) for k, v in json.loads(config_json).items()}
    cls = getattr(diffusers, planner_facts(family).transformer_class)
    with torch.device("meta"):
        return cls(**config)


def meta_model(preset: ShapePreset):
    """The preset's transformer built on the meta device (shapes only, no memory), cached by shape.

    Raises UserError when diffusers refuses the config (the message names the preset)."""
    try:
        return _meta_model(preset.key)
    except TypeError as err:
        raise UserError(f"{preset.name}: the {preset.class_name} config is not one diffusers accepts: {err}") from None
