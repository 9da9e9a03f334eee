"""image_convert: sensor_msgs/Image (rclpy and rosbags forms) to RGB, checked against a per-pixel reference; every
malformed image refused with INVALID_ARGUMENT naming the image and the problem; digests; the observation conversion."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from rclpy.serialization import deserialize_message, serialize_message
from sensor_msgs.msg import Image as ImageMsg

from flashrt_ros import image_convert
from flashrt_ros.bag.typestore import typestore
from flashrt_ros.msg import Observation
from flashrt_ros.ros_convert import RefusedObservation, observation_in, observation_msg
from flashrt_ros.runtime.errors import ErrorCode, FlashRTError

SIZES = st.integers(min_value=1, max_value=9)


def reference_bytes(rgb: np.ndarray, encoding: str, padding: bytes) -> tuple[bytes, int]:
    """How a camera driver lays ``rgb`` out in ``encoding``, pixel by pixel, each row followed by ``padding``."""
    out = bytearray()
    for row in rgb.tolist():
        for r, g, b in row:
            out += {"rgb8": bytes([r, g, b]), "bgr8": bytes([b, g, r]), "mono8": bytes([r])}[encoding]
        out += padding
    return bytes(out), rgb.shape[1] * image_convert.CHANNELS[encoding] + len(padding)


def as_rosbags(msg: ImageMsg):
    """The same message as a bag hands it out (rosbags, data a numpy array)."""
    return typestore().deserialize_cdr(serialize_message(msg), "sensor_msgs/msg/Image")


def image_msg(height, width, encoding, data, step) -> ImageMsg:
    return ImageMsg(height=height, width=width, encoding=encoding, step=step, data=data)


@st.composite
def camera_images(draw):
    height, width = draw(SIZES), draw(SIZES)
    encoding = draw(st.sampled_from(sorted(image_convert.CHANNELS)))
    seed = draw(st.integers(0, 2**32 - 1))
    rgb = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    if encoding == "mono8":
        rgb[:, :, 1] = rgb[:, :, 2] = rgb[:, :, 0]
    padding = draw(st.binary(max_size=7))
    data, step = reference_bytes(rgb, encoding, padding)
    return rgb, image_msg(height, width, encoding, data, step)


@settings(max_examples=150, deadline=None)
@given(camera_images(), st.booleans())
def test_every_supported_layout_converts_to_the_reference_rgb(case, from_bag):
    rgb, msg = case
    got = image_convert.to_rgb(as_rosbags(msg) if from_bag else msg)
    assert got.dtype == np.uint8 and got.shape == rgb.shape and got.flags.c_contiguous
    assert np.array_equal(got, rgb)  # padding dropped, bgr swapped, mono replicated
    assert image_convert.digest(got) == image_convert.digest(rgb)


def test_the_pixels_are_a_copy_not_a_view_of_the_message():
    msg = image_msg(1, 2, "rgb8", bytes(range(6)), 6)
    rgb = image_convert.to_rgb(msg)
    msg.data[0] = 99
    assert rgb[0, 0, 0] == 0


@pytest.mark.parametrize("encoding", ["rgba8", "bgra8", "mono16", "yuv422", "16UC1", "RGB8", "bayer_rggb8", ""])
def test_an_unsupported_encoding_is_refused_naming_it(encoding):
    with pytest.raises(FlashRTError) as err:
        image_convert.to_rgb(image_msg(2, 2, encoding, bytes(16), 8), index=3)
    assert err.value.code == ErrorCode.INVALID_ARGUMENT
    assert f"images[3]: encoding {encoding!r} is not supported" in err.value.message and "rgb8" in err.value.message


@settings(max_examples=100, deadline=None)
@given(height=st.integers(0, 6), width=st.integers(0, 6), step_delta=st.integers(-4, 4),
       size_delta=st.integers(-5, 5), encoding=st.sampled_from(sorted(image_convert.CHANNELS)))
def test_any_size_or_step_mismatch_is_refused_and_exact_layouts_are_not(height, width, step_delta, size_delta,
                                                                          encoding):
    """The naive rule: non-zero sides, step >= width * channels, data == step * height bytes."""
    channels = image_convert.CHANNELS[encoding]
    step = max(0, width * channels + step_delta)
    size = max(0, step * height + size_delta)
    msg = image_msg(height, width, encoding, bytes(size), step)
    valid = height > 0 and width > 0 and step >= width * channels and size == step * height
    if valid:
        assert image_convert.to_rgb(msg).shape == (height, width, 3)
        return
    with pytest.raises(FlashRTError) as err:
        image_convert.to_rgb(msg)
    assert err.value.code == ErrorCode.INVALID_ARGUMENT and err.value.message.startswith("images[0]: ")
    expected = ("zero size" if not (height and width) else "shorter than a row" if step < width * channels
                else f"data holds {size} bytes")
    assert expected in err.value.message


def test_data_over_max_raw_bytes_is_refused_and_at_it_accepted():
    msg = image_msg(4, 4, "rgb8", bytes(48), 12)
    assert image_convert.to_rgb(msg, max_raw_bytes=48).shape == (4, 4, 3)
    with pytest.raises(FlashRTError) as err:
        image_convert.to_rgb(msg, max_raw_bytes=47)
    assert err.value.code == ErrorCode.INVALID_ARGUMENT and "image.max_raw_bytes=47" in err.value.message


def test_the_digest_tells_shapes_and_pixels_apart():
    rgb = np.arange(36, dtype=np.uint8).reshape(2, 6, 3)
    assert image_convert.digest(rgb) != image_convert.digest(rgb.reshape(6, 2, 3))  # same bytes, other shape
    changed = rgb.copy()
    changed[1, 5, 2] ^= 1
    assert image_convert.digest(rgb) != image_convert.digest(changed)
    assert image_convert.digest(rgb) == image_convert.digest(rgb.copy())


@settings(max_examples=50, deadline=None)
@given(camera_images(), st.booleans())
def test_rgb8_fields_round_trip_to_the_same_pixels(case, pixels):
    rgb, _ = case
    msg = ImageMsg(**image_convert.rgb8_fields(rgb, pixels))
    assert (msg.height, msg.width, msg.encoding, msg.step) == (rgb.shape[0], rgb.shape[1], "rgb8", 3 * rgb.shape[1])
    if pixels:
        assert np.array_equal(image_convert.to_rgb(msg), rgb)
    else:
        assert len(msg.data) == 0


def test_an_observation_is_checked_whole_before_any_pixel_is_copied():
    good = image_msg(2, 2, "rgb8", bytes(12), 6)
    limits = image_convert.ImageLimits(max_raw_bytes=100)
    with pytest.raises(FlashRTError, match=r"images\[1\]: encoding 'yuv422'"):
        limits.convert([good, image_msg(2, 2, "yuv422", bytes(8), 4)])
    assert [a.shape for a in limits.convert([good, good])] == [(2, 2, 3), (2, 2, 3)]


def test_the_observation_pixel_budget_counts_the_resized_images():
    doubled = image_convert.ImageLimits(max_observation_pixels=32, resized=lambda h, w: (2 * h, 2 * w))
    two = [image_msg(2, 1, "mono8", bytes(2), 1)] * 2  # 2 images of 2 pixels, 8 each once resized: 16
    assert len(doubled.convert(two)) == 2
    with pytest.raises(FlashRTError) as err:
        doubled.convert(two * 2 + [image_msg(1, 1, "mono8", bytes(1), 1)])  # 4 x 8 + 4 = 36 > 32
    assert err.value.code == ErrorCode.INVALID_ARGUMENT
    assert "take 36 pixels once resized" in err.value.message and "image.max_observation_pixels=32" in err.value.message


def test_an_observation_message_converts_its_images_in_order():
    rgb = np.arange(12, dtype=np.uint8).reshape(2, 2, 3)
    bgr = rgb[:, :, ::-1].tobytes()
    msg = Observation(text="what is red?", token_ids=[5], max_new_tokens=3,
                      images=[image_msg(2, 2, "bgr8", bgr, 6), image_msg(1, 1, "mono8", b"\x07", 1)])
    obs = observation_in(msg)
    assert (obs.text, obs.token_ids, obs.max_new_tokens) == ("what is red?", [5], 3)
    assert np.array_equal(obs.images[0].rgb, rgb) and obs.images[1].rgb.tolist() == [[[7, 7, 7]]]
    back = observation_msg(obs)  # the event's copy: rgb8, same pixels
    assert [m.encoding for m in back.images] == ["rgb8", "rgb8"]
    assert np.array_equal(image_convert.to_rgb(back.images[0]), rgb)
    on_the_wire = deserialize_message(serialize_message(back), Observation)
    assert np.array_equal(observation_in(on_the_wire).images[0].rgb, rgb)


def test_an_observation_with_an_unreadable_image_is_refused_with_the_rest_of_it():
    msg = Observation(text="look", token_ids=[1, 2], max_new_tokens=4, snapshot_label="s",
                      images=[image_msg(2, 2, "rgb8", bytes(12), 6), image_msg(2, 2, "rgba8", bytes(16), 8)])
    msg.header.stamp.sec = 7
    with pytest.raises(RefusedObservation) as err:
        observation_in(msg)
    refused = err.value
    assert refused.code == ErrorCode.INVALID_ARGUMENT and "images[1]: encoding 'rgba8'" in refused.message
    obs = refused.observation
    assert (obs.text, obs.token_ids, obs.max_new_tokens, obs.snapshot_label, obs.stamp_ns) == (
        "look", [1, 2], 4, "s", 7_000_000_000)
    assert obs.images == []


def test_the_image_parameters_reach_the_engine_config_and_the_limits():
    from flashrt_ros.bag.replay import settings_from

    settings = settings_from({"vision_tower": False, "image.min_pixels": 1024, "image.max_pixels": 4096,
                              "image.max_raw_bytes": 77, "image.max_observation_pixels": 88,
                              "image.record_pixels": False})
    engine = settings.engine
    assert (engine.vision_tower, engine.image_min_pixels, engine.image_max_pixels) == (False, 1024, 4096)
    assert settings.image_limits == {"max_raw_bytes": 77, "max_observation_pixels": 88}
    assert settings.record_pixels is False


def test_a_min_pixels_above_max_pixels_is_refused_naming_both():
    from flashrt_ros.bag.bagfile import BagError
    from flashrt_ros.bag.replay import settings_from

    with pytest.raises(BagError, match="image.min_pixels=5000 is above image.max_pixels=4096"):
        settings_from({"image.min_pixels": 5000, "image.max_pixels": 4096})
