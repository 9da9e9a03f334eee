"""Uniform binning between continuous values and token ids (no engine, no ROS)."""
import math

import pytest

from flashrt_ros.discretiser import Discretiser
from flashrt_ros.runtime import ErrorCode, FlashRTError


def test_values_map_to_their_bin_and_back_to_its_centre():
    d = Discretiser(low=-1.0, high=1.0, bins=4, token_offset=100)  # bins of width 0.5
    assert d.encode([-1.0, -0.6, -0.5, 0.1, 0.99]) == [100, 100, 101, 102, 103]
    assert d.decode([100, 101, 102, 103]) == [-0.75, -0.25, 0.25, 0.75]


def test_round_trip_is_within_half_a_bin():
    d = Discretiser(low=-2.0, high=3.0, bins=255, token_offset=257)
    width = 5.0 / 255
    for i in range(101):
        v = -2.0 + 5.0 * i / 100
        (back,) = d.decode(d.encode([v]))
        assert abs(back - v) <= width / 2 + 1e-12


def test_out_of_range_values_clip_to_the_edge_bins():
    d = Discretiser(low=0.0, high=1.0, bins=10, token_offset=5)
    assert d.encode([-3.0, 1.0, 7.5, -math.inf, math.inf]) == [5, 14, 14, 5, 14]


def test_nan_is_refused():
    with pytest.raises(FlashRTError) as err:
        Discretiser().encode([0.0, math.nan])
    assert err.value.code == ErrorCode.INVALID_ARGUMENT


@pytest.mark.parametrize("kwargs", [dict(low=1.0, high=1.0), dict(low=2.0, high=1.0), dict(low=math.nan),
                                    dict(bins=0), dict(dims=0), dict(horizon=0), dict(token_offset=-1)])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        Discretiser(**kwargs)


def test_bins_must_fit_in_the_vocabulary():
    Discretiser(bins=255, token_offset=257).check_vocab(512)
    with pytest.raises(ValueError, match="vocabulary"):
        Discretiser(bins=256, token_offset=257).check_vocab(512)


def test_decode_refuses_tokens_outside_the_bins():
    with pytest.raises(ValueError):
        Discretiser(bins=4, token_offset=10).decode([14])


def test_action_is_the_first_horizon_times_dims_action_tokens():
    d = Discretiser(low=0.0, high=4.0, bins=4, token_offset=10, dims=2, horizon=2)
    generated = [3, 10, 99, 13, 11, 5, 12, 13]  # 3, 99 and 5 are text tokens and are skipped
    ids, values = d.action_values(generated)
    assert ids == [10, 13, 11, 12]
    assert values == [0.5, 3.5, 1.5, 2.5]
    assert d.action_values([10, 13, 11, 99]) is None  # three of four values: no action yet
