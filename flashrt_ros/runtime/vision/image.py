"""A camera image as the runtime takes it, and the size the vision tower's processor resizes it to: numpy and
arithmetic only, so the node and the bag tools (which run without torch, e.g. on ROS 2 Jazzy's Python) check images
with the same rules as the engine."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..errors import ErrorCode, FlashRTError
from .config import VisionConfig

# The released processor's preprocessor_config.json (every Qwen3.5/3.6 size).
DEFAULT_MIN_PIXELS = 65_536           # size.shortest_edge: a pixel count, not an edge
DEFAULT_MAX_PIXELS = 16_777_216       # size.longest_edge
MAX_ASPECT_RATIO = 200                # smart_resize refuses longer sides than this many times the shorter one


def refuse(message: str) -> FlashRTError:
    return FlashRTError(ErrorCode.INVALID_ARGUMENT, message)


@dataclasses.dataclass(frozen=True)
class Image:
    """One RGB camera image: ``rgb`` uint8 [height, width, 3] (the node converts ROS encodings to it)."""
    rgb: np.ndarray

    def __post_init__(self):
        rgb = self.rgb
        if not isinstance(rgb, np.ndarray) or rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
            what = f"{rgb.dtype} {rgb.shape}" if isinstance(rgb, np.ndarray) else type(rgb).__name__
            raise refuse(f"an image must be uint8 [height, width, 3] RGB, got {what}")
        if rgb.shape[0] == 0 or rgb.shape[1] == 0:
            raise refuse(f"an image must not be empty, got {rgb.shape[0]}x{rgb.shape[1]}")


def resized_size(height: int, width: int, vision: VisionConfig, min_pixels: int = DEFAULT_MIN_PIXELS,
                 max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[int, int]:
    """Qwen's ``smart_resize``: (height, width) as multiples of patch x merge, the aspect ratio kept as closely as
    possible, the pixel count brought within [min_pixels, max_pixels] (a side stays at least one multiple, so an
    extreme aspect ratio can end above ``max_pixels``: budget checks use this result)."""
    if height < 1 or width < 1:
        raise refuse(f"an image must not be empty, got {height}x{width}")
    if not 0 < min_pixels <= max_pixels:
        raise refuse(f"image pixel budget must satisfy 0 < min_pixels <= max_pixels, got {min_pixels}, {max_pixels}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise refuse(f"image aspect ratio {height}x{width} exceeds {MAX_ASPECT_RATIO}:1")
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
