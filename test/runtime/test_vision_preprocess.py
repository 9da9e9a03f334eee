"""Image preprocessing against HF's Qwen2-VL image processor configured as the released Qwen3.5/3.6
``preprocessor_config.json``.

The oracle is the processor's PIL backend (``Qwen2VLImageProcessorPil``): its torchvision backend, the one the
checkpoints name, needs a torchvision build for the CPU torch that no index here serves. Sizes, grids and the patch
layout must match exactly, and so must the values wherever no resize happens. Where an image is resized, PIL's
bicubic and torch's uint8 antialiased bicubic (what the fast processor runs on the CPU, and the runtime too) are the
same separable filter in fixed point with different precisions: a resized pixel may differ by a level or two (2/255
before normalising, 2/127.5 after), and almost all agree exactly.
"""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from transformers.image_utils import PILImageResampling
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil, smart_resize

from flashrt_ros.runtime import ErrorCode, FlashRTError
from flashrt_ros.runtime.config import PRESETS
from flashrt_ros.runtime.vision.preprocess import (DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, RESCALE_FACTOR, Image,
                                                   preprocess, resized_size)

# Qwen3.5's preprocessor_config.json (the same for every released size): the values the runtime must follow.
RELEASED = {"size": {"longest_edge": 16_777_216, "shortest_edge": 65_536}, "patch_size": 16,
            "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
VISION = PRESETS["qwen3.5-0.8b"].vision
LEVEL = 1 / 127.5                      # one uint8 level after normalising with mean = std = 0.5
MIN_PIXELS, MAX_PIXELS = 32 * 32 * 4, 32 * 32 * 40     # small budgets keep the test fast; the defaults are checked


def hf_processor(min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(**{**RELEASED, "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels}})


def hf_prepare(rgb: np.ndarray, processor) -> tuple[np.ndarray, tuple[int, int, int]]:
    out = processor(images=[rgb], input_data_format="channels_last", return_tensors="np")
    return out["pixel_values"], tuple(int(v) for v in out["image_grid_thw"][0])


def camera(height: int, width: int, seed: int) -> np.ndarray:
    """A smooth picture with noise on it, as a camera gives (pure noise maximises the filters' rounding gaps)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = 127 + 100 * np.sin(x[..., None] / 7.0 + np.arange(3)) * np.cos(y[..., None] / 11.0)
    return np.clip(base + rng.normal(0, 12, (height, width, 3)), 0, 255).astype(np.uint8)


def test_defaults_are_the_released_processor_config():
    processor = Qwen2VLImageProcessorPil(**RELEASED)
    assert (DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS) == (processor.size["shortest_edge"],
                                                        processor.size["longest_edge"])
    assert processor.resample == PILImageResampling.BICUBIC     # the class default: the config names none
    assert processor.rescale_factor == RESCALE_FACTOR
    assert (VISION.patch_size, VISION.spatial_merge_size, VISION.temporal_patch_size) == (
        processor.patch_size, processor.merge_size, processor.temporal_patch_size)


@settings(max_examples=400, deadline=None)
@given(height=st.integers(1, 6000), width=st.integers(1, 6000), min_side=st.integers(1, 600),
       extra=st.integers(0, 3000))
def test_resized_size_is_smart_resize(height, width, min_side, extra):
    min_pixels, max_pixels = min_side * min_side, (min_side + extra) ** 2
    factor = VISION.patch_size * VISION.spatial_merge_size
    try:
        expected = smart_resize(height, width, factor, min_pixels, max_pixels)
    except ValueError:
        with pytest.raises(FlashRTError) as refused:
            resized_size(height, width, VISION, min_pixels, max_pixels)
        assert refused.value.code == ErrorCode.INVALID_ARGUMENT and "aspect ratio" in refused.value.message
        return
    assert resized_size(height, width, VISION, min_pixels, max_pixels) == expected


@pytest.mark.parametrize("height, width", [(0, 10), (10, 0)])
def test_an_empty_image_is_refused(height, width):
    with pytest.raises(FlashRTError) as refused:
        resized_size(height, width, VISION)
    assert refused.value.code == ErrorCode.INVALID_ARGUMENT
    with pytest.raises(FlashRTError) as refused:
        Image(np.zeros((height, width, 3), np.uint8))
    assert refused.value.code == ErrorCode.INVALID_ARGUMENT and "empty" in refused.value.message


@pytest.mark.parametrize("rgb", [np.zeros((4, 4, 3), np.float32), np.zeros((4, 4), np.uint8),
                                 np.zeros((4, 4, 4), np.uint8), [[0, 0, 0]]])
def test_an_image_that_is_not_uint8_rgb_is_refused(rgb):
    with pytest.raises(FlashRTError) as refused:
        Image(rgb)
    assert refused.value.code == ErrorCode.INVALID_ARGUMENT and "uint8 [height, width, 3]" in refused.value.message


def test_an_inverted_pixel_budget_is_refused():
    with pytest.raises(FlashRTError) as refused:
        resized_size(64, 64, VISION, min_pixels=5000, max_pixels=4000)
    assert refused.value.code == ErrorCode.INVALID_ARGUMENT


@pytest.mark.parametrize("height, width", [(64, 96), (128, 64), (96, 160)])
def test_unresized_images_are_the_processors_patches(height, width):
    """Sizes smart_resize keeps: no filter runs, so normalising and the patch layout must agree to float rounding."""
    rgb = camera(height, width, seed=height + width)
    expected, grid = hf_prepare(rgb, hf_processor())
    prepared = preprocess(Image(rgb), VISION, MIN_PIXELS, MAX_PIXELS)
    assert prepared.grid == grid == (1, height // 16, width // 16)
    assert prepared.patches.dtype.is_floating_point and prepared.patches.shape == expected.shape
    np.testing.assert_allclose(prepared.patches.numpy(), expected, rtol=0, atol=1e-6)
    assert prepared.token_count == height * width // (16 * 16 * 4)


@pytest.mark.parametrize("height, width", [(50, 70), (240, 320), (31, 200), (300, 180)])
def test_resized_images_are_the_processors_patches(height, width):
    """Down- and up-sampled images: same grid; every value within 2 levels, nearly all exact (module docstring)."""
    rgb = camera(height, width, seed=height * width)
    expected, grid = hf_prepare(rgb, hf_processor())
    prepared = preprocess(Image(rgb), VISION, MIN_PIXELS, MAX_PIXELS)
    assert prepared.grid == grid and (16 * grid[1], 16 * grid[2]) == resized_size(height, width, VISION, MIN_PIXELS,
                                                                                   MAX_PIXELS)
    assert (16 * grid[1], 16 * grid[2]) != (height, width)              # the case is a resize
    gap = np.abs(prepared.patches.numpy() - expected)
    assert gap.max() <= 2 * LEVEL + 1e-6
    assert (gap <= 1e-6).mean() >= 0.99


def test_the_patch_rows_hold_the_right_pixels():
    """Independent of HF: the row of patch (y, x) in merge-block order holds that 16x16 square, channel-major,
    twice over the temporal patch."""
    rgb = camera(64, 128, seed=1)
    prepared = preprocess(Image(rgb), VISION, MIN_PIXELS, MAX_PIXELS)
    _, gh, gw = prepared.grid
    normalised = (rgb.astype(np.float32) - 127.5) / 127.5
    for row in (0, 1, 2, 5, gh * gw - 1):
        block, inner = divmod(row, 4)
        by, bx = divmod(block, gw // 2)
        y, x = 2 * by + inner // 2, 2 * bx + inner % 2
        square = normalised[16 * y:16 * y + 16, 16 * x:16 * x + 16].transpose(2, 0, 1)      # [C, 16, 16]
        expected = np.stack([square, square], axis=1).reshape(-1)                            # [C, T, 16, 16]
        np.testing.assert_allclose(prepared.patches[row].numpy(), expected, rtol=0, atol=1e-6)


def test_the_default_budget_resizes_small_frames_up():
    """A 160x120 frame is below the released min_pixels (65536): it comes out 256 x 320-ish, as HF's does."""
    rgb = camera(120, 160, seed=2)
    expected, grid = hf_prepare(rgb, hf_processor(DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS))
    prepared = preprocess(Image(rgb), VISION)
    assert prepared.grid == grid and prepared.grid[1] * prepared.grid[2] * 256 >= DEFAULT_MIN_PIXELS
    assert np.abs(prepared.patches.numpy() - expected).max() <= 2 * LEVEL + 1e-6


def test_a_strided_view_prepares_like_its_copy():
    """A BGR frame flipped to RGB by a view (negative strides), as a node may hand it over."""
    bgr = camera(50, 70, seed=4)
    view = bgr[..., ::-1]
    prepared = preprocess(Image(view), VISION, MIN_PIXELS, MAX_PIXELS)
    copied = preprocess(Image(np.ascontiguousarray(view)), VISION, MIN_PIXELS, MAX_PIXELS)
    assert prepared.grid == copied.grid and np.array_equal(prepared.patches.numpy(), copied.patches.numpy())
