"""One generation request: what `vidray generate` and the HTTP Videos API ask a model to make, validated once.

`GenerationRequest` is frozen and checks its own fields at construction (`__post_init__`, diffusers' one
`check_inputs`): the CLI (`vidray.generate.check_generate_args`) and the HTTP parser
(`vidray.serve.api.parse_video_request`) build it, the job store keeps it (`to_dict` / `from_dict`, in
`vidray.serve.jobs.VideoJob.params`) and the serving `Denoiser` receives it as-is. Each rule is written once, in
`field_problems`; a refusal is a `GenerationRequestError` listing `Problem`s, each worded with the caller's name for
the field (`--num-inference-steps` on the command line, `num_inference_steps` over HTTP): the rule's text is the
same for both.

What stays with each caller is its wire: the command line's file checks (`--output`, `--model`, image files) and
the HTTP side's body parsing, text-to-number parsing, size and frame limits of the serving deployment, and image
decoding. Light: no torch, no Ray.
"""

from __future__ import annotations

import dataclasses
import math
import unicodedata
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from vidray.buckets import Bucket, check_bucket
from vidray.cards import get_card

__all__ = [
    "FPS_RANGE",
    "MAX_NUM_INFERENCE_STEPS",
    "REQUEST_VERSION",
    "SEED_MAX",
    "STORED_IMAGE",
    "GenerationRequest",
    "GenerationRequestError",
    "Problem",
    "field_problems",
    "is_blank",
]

FPS_RANGE = (0.01, 1000.0)
"""Frame rates (frames/s, inclusive) a video is written at; the mp4 time base (denominator <= 1001) and libx264
handle these."""
SEED_MAX = 2**63 - 1
"""Largest seed (seeds are 0..SEED_MAX, what `torch.Generator.manual_seed` takes without wrapping)."""
MAX_NUM_INFERENCE_STEPS = 1000
"""Most denoising steps a request takes: the flow's training timesteps (1000 for the shipped models; more steps
than that only re-evaluate the same noise levels). A larger value used to fail allocating the sigmas (800 GB for
1e11 steps). The serve plane's `ApiLimits.max_num_inference_steps` may ask fewer."""
REQUEST_VERSION = 1
"""`to_dict`'s `version`. Records without one (0) are the job store's `params` of before this type: the same
numbers, with the prompt and the image kept beside them (`from_dict`'s `prompt` and `image`)."""
STORED_IMAGE = "input_reference"
"""`GenerationRequest.image` of a serve job: the uploaded first frame, whose bytes the job store keeps beside the
record (`vidray.serve.jobs.JobStore.read_input`)."""


@dataclass(frozen=True)
class Problem:
    """One broken rule: `field` (the request's own name) and `rule`, the text after the field's name, in which a
    second field is written `{name}` (a `str.format` field)."""

    field: str
    rule: str

    def message(self, name: Callable[[str], str] = str) -> str:
        """The one-line message, every field worded by `name` (identity: the request's names)."""
        return f"{name(self.field)} {self.rule.format_map(_Names(name))}"


class _Names(dict):
    def __init__(self, name: Callable[[str], str]) -> None:
        super().__init__()
        self.name = name

    def __missing__(self, key: str) -> str:
        return self.name(key)


class GenerationRequestError(ValueError):
    """A `GenerationRequest` that breaks rules; `problems` lists each (`Problem`), in field order. The message
    words them with the request's field names; callers word them their own way (`Problem.message`)."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = tuple(problems)
        super().__init__("; ".join(p.message() for p in self.problems))


def _braced(text: str) -> str:
    """`text`, safe inside a `Problem.rule` (braces doubled)."""
    return text.replace("{", "{{").replace("}", "}}")


def _shown(value: Any) -> str:
    """`value!r`, safe inside a `Problem.rule`."""
    return _braced(repr(value))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_blank(text: str) -> bool:
    """Only whitespace and invisible format characters (Unicode Cf: zero-width space, joiners, BOM), or empty."""
    return all(ch.isspace() or unicodedata.category(ch) == "Cf" for ch in text)


_PROMPT_RULE = "is required and must not be empty or only whitespace: give the text to generate a video for"


def field_problems(values: Mapping[str, Any], *,
                   max_num_inference_steps: int = MAX_NUM_INFERENCE_STEPS) -> list[Problem]:
    """The rules of a generation request, each written once: the problems of the fields in `values` (any subset
    of `GenerationRequest`'s fields; those absent are not checked), in field order.

    prompt: text, not blank (`is_blank`); negative_prompt: text; num_frames, height, width: integers >= 1
    (frames, pixels; what a family can make is `GenerationRequest`'s `family` check); num_inference_steps: an
    integer in 1..`max_num_inference_steps`; guidance_scale: finite, >= 1.0 (1.0 = no classifier-free guidance);
    seed: an integer in 0..SEED_MAX; fps: finite, within FPS_RANGE frames/s; image, last_image: None or a
    reference (a file path, or `STORED_IMAGE`), a last image only with a first.
    """
    problems = []
    if "prompt" in values:
        prompt = values["prompt"]
        if not isinstance(prompt, str) or is_blank(prompt):
            problems.append(Problem("prompt", _PROMPT_RULE))
    if "negative_prompt" in values and not isinstance(values["negative_prompt"], str):
        problems.append(Problem("negative_prompt", f"must be text, got {_shown(values['negative_prompt'])}"))
    for name, unit in (("num_frames", "frames"), ("height", "pixels"), ("width", "pixels")):
        if name in values and (not _is_int(values[name]) or values[name] < 1):
            problems.append(Problem(name, f"must be a positive integer ({unit}), got {_shown(values[name])}"))
    if "num_inference_steps" in values:
        steps = values["num_inference_steps"]
        if not _is_int(steps) or not 1 <= steps <= max_num_inference_steps:
            problems.append(Problem("num_inference_steps", f"must be an integer in 1..{max_num_inference_steps}, "
                                    f"got {_shown(steps)}"))
    if "guidance_scale" in values:
        scale = values["guidance_scale"]
        if not _is_number(scale) or scale < 1.0:
            problems.append(Problem("guidance_scale", "must be a finite number >= 1.0 (1.0 = no classifier-free "
                                    f"guidance), got {_shown(scale)}"))
    if "seed" in values:
        seed = values["seed"]
        if not _is_int(seed) or not 0 <= seed <= SEED_MAX:
            problems.append(Problem("seed", f"must be an integer in 0..{SEED_MAX} (2**63 - 1), got {_shown(seed)}"))
    if "fps" in values:
        fps = values["fps"]
        if not _is_number(fps) or not FPS_RANGE[0] <= fps <= FPS_RANGE[1]:
            low, high = FPS_RANGE
            problems.append(Problem("fps", f"must be a finite frame rate in [{low:g}, {high:g}] frames/s, got "
                                    f"{_shown(fps)}"))
    for name in ("image", "last_image"):
        if values.get(name) is not None and not (isinstance(values[name], str) and values[name]):
            problems.append(Problem(name, f"must be an image reference (a file path), got {_shown(values[name])}"))
    if values.get("last_image") is not None and values.get("image") is None:
        problems.append(Problem("last_image", "needs {image} (the first frame) too"))
    return problems


@dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    """One video to generate, valid by construction (`field_problems`, then the `family` check). Raises
    GenerationRequestError listing every broken rule."""

    prompt: str
    """The text to generate a video for; not blank."""
    negative_prompt: str = ""
    """Text to steer away from with classifier-free guidance (used when guidance_scale > 1); "" for none."""
    num_frames: int
    """Frames of the video."""
    height: int
    """Pixels."""
    width: int
    """Pixels."""
    num_inference_steps: int
    """Denoising steps, 1..MAX_NUM_INFERENCE_STEPS."""
    guidance_scale: float = 1.0
    """Classifier-free guidance scale, finite, >= 1.0 (1.0 = no guidance)."""
    seed: int = 0
    """0..SEED_MAX: the noise (`vidray.inference.sampler.initial_noise`); same request, same video."""
    fps: float
    """Frames per second of the mp4 written, within FPS_RANGE."""
    image: str | None = None
    """The first frame (image-to-video): a local image file (`vidray generate --image`), or `STORED_IMAGE` for a
    serve job; None for text-to-video."""
    last_image: str | None = None
    """The last frame (`vidray generate --last-image`), only with `image`; None without one."""
    family: str | None = None
    """The model family (`vidray.cards`) the request is for; when given, the bucket must be one its card takes
    (`vidray.buckets.check_bucket`) and an image needs a family with image-to-video models. None: not checked."""

    def __post_init__(self) -> None:
        problems = field_problems(dataclasses.asdict(self))
        if self.family is not None and not problems:
            try:
                card = get_card(self.family)
            except ValueError as err:
                problems.append(Problem("family", _braced(f"{self.family!r}: {err}")))
            else:
                try:
                    check_bucket(self.bucket, self.family)
                except ValueError as err:
                    problems.append(Problem("bucket", _braced(f"{self.bucket} cannot be made by the {self.family} "
                                                              f"model: {err}")))
                if self.image is not None and not card.image_to_video:
                    problems.append(Problem("image", f"the {self.family} family has no image-to-video model: drop "
                                            "{image}"))
        if problems:
            raise GenerationRequestError(problems)

    @property
    def bucket(self) -> Bucket:
        """(num_frames, height, width)."""
        return Bucket(self.num_frames, self.height, self.width)

    @property
    def guided(self) -> bool:
        """Whether classifier-free guidance runs (guidance_scale > 1: a negative prompt is encoded too)."""
        return self.guidance_scale > 1.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every field and `version` (REQUEST_VERSION)."""
        return {"version": REQUEST_VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], **fields: Any) -> GenerationRequest:
        """The request `to_dict` wrote, or a job store record of before this type (no `version`: the numbers
        alone; pass `prompt=` and `image=` from beside it). `fields` override what `data` holds; keys that are no
        field (an old record's `input_reference` note) are skipped. Raises ValueError for a record of a newer
        version, GenerationRequestError for one that breaks the rules."""
        version = data.get("version", 0)
        if not _is_int(version) or version > REQUEST_VERSION:
            raise ValueError(f"generation request version {version!r} is newer than this vidray reads "
                             f"({REQUEST_VERSION}); upgrade vidray")
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        return cls(**{**values, **fields})
