"""Camera images for the tests: RGB pixels, the sensor_msgs/Image a driver would send for them, and images the node
must refuse (with the words its refusal must contain)."""
import numpy as np
from sensor_msgs.msg import Image as ImageMsg

BAD_IMAGES = {
    "unsupported encoding": (ImageMsg(height=2, width=2, encoding="yuv422", step=4, data=bytes(8)),
                             "images[0]: encoding 'yuv422' is not supported"),
    "zero size": (ImageMsg(height=0, width=5, encoding="rgb8", step=15, data=b""), "images[0]: zero size"),
    "step shorter than a row": (ImageMsg(height=2, width=4, encoding="rgb8", step=8, data=bytes(16)),
                                "images[0]: step 8 is shorter than a row of 4 rgb8 pixels"),
    "data longer than step x height": (ImageMsg(height=2, width=2, encoding="mono8", step=2, data=bytes(5)),
                                       "images[0]: data holds 5 bytes, but step 2 x height 2 is 4"),
    "data shorter than step x height": (ImageMsg(height=3, width=2, encoding="bgr8", step=8, data=bytes(20)),
                                        "images[0]: data holds 20 bytes, but step 8 x height 3 is 24"),
    "over max_raw_bytes": (ImageMsg(height=8, width=8, encoding="rgb8", step=24, data=bytes(192)),
                           "image.max_raw_bytes=100"),
}
MAX_RAW_BYTES = 100  # what "over max_raw_bytes" is over


def rgb_pixels(height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def camera_msg(rgb: np.ndarray, encoding: str = "rgb8", padding: int = 0) -> ImageMsg:
    """``rgb`` as a driver sends it in ``encoding`` (mono8: the red channel), rows padded by ``padding`` bytes."""
    pixels = {"rgb8": rgb, "bgr8": rgb[:, :, ::-1], "mono8": rgb[:, :, :1]}[encoding]
    rows = np.concatenate([pixels.reshape(rgb.shape[0], -1), np.zeros((rgb.shape[0], padding), np.uint8)], axis=1)
    return ImageMsg(height=rgb.shape[0], width=rgb.shape[1], encoding=encoding, step=rows.shape[1],
                    data=rows.tobytes())
