"""Vision benchmark (``flashrt-runtime bench-vision``): per camera resolution, the image tokens it yields, the
preprocessing (on the CPU, where the runtime always runs it) and the tower's forward on the device (the patches'
copy to it included) in ms per image, medians over repeats after one warm-up. Camera-like random frames: the work
depends on the size only."""
from __future__ import annotations

import statistics

import numpy as np
import torch

from flashrt_ros.runtime import weights
from flashrt_ros.runtime.errors import ErrorCode, FlashRTError
from flashrt_ros.runtime.vision.preprocess import Image, preprocess

from .timing import timed

RESOLUTIONS = "240x320,480x640,720x1280"      # height x width: QVGA, VGA and 720p camera frames
_CPU = torch.device("cpu")


def parse_resolutions(text: str) -> list[tuple[int, int]]:
    try:
        sizes = [tuple(int(v) for v in item.lower().split("x")) for item in text.split(",") if item.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(len(s) != 2 or min(s) < 1 for s in sizes):
        raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"resolutions must be HEIGHTxWIDTH[,...], got {text!r}")
    return sizes


@torch.inference_mode()
def run(model: str, device: torch.device, dtype: torch.dtype, seed: int, resolutions: list[tuple[int, int]],
        repeats: int, min_pixels: int, max_pixels: int) -> dict:
    built, _ = weights.load(model, device, dtype, seed)
    tower, vision = built.visual, built.cfg.vision
    if tower is None:
        raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"model {model!r} has no vision tower")
    rng = np.random.default_rng(0)
    rows = []
    for height, width in resolutions:
        image = Image(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        prepared = preprocess(image, vision, min_pixels, max_pixels)
        preprocess_ms = [timed(_CPU, lambda: preprocess(image, vision, min_pixels, max_pixels))[1]
                         for _ in range(repeats)]
        tower(prepared.patches.to(device), prepared.grid)                                   # warm-up
        encoder_ms = [timed(device, lambda: tower(prepared.patches.to(device), prepared.grid))[1]
                      for _ in range(repeats)]
        _, h, w = prepared.grid
        rows.append({"height": height, "width": width, "resized": [h * vision.patch_size, w * vision.patch_size],
                     "patches": prepared.patches.shape[0], "tokens": prepared.token_count,
                     "preprocess_ms": statistics.median(preprocess_ms), "encoder_ms": statistics.median(encoder_ms)})
    return {"model": model, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), "min_pixels": min_pixels, "max_pixels": max_pixels,
            "repeats": repeats, "rows": rows}


def markdown(result: dict) -> str:
    lines = ["| camera | resized | image tokens | preprocess ms | encoder ms |", "|---|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['width']}x{row['height']} | {row['resized'][1]}x{row['resized'][0]} | {row['tokens']} "
                     f"| {row['preprocess_ms']:.2f} | {row['encoder_ms']:.2f} |")
    return "\n".join(lines)
