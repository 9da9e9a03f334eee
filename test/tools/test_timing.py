"""Kernel timings read their weights from device memory (``timing.cold_copies``) and take every copy in turn."""
import itertools
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


def test_weight_copies_are_the_weight_and_equal_clones_in_their_own_memory_as_many_as_its_bytes_ask(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(L2_cache_size=1000))
    data, scale = torch.arange(200, dtype=torch.uint8), torch.ones(25)       # 200 + 100 bytes: 2000 / 300 -> 7 copies
    copies = timing.weight_copies(torch.device("cuda", 0), (data, scale))
    assert len(copies) == timing.cold_copies(torch.device("cuda", 0), 300) == 7
    assert copies[0][0] is data and copies[0][1] is scale
    for copy in copies[1:]:
        assert all(torch.equal(c, t) and c.data_ptr() != t.data_ptr() for c, t in zip(copy, (data, scale)))
    assert timing.weight_copies(torch.device("cpu"), (data,)) == [(data,)]


def test_a_sweep_checks_each_candidate_reports_the_wrong_and_the_unrunnable_and_times_only_the_right():
    """A candidate whose launch raises (a tile the GPU has no shared memory for) is a row with its error, not the end
    of the sweep; a wrong one is not timed either."""
    def output(launch):
        if launch == (3,):
            raise RuntimeError("out of resource: shared memory, required: 262144\nmore detail")
        return torch.ones(4) * (2.0 if launch == (2,) else 1.0)
    timed, reported = [], []
    rows = timing.sweep_launches(torch.device("cpu"), (1,), [(2,), (3,), (1,), (4,)], output,
                                 lambda launch: [lambda: timed.append(launch)], 1, 1e-3, reported.append)
    assert [tuple(r["config"]) for r in rows] == [(1,), (2,), (3,), (4,)]       # the default once, first
    assert reported == rows                                                     # each row reported as it is made
    by_config = {tuple(r["config"]): r for r in rows}
    assert by_config[(2,)]["correct"] is False and by_config[(2,)]["error"] is None and by_config[(2,)]["us"] is None
    assert by_config[(3,)]["error"] == "RuntimeError: out of resource: shared memory, required: 262144"
    assert by_config[(3,)]["us"] is None and by_config[(1,)]["us"] > 0 and by_config[(4,)]["us"] > 0
    assert set(timed) == {(1,), (4,)}
    line = timing.fastest_line(rows)
    assert "fastest of 2" in line and "wrong: [(2,)]" in line and "could not run: [(3,)]" in line
    progress = [timing.sweep_row_line(r) for r in rows]
    assert progress[0].startswith("    (1,) (default): ") and progress[0].endswith(" us")
    assert progress[1:3] == ["    (2,): wrong",
                             "    (3,): could not run (RuntimeError: out of resource: shared memory, required: 262144)"]


def test_a_sweep_past_its_budget_tries_no_further_candidate_but_always_the_default(monkeypatch):
    """``budget_s``: a candidate is tried only while the sweep's seconds are within it; the default always is."""
    clock = itertools.count(0, 10)                   # each reading 10 s after the one before
    monkeypatch.setattr(timing.time, "monotonic", lambda: next(clock))
    rows = timing.sweep_launches(torch.device("cpu"), (1,), [(2,), (3,), (4,)], lambda launch: torch.ones(2),
                                 lambda launch: [lambda: None], 1, 1e-3, budget_s=15)
    assert [tuple(r["config"]) for r in rows] == [(1,), (2,)]    # read at 10 s: (2,) tried; at 20 s: stop
    clock = itertools.count(0, 10)
    assert [tuple(r["config"]) for r in timing.sweep_launches(
        torch.device("cpu"), (1,), [(2,)], lambda launch: torch.ones(2), lambda launch: [lambda: None], 1, 1e-3,
        budget_s=0)] == [(1,)]
