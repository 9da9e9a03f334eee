"""Temperatures that would make the scaled logits non-finite are refused; the documented minimum samples."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashrt_ros.runtime import ErrorCode, FlashRTError, SamplingParams
from flashrt_ros.runtime.arena import RNG_COUNTER
from flashrt_ros.runtime.sampler import MAX_TEMPERATURE, MIN_TEMPERATURE, Sampler


@given(st.floats(min_value=0.0, max_value=MIN_TEMPERATURE, exclude_min=True, exclude_max=True))
def test_temperatures_below_the_minimum_are_refused(t):
    with pytest.raises(FlashRTError) as err:
        SamplingParams(temperature=t)
    assert err.value.code == ErrorCode.INVALID_ARGUMENT and f"{MIN_TEMPERATURE:g}" in err.value.message


@pytest.mark.parametrize("t", [math.nan, -1.0, MAX_TEMPERATURE * 1.01, math.inf])
def test_other_bad_temperatures_are_refused(t):
    with pytest.raises(FlashRTError):
        SamplingParams(temperature=t)


@settings(max_examples=30, deadline=None)
@given(st.floats(min_value=MIN_TEMPERATURE, max_value=MAX_TEMPERATURE), st.integers(0, 2**31))
def test_accepted_temperatures_give_finite_scaled_logits_and_a_valid_token(t, counter):
    vocab = 64
    sampler = Sampler(vocab, torch.device("cpu"))
    sampler.configure(SamplingParams(temperature=t))
    logits = torch.linspace(-3e4, 3e4, vocab)  # far larger than any model's logits
    assert torch.isfinite(logits / sampler.temperature).all()
    meta = torch.zeros(8, dtype=torch.int64)
    meta[RNG_COUNTER] = counter
    token = int(sampler.sample(logits, meta))
    assert 0 <= token < vocab


def test_at_the_minimum_a_clear_winner_is_always_drawn():
    sampler = Sampler(16, torch.device("cpu"))
    sampler.configure(SamplingParams(temperature=MIN_TEMPERATURE))
    logits = torch.zeros(16)
    logits[5] = 1.0
    for counter in range(20):
        meta = torch.zeros(8, dtype=torch.int64)
        meta[RNG_COUNTER] = counter
        assert int(sampler.sample(logits, meta)) == 5
