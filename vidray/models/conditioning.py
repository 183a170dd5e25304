"""Image-to-video conditions in pixel space, for families whose I2V model takes a mask and a masked video (EasyAnimate's
inpaint models; the latent side, VAE encoding and mask resizing, is the family's): which frames are given, the
generate mask, the masked video, and a first (and last) image as a video of a bucket; and `ImageCondition`, the
typed condition every family's `ModelFamily.condition` returns.

Everything mirrors diffusers/pipelines/easyanimate/pipeline_easyanimate_inpaint.py (diffusers 0.42.1):
`get_image_to_video_latent` (the image tiled over the frames, the mask 0 on given frames and 255 elsewhere),
`__call__`'s step 6 (`mask_processor.preprocess` binarises the mask to {0, 1}; `masked_video = init_video * (mask <
0.5) + -1 * (mask > 0.5)`). Names: `mask` (B, 1, F, H, W) float32 is 1 where the model generates and 0 on given
frames (the pipeline's `mask_condition`); `video` (B, 3, F, H, W) float in [-1, 1].
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import numpy as np
import torch

from vidray.buckets import Bucket
from vidray.config import ModelConfig

__all__ = ["CONDITIONS", "ImageCondition", "clip_condition", "condition_frames", "generate_mask", "image_to_video",
           "load_image", "masked_video", "over_batch", "takes_image"]

Condition = Literal["first", "first_last"]
CONDITIONS = ("first", "first_last")
"""`model.i2v.condition`: the first frame given, or the first and the last."""


def condition_frames(num_frames: int, condition: Condition) -> list[int]:
    """Indices of the given frames of a clip of `num_frames`: [0] (`first`), [0, F-1] (`first_last`; [0] when F is
    1). Raises ValueError for another condition."""
    if condition == "first":
        return [0]
    if condition == "first_last":
        return sorted({0, num_frames - 1})
    raise ValueError(f"unknown image-to-video condition {condition!r}; valid: {', '.join(CONDITIONS)}")


def generate_mask(batch_size: int, bucket: Bucket, condition: Condition) -> torch.Tensor:
    """(B, 1, F, H, W) float32: 0 on the `condition_frames`, 1 elsewhere (the frames the model generates), as
    `get_image_to_video_latent` (0 / 255) after the pipeline's `mask_processor` (binarised: >= 0.5 -> 1)."""
    num_frames, height, width = bucket
    mask = torch.ones(batch_size, 1, num_frames, height, width, dtype=torch.float32)
    mask[:, :, condition_frames(num_frames, condition)] = 0.0
    return mask


def masked_video(video: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """video (B, 3, F, H, W) in [-1, 1], mask (B, 1, F, H, W) -> the video with generated frames set to -1
    (B, 3, F, H, W): `init_video * (mask_condition_tile < 0.5) + ones * (mask_condition_tile > 0.5) * -1`
    (EasyAnimateInpaintPipeline.__call__, step 6)."""
    if video.ndim != 5 or video.shape[1] != 3 or mask.shape != (video.shape[0], 1, *video.shape[2:]):
        raise ValueError(f"video must be (B, 3, F, H, W) and mask (B, 1, F, H, W), got {tuple(video.shape)} and "
                         f"{tuple(mask.shape)}")
    mask = torch.tile(mask.to(video.dtype), [1, 3, 1, 1, 1])
    return video * (mask < 0.5) + torch.ones_like(video) * (mask > 0.5) * -1


def load_image(path: str) -> Any:
    """The RGB `PIL.Image` at `path` (what `vidray generate --image` reads). Raises FileNotFoundError naming it."""
    from PIL import Image, UnidentifiedImageError  # heavy: PIL

    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except FileNotFoundError:
        raise FileNotFoundError(f"image {path} does not exist; give a PNG or JPEG file") from None
    except UnidentifiedImageError:
        raise ValueError(f"image {path} is not an image PIL can read; give a PNG or JPEG file") from None


def _image_frame(image: Any, bucket: Bucket) -> torch.Tensor:
    """A PIL image, a uint8 (H, W, 3) array or a float (3, H, W) tensor in [0, 1] -> (3, H, W) float32 in [-1, 1] at
    the bucket's size: diffusers' `preprocess_image` (PIL `resize((width, height))` with PIL's default filter, the
    whole image: no crop, the aspect ratio follows the bucket's) / 255, then `VaeImageProcessor.normalize` (2x - 1)."""
    from diffusers.pipelines.easyanimate.pipeline_easyanimate_inpaint import preprocess_image  # heavy: diffusers

    if isinstance(image, np.ndarray) and (image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] != 3):
        raise ValueError(f"an image array must be uint8 (H, W, 3), got {image.dtype} {image.shape}")
    frame = preprocess_image(image, (bucket.height, bucket.width))  # (3, H, W) in [0, 1]
    return 2.0 * frame.float() - 1.0


def image_to_video(image: Any, bucket: Bucket, last_image: Any | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A first image (and an optional last) -> (video (1, 3, F, H, W) float32 in [-1, 1], mask (1, 1, F, H, W)):
    what `EasyAnimateInpaintPipeline` makes of `get_image_to_video_latent([image], last_image, F, (H, W))`: the
    first image tiled over every frame, the last image on the last frame; mask 0 on the given frames, 1 elsewhere.
    Images: PIL, uint8 (H, W, 3) arrays or (3, H, W) tensors in [0, 1], resized to the bucket (`_image_frame`)."""
    bucket = Bucket(*bucket)
    first = _image_frame(image, bucket)
    video = first[None, :, None].repeat(1, 1, bucket.num_frames, 1, 1)  # (1, 3, F, H, W)
    condition: Condition = "first"
    if last_image is not None:
        video[:, :, -1] = _image_frame(last_image, bucket)
        condition = "first_last"
    return video, generate_mask(1, bucket, condition)


@dataclasses.dataclass(frozen=True)
class ImageCondition:
    """What an image-to-video model takes beside its noisy latents and prompt, for a batch of B samples: what
    `ModelFamily.condition` returns, `ModelFamily.predict` gets (`predict_kwargs`) and condition dropout swaps
    (`where`). The latent cache stores the same tensors under the same names, one sample each."""

    inpaint_latents: torch.Tensor
    """(B, C_in, F_lat, H_lat, W_lat) float32: the family's latent condition (EasyAnimate's mask and masked-video
    latents, Wan's mask and condition latents, CogVideoX's image latents); zeros for a sample without an image."""
    image_embeds: torch.Tensor | None = None
    """(B, T, D_img) float32 image embeddings of a model that also takes them (Wan 2.1 I2V's CLIP), else None."""

    def __post_init__(self):
        if self.image_embeds is not None and self.image_embeds.shape[0] != self.inpaint_latents.shape[0]:
            raise ValueError(f"image_embeds {tuple(self.image_embeds.shape)} and inpaint_latents "
                             f"{tuple(self.inpaint_latents.shape)} must have as many samples")

    @property
    def batch_size(self) -> int:
        """B, the number of samples."""
        return int(self.inpaint_latents.shape[0])

    def predict_kwargs(self) -> dict[str, torch.Tensor]:
        """The keyword arguments of `ModelFamily.predict` (and of `vidray.inference.sampler.sample_latents`):
        `inpaint_latents`, and `image_embeds` when the model takes them."""
        kwargs = {"inpaint_latents": self.inpaint_latents}
        if self.image_embeds is not None:
            kwargs["image_embeds"] = self.image_embeds
        return kwargs

    def where(self, keep: torch.Tensor, empty: "ImageCondition") -> "ImageCondition":
        """Condition dropout per sample: sample i keeps its condition where `keep[i]` (a (B,) bool tensor) and gets
        `empty`'s (the no-image condition, cast to this condition's dtypes) elsewhere; the latent condition and the
        image embeddings are dropped together. Raises ValueError when `empty` lacks image embeddings this has."""
        if (self.image_embeds is None) != (empty.image_embeds is None):
            raise ValueError("the empty condition must carry image_embeds exactly when the condition does")
        keep = keep.to(self.inpaint_latents.device)

        def pick(given: torch.Tensor, dropped: torch.Tensor) -> torch.Tensor:
            return torch.where(keep.view(-1, *([1] * (given.ndim - 1))), given, dropped.to(given.dtype))

        return ImageCondition(pick(self.inpaint_latents, empty.inpaint_latents),
                              None if self.image_embeds is None else pick(self.image_embeds, empty.image_embeds))

    def to(self, *args: Any, **kwargs: Any) -> "ImageCondition":
        """Both tensors through `torch.Tensor.to(*args, **kwargs)` (a device and/or dtype)."""
        return ImageCondition(self.inpaint_latents.to(*args, **kwargs),
                              None if self.image_embeds is None else self.image_embeds.to(*args, **kwargs))



def takes_image(model: Any, transformer_takes_image: Any) -> bool:
    """Whether the model `ModelFamily.condition` was given takes an image: a transformer by
    `transformer_takes_image(transformer)` (the family's reading of its config), a `ModelConfig` by `model.i2v`,
    None (a caller that knows it does) always."""
    if model is None:
        return True
    if isinstance(model, ModelConfig):
        return model.i2v is not None
    return bool(transformer_takes_image(model))


def clip_condition(model: Any) -> Condition:
    """The condition frames of a training clip: `model.i2v.condition` of the `ModelConfig` `model`. Raises ValueError
    for another `model` (a clip's condition follows the job's config)."""
    if not isinstance(model, ModelConfig) or model.i2v is None:
        raise ValueError("a training clip's condition needs the job's model config (model.i2v.condition) as model")
    return model.i2v.condition


def over_batch(condition: torch.Tensor, latent_shape: tuple[int, ...] | None,
               device: torch.device | str | None) -> torch.Tensor:
    """One image's condition (1, ...) on `device` (where it is when None), repeated over `latent_shape[0]` samples
    (1 without a shape)."""
    condition = condition.to(device) if device is not None else condition
    batch_size = 1 if latent_shape is None else int(latent_shape[0])
    return condition.repeat(batch_size, *([1] * (condition.ndim - 1)))
