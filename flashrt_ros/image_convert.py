"""sensor_msgs/Image to the RGB pixels the engine takes, with numpy alone (no tensor code in the node).

What the node admits, checked on the message's fields before any pixel is copied (each refusal is
INVALID_ARGUMENT naming the image and the problem; nothing reaches the engine):

* the encoding: rgb8, bgr8 or mono8 (:data:`CHANNELS`); mono8 is replicated to the three channels;
* a non-zero height and width; ``step`` at least ``width * channels`` (longer rows are padding, dropped);
  ``data`` exactly ``step * height`` bytes;
* at most ``max_raw_bytes`` of data per image (the node parameter ``image.max_raw_bytes``);
* the observation's images together at most ``max_observation_pixels`` after the engine's resize
  (``image.max_observation_pixels``; the resize follows ``image.min_pixels`` / ``image.max_pixels``).

The fields are read by name, so a rosbags message from a bag converts exactly as an rclpy one does. An image
is identified by :func:`digest` (sha256 of its RGB pixels and shape): what a StateEvent records, and what a
replay matches a bag's ``~/observation`` images against when the events were recorded without pixels.
"""
import functools
import hashlib
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from flashrt_ros.runtime.errors import ErrorCode, FlashRTError
from flashrt_ros.runtime.vision.image import resized_size

#: the encodings the node reads, and their bytes per pixel
CHANNELS = {"rgb8": 3, "bgr8": 3, "mono8": 1}
RGB8 = "rgb8"


def _refuse(index: int, problem: str) -> FlashRTError:
    return FlashRTError(ErrorCode.INVALID_ARGUMENT, f"images[{index}]: {problem}")


def check(msg, index: int = 0, max_raw_bytes: Optional[int] = None) -> int:
    """Check an Image message's fields without touching its pixels; returns its channels per pixel."""
    channels = CHANNELS.get(msg.encoding)
    if channels is None:
        raise _refuse(index, f"encoding {msg.encoding!r} is not supported (supported: {', '.join(CHANNELS)})")
    height, width, step, size = int(msg.height), int(msg.width), int(msg.step), len(msg.data)
    if height == 0 or width == 0:
        raise _refuse(index, f"zero size ({width}x{height} pixels)")
    if step < width * channels:
        raise _refuse(index, f"step {step} is shorter than a row of {width} {msg.encoding} pixels "
                             f"({width * channels} bytes)")
    if size != step * height:
        raise _refuse(index, f"data holds {size} bytes, but step {step} x height {height} is {step * height}")
    if max_raw_bytes is not None and size > max_raw_bytes:
        raise _refuse(index, f"{size} bytes of data ({width}x{height} {msg.encoding}), over "
                             f"image.max_raw_bytes={max_raw_bytes}")
    return channels


def to_rgb(msg, index: int = 0, max_raw_bytes: Optional[int] = None) -> np.ndarray:
    """The message's pixels as a new uint8 array [height, width, 3], RGB (row padding dropped, BGR swapped,
    mono replicated); FlashRTError (INVALID_ARGUMENT) for what :func:`check` refuses."""
    channels = check(msg, index, max_raw_bytes)
    height, width = int(msg.height), int(msg.width)
    rows = np.frombuffer(msg.data, dtype=np.uint8).reshape(height, int(msg.step))
    pixels = rows[:, :width * channels].reshape(height, width, channels)
    if msg.encoding == "bgr8":
        pixels = pixels[:, :, ::-1]
    elif channels == 1:
        pixels = np.broadcast_to(pixels, (height, width, 3))
    return np.array(pixels, dtype=np.uint8, order="C", copy=True)  # owned: the message's buffer may be reused


def digest(rgb: np.ndarray) -> str:
    """sha256 (hex) of an RGB image: its shape, then its pixels row by row."""
    h = hashlib.sha256(f"{rgb.shape[0]}x{rgb.shape[1]}:".encode())
    h.update(np.ascontiguousarray(rgb, dtype=np.uint8).tobytes())
    return h.hexdigest()


def rgb8_fields(rgb: np.ndarray, pixels: bool = True) -> dict:
    """The fields of an rgb8 Image message holding ``rgb`` (``data`` empty unless ``pixels``)."""
    height, width = int(rgb.shape[0]), int(rgb.shape[1])
    return {"height": height, "width": width, "encoding": RGB8, "is_bigendian": 0, "step": 3 * width,
            "data": np.ascontiguousarray(rgb, dtype=np.uint8).tobytes() if pixels else b""}


def _unchanged(height: int, width: int) -> tuple[int, int]:
    return height, width


@dataclass(frozen=True)
class ImageLimits:
    """What the node admits of an observation's images (the ``image.*`` parameters)."""
    max_raw_bytes: Optional[int] = None           # per image, bytes of ``data`` (None = no limit)
    max_observation_pixels: Optional[int] = None  # all images of one observation, after ``resized`` (None = none)
    resized: Callable[[int, int], tuple[int, int]] = _unchanged  # (height, width) the engine resizes an image to

    def convert(self, images) -> list[np.ndarray]:
        """Every image of an observation as RGB, or FlashRTError; all checks run before any pixel is copied."""
        for index, msg in enumerate(images):
            check(msg, index, self.max_raw_bytes)
        if self.max_observation_pixels is not None:
            sizes = [self.resized(int(m.height), int(m.width)) for m in images]
            total = sum(h * w for h, w in sizes)
            if total > self.max_observation_pixels:
                raise FlashRTError(ErrorCode.INVALID_ARGUMENT,
                                   f"the observation's {len(sizes)} image(s) take {total} pixels once resized "
                                   f"({', '.join(f'{w}x{h}' for h, w in sizes)}), over "
                                   f"image.max_observation_pixels={self.max_observation_pixels}")
        return [to_rgb(msg, index) for index, msg in enumerate(images)]


def limits_for(engine, max_raw_bytes: Optional[int] = None, max_observation_pixels: Optional[int] = None
               ) -> ImageLimits:
    """The limits on ``engine``: the resize its vision tower applies (its ``image_min_pixels`` /
    ``image_max_pixels``), none for a model without one (its engine refuses images anyway)."""
    vision, config = engine.model_config.vision, engine.config
    resized = _unchanged if vision is None else functools.partial(
        resized_size, vision=vision, min_pixels=config.image_min_pixels, max_pixels=config.image_max_pixels)
    return ImageLimits(max_raw_bytes, max_observation_pixels, resized)
