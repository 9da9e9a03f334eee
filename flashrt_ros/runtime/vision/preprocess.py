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

import dataclasses
import math

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import ErrorCode, FlashRTError
from .config import VisionConfig
from .prepared import PreparedImage

# The released processor's preprocessor_config.json (every Qwen3.5/3.6 size); resample and rescale_factor are not
# in it, so they are Qwen2VLImageProcessor's class defaults (PIL BICUBIC, 1/255).
DEFAULT_MIN_PIXELS = 65_536           # size.shortest_edge: a pixel count, not an edge
DEFAULT_MAX_PIXELS = 16_777_216       # size.longest_edge
IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)
RESCALE_FACTOR = 1 / 255
MAX_ASPECT_RATIO = 200                # smart_resize refuses longer sides than this many times the shorter one


def _refuse(message: str) -> FlashRTError:
    return FlashRTError(ErrorCode.INVALID_ARGUMENT, message)


@dataclasses.dataclass(frozen=True)
class Image:
    """One RGB camera image: ``rgb`` uint8 [height, width, 3] (the node converts ROS encodings to it)."""
    rgb: np.ndarray

    def __post_init__(self):
        rgb = self.rgb
        if not isinstance(rgb, np.ndarray) or rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
            what = f"{rgb.dtype} {rgb.shape}" if isinstance(rgb, np.ndarray) else type(rgb).__name__
            raise _refuse(f"an image must be uint8 [height, width, 3] RGB, got {what}")
        if rgb.shape[0] == 0 or rgb.shape[1] == 0:
            raise _refuse(f"an image must not be empty, got {rgb.shape[0]}x{rgb.shape[1]}")


def resized_size(height: int, width: int, vision: VisionConfig, min_pixels: int = DEFAULT_MIN_PIXELS,
                 max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[int, int]:
    """Qwen's ``smart_resize``: (height, width) as multiples of patch x merge, the aspect ratio kept as closely as
    possible, the pixel count brought within [min_pixels, max_pixels] (a side stays at least one multiple, so an
    extreme aspect ratio can end above ``max_pixels``: budget checks use this result)."""
    if height < 1 or width < 1:
        raise _refuse(f"an image must not be empty, got {height}x{width}")
    if not 0 < min_pixels <= max_pixels:
        raise _refuse(f"image pixel budget must satisfy 0 < min_pixels <= max_pixels, got {min_pixels}, {max_pixels}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise _refuse(f"image aspect ratio {height}x{width} exceeds {MAX_ASPECT_RATIO}:1")
    factor = vision.patch_size * vision.spatial_merge_size
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


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
        raise _refuse(f"the vision tower takes {vision.in_channels} channels; camera images are RGB")
    height, width = image.rgb.shape[:2]
    size = resized_size(height, width, vision, min_pixels, max_pixels)
    pixels = torch.from_numpy(np.ascontiguousarray(image.rgb)).permute(2, 0, 1).contiguous().unsqueeze(0)
    if size != (height, width):
        pixels = F.interpolate(pixels, size=size, mode="bicubic", align_corners=False, antialias=True)
    patches, grid = _patchify(_normalised(pixels), vision)
    return PreparedImage(patches, grid, vision.spatial_merge_size)
