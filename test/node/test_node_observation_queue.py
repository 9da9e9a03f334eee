"""The node's observation queue (flashrt_ros/observation_queue.py) against a naive model: two FIFO lanes under one
byte budget, groups that end at a generating or snapshotting observation, and the three overload policies.
Every observation put is, at every moment, exactly one of: queued, taken (in arrival order per lane), dropped."""
import threading

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from flashrt_ros.observation_queue import (BLOCK, DROP_OLDEST, OVERLOAD_POLICIES, REFUSE_NEW, ObservationQueue,
                                           observation_bytes)
from flashrt_ros.session import PRIORITY_NORMAL, PRIORITY_URGENT, ObservationInput


def obs(i: int, size: int = 4, urgent: bool = False, generate: int = 0, label: str = "") -> ObservationInput:
    return ObservationInput(text="x" * size, max_new_tokens=generate, snapshot_label=label, stamp_ns=i,
                            priority=PRIORITY_URGENT if urgent else PRIORITY_NORMAL)


def test_size_counts_text_ids_values_and_label():
    assert observation_bytes(ObservationInput(text="héllo", token_ids=[1, 2], values=[0.5], snapshot_label="ab")) \
        == 6 + 4 * 3 + 2
    assert observation_bytes(ObservationInput(max_new_tokens=3)) == 1  # a bare "generate now" still takes room


def test_groups_end_at_a_generating_or_snapshotting_observation_and_at_max_group_bytes():
    q = ObservationQueue(1000, max_group_bytes=12)
    for o in (obs(1), obs(2), obs(3, generate=5), obs(4), obs(5, label="L"), obs(6), obs(7), obs(8, size=5),
              obs(9, size=20)):
        assert q.put(o) == []
    stamps = lambda group: [o.stamp_ns for o in group]  # noqa: E731
    assert stamps(q.take(urgent=False)) == [1, 2, 3]
    assert stamps(q.take(urgent=False)) == [4, 5]
    assert stamps(q.take(urgent=False)) == [6, 7]       # 5 more bytes would pass max_group_bytes
    assert stamps(q.take(urgent=False)) == [8]
    assert stamps(q.take(urgent=False)) == [9]          # larger than a group alone: still taken, alone
    assert q.take(urgent=False) == [] and len(q) == 0


def test_an_urgent_observation_is_not_queued_behind_normal_ones():
    q = ObservationQueue(1000)
    q.put(obs(1))
    q.put(obs(2))
    q.put(obs(3, urgent=True))
    assert [o.stamp_ns for o in q.take(urgent=True)] == [3]
    assert [o.stamp_ns for o in q.take(urgent=False)] == [1, 2]


@pytest.mark.parametrize("policy", OVERLOAD_POLICIES)
def test_nothing_is_dropped_below_the_budget_and_one_too_large_is_refused_by_every_policy(policy):
    q = ObservationQueue(12, policy)
    assert q.put(obs(1)) == [] and q.put(obs(2)) == [] and q.put(obs(3)) == []  # exactly 12 bytes
    [dropped] = q.put(obs(4, size=13))
    assert dropped.observation.stamp_ns == 4 and "exceeds the whole queue budget" in dropped.reason
    assert q.stats()["observations_dropped"] == 1 and len(q) == 3


def test_drop_oldest_drops_the_oldest_of_its_lane_first_and_refuse_new_the_new_one():
    q = ObservationQueue(12, DROP_OLDEST)
    for o in (obs(1), obs(2, urgent=True), obs(3)):
        q.put(o)
    assert [d.observation.stamp_ns for d in q.put(obs(4, size=8))] == [1, 3]  # normal lane first, oldest first
    assert [d.observation.stamp_ns for d in q.put(obs(5, size=4, urgent=True))] == [2]
    q = ObservationQueue(8, REFUSE_NEW)
    q.put(obs(1))
    q.put(obs(2))
    [refused] = q.put(obs(3))
    assert refused.observation.stamp_ns == 3 and "refuse_new" in refused.reason
    assert [o.stamp_ns for o in q.take(urgent=False)] == [1, 2]


def test_block_waits_for_room_and_drops_nothing():
    q = ObservationQueue(8, BLOCK)
    q.put(obs(1))
    q.put(obs(2))
    done = threading.Event()
    result = []
    producer = threading.Thread(target=lambda: (result.append(q.put(obs(3))), done.set()))
    producer.start()
    assert not done.wait(0.2)           # full: the producer waits
    assert [o.stamp_ns for o in q.take(urgent=False)] == [1, 2]
    assert done.wait(5.0) and result == [[]]
    assert [o.stamp_ns for o in q.take(urgent=False)] == [3]
    producer.join()


def test_close_wakes_a_blocked_producer_and_returns_everything_queued():
    q = ObservationQueue(4, BLOCK)
    q.put(obs(1))
    result = []
    producer = threading.Thread(target=lambda: result.append(q.put(obs(2))))
    producer.start()
    left = q.close()
    producer.join(5.0)
    assert not producer.is_alive()
    assert [d.observation.stamp_ns for d in left] + [d.observation.stamp_ns for d in result[0]] == [1, 2]
    assert q.stats()["observations_dropped"] == 2


class QueueModel(RuleBasedStateMachine):
    """ObservationQueue (drop_oldest / refuse_new) against lists: every observation accounted for."""

    def __init__(self):
        super().__init__()
        self.policy = None
        self.lanes = {True: [], False: []}
        self.put_stamps, self.taken, self.dropped = [], [], []
        self.next = 0

    @precondition(lambda self: self.policy is None)
    @rule(policy=st.sampled_from([DROP_OLDEST, REFUSE_NEW]), budget=st.integers(1, 40), group=st.integers(1, 20))
    def start(self, policy, budget, group):
        self.policy, self.budget = policy, budget
        self.queue = ObservationQueue(budget, policy, group)

    @precondition(lambda self: self.policy is not None)
    @rule(size=st.integers(1, 12), urgent=st.booleans(), generate=st.booleans())
    def put(self, size, urgent, generate):
        self.next += 1
        o = obs(self.next, size, urgent, generate=int(generate))
        self.put_stamps.append(self.next)
        expected = []
        if size > self.budget:
            expected = [o]
        else:
            used = sum(x.text.__len__() for lane in self.lanes.values() for x in lane)
            if used + size > self.budget and self.policy == REFUSE_NEW:
                expected = [o]
            else:
                while used + size > self.budget:
                    lane = self.lanes[urgent] or self.lanes[not urgent]
                    old = lane.pop(0)
                    used -= len(old.text)
                    expected.append(old)
                self.lanes[urgent].append(o)
        got = self.queue.put(o)
        assert [d.observation for d in got] == expected
        self.dropped += [d.observation.stamp_ns for d in got]

    @precondition(lambda self: self.policy is not None)
    @rule(urgent=st.booleans())
    def take(self, urgent):
        group = self.queue.take(urgent)
        lane = self.lanes[urgent]
        assert group == lane[:len(group)]
        assert bool(group) == bool(lane)
        ends = [i for i, o in enumerate(group) if o.max_new_tokens]
        assert not ends or ends == [len(group) - 1]  # only the last may generate
        if len(group) > 1:
            assert sum(len(o.text) for o in group) <= self.queue.max_group_bytes
        if group and not group[-1].max_new_tokens and len(group) < len(lane):  # stopped early: the next didn't fit
            assert sum(len(o.text) for o in lane[:len(group) + 1]) > self.queue.max_group_bytes
        del lane[:len(group)]
        self.taken += [o.stamp_ns for o in group]

    @invariant()
    def accounted(self):
        if self.policy is None:
            return
        queued = [o.stamp_ns for lane in self.lanes.values() for o in lane]
        assert sorted(queued + self.taken + self.dropped) == self.put_stamps
        stats = self.queue.stats()
        assert stats["observations_queued"] == len(queued) and stats["observations_dropped"] == len(self.dropped)
        assert stats["observation_queue_bytes"] == sum(len(o.text) for lane in self.lanes.values() for o in lane)
        assert stats["observation_queue_bytes"] <= self.budget


QueueModel.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestQueueModel = QueueModel.TestCase
