"""Kernel timings read their weights from device memory (``timing.cold_copies``) and take every copy in turn."""
from types import SimpleNamespace

import pytest
import torch

from flashrt_ros.tools import timing


@pytest.mark.parametrize("l2, nbytes", [(50 << 20, 7 << 20), (50 << 20, 4 << 20), (50 << 20, 100 << 20),
                                        (50 << 20, 508 << 20), (60 << 20, 1), (60 << 20, 0)])
def test_the_copies_cycled_through_exceed_the_l2_cache_by_the_multiple_and_no_more_than_one_copy_over(
        monkeypatch, l2, nbytes):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(L2_cache_size=l2))
    copies = timing.cold_copies(torch.device("cuda", 0), nbytes)
    cycled, needed = copies * max(1, nbytes), timing.COLD_L2_MULTIPLE * l2
    assert copies >= 1 and cycled >= needed
    assert copies == 1 or (copies - 1) * nbytes < needed


def test_on_the_cpu_one_copy_is_enough():
    assert timing.cold_copies(torch.device("cpu"), 1) == 1


def test_a_timing_takes_every_copy_in_turn_and_reports_the_time_per_call():
    taken = []
    calls = [lambda i=i: taken.append(i) for i in range(3)]
    us = timing.time_calls_us(torch.device("cpu"), calls, repeats=2)
    assert taken == [0, 1, 2] * 3 and us > 0          # one warm-up round, then one per repeat
