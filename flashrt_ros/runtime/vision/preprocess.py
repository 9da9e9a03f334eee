"""A camera image into the vision tower's input, as the processor every released Qwen3.5/3.6 checkpoint names
(``Qwen2VLImageProcessorFast`` with the ``preprocessor_config.json`` values below) prepares it: Qwen's smart resize
to a multiple of patch x merge pixels within a pixel budget, bicubic with antialiasing on the uint8 image, rescale
and normalise, then one row per patch in merge-block order, the image repeated over the temporal patch.

The resize is the one the released fast processor runs on the CPU (torchvision's uint8 path, which is torch's own
uint8 antialiased bicubic ``interpolate``), so it runs on the CPU here too, whatever the engine's device: a camera
frame arrives in host memory, and the float path a GPU would take rounds differently (it keeps the bicubic overshoot
between its two passes).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .config import VisionConfig
from .image import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, Image, refuse, resized_size
from .prepared import PreparedImage

__all__ = ["DEFAULT_MAX_PIXELS", "DEFAULT_MIN_PIXELS", "IMAGE_MEAN", "IMAGE_STD", "RESCALE_FACTOR", "Image",
           "preprocess", "resized_size"]

IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)
RESCALE_FACTOR = 1 / 255      # Qwen2VLImageProcessor's class default (the config does not name one)


def _normalised(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 [1, C, H, W] to float32, rescale and normalise fused as the fast processor does: (x - mean/rescale) /
    (std/rescale), the constants rounded to float32 first."""
    mean = (torch.tensor(IMAGE_MEAN) * (1.0 / RESCALE_FACTOR)).view(-1, 1, 1)
    std = (torch.tensor(IMAGE_STD) * (1.0 / RESCALE_FACTOR)).view(-1, 1, 1)
    return pixels.to(torch.float32).sub_(mean).div_(std)


def _patchify(pixels: torch.Tensor, vision: VisionConfig) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """[1, C, H, W] to one row per patch, rows in merge-block order (each merge x merge block's patches
    consecutive), each row (channel, temporal, y, x) with the image repeated over the temporal patch."""
    _, channels, height, width = pixels.shape
    p, m, t = vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size
    gh, gw = height // p, width // p
    blocks = pixels.reshape(channels, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
    rows = blocks.unsqueeze(5).expand(-1, -1, -1, -1, -1, t, -1, -1)
    return rows.reshape(gh * gw, channels * t * p * p), (1, gh, gw)


def preprocess(image: Image, vision: VisionConfig, min_pixels: int = DEFAULT_MIN_PIXELS,
               max_pixels: int = DEFAULT_MAX_PIXELS) -> PreparedImage:
    """The tower's input for ``image`` (CPU float32 patches; the caller moves them to the engine's device)."""
    if vision.in_channels != 3:
        raise refuse(f"the vision tower takes {vision.in_channels} channels; camera images are RGB")
    height, width = image.rgb.shape[:2]
    size = resized_size(height, width, vision, min_pixels, max_pixels)
    pixels = torch.from_numpy(np.ascontiguousarray(image.rgb)).permute(2, 0, 1).contiguous().unsqueeze(0)
    if size != (height, width):
        pixels = F.interpolate(pixels, size=size, mode="bicubic", align_corners=False, antialias=True)
    patches, grid = _patchify(_normalised(pixels), vision)
    return PreparedImage(patches, grid, vision.spatial_merge_size)
