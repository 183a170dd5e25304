"""Image-to-video conditions in pixel space, for families whose I2V model takes a mask and a masked video (EasyAnimate's
inpaint models; the latent side, VAE encoding and mask resizing, is the family's): which frames are given, the
generate mask, the masked video, and a first (and last) image as a video of a bucket.

Everything mirrors diffusers/pipelines/easyanimate/pipeline_easyanimate_inpaint.py (diffusers 0.42.1):
`get_image_to_video_latent` (the image tiled over the frames, the mask 0 on given frames and 255 elsewhere),
`__call__`'s step 6 (`mask_processor.preprocess` binarises the mask to {0, 1}; `masked_video = init_video * (mask <
0.5) + -1 * (mask > 0.5)`). Names: `mask` (B, 1, F, H, W) float32 is 1 where the model generates and 0 on given
frames (the pipeline's `mask_condition`); `video` (B, 3, F, H, W) float in [-1, 1].
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch

from vidray.buckets import Bucket

__all__ = ["CONDITIONS", "condition_frames", "generate_mask", "image_to_video", "load_image", "masked_video"]

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
