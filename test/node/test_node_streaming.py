"""Streaming through the flashrt node: ~/observation -> ~/tokens and ~/action, the ~/generate action
(feedback, cancel), urgent preemption of a goal and a token-identical resume."""
import contextlib
import threading

import pytest
from action_msgs.msg import GoalStatus
from conftest import wait_for
from std_srvs.srv import Trigger

from flashrt_ros.action import Generate
from flashrt_ros.discretiser import Discretiser
from flashrt_ros.msg import ActionChunk, ErrorCode, Observation, StateEvent, TokenChunk
from flashrt_ros.srv import DropCapsule, ListCapsules, Restore, Resume, Snapshot

# Every token is an action token here, so any generated stream of >= 4 tokens carries an action chunk.
NODE_PARAMS = {"discretiser.token_offset": 0, "discretiser.bins": 512, "discretiser.low": 0.0,
               "discretiser.high": 1.0, "discretiser.dims": 2, "discretiser.horizon": 2}
DISCRETISER = Discretiser(low=0.0, high=1.0, bins=512, token_offset=0, dims=2, horizon=2)


class Streams:
    """The node's output topics as seen by the client, plus an observation publisher."""

    def __init__(self, node, client):
        self.client = client
        self.tokens = client.subscribe(TokenChunk, "tokens")
        self.actions = client.subscribe(ActionChunk, "action")
        self.events = client.subscribe(StateEvent, "events")
        self.observations = client.publisher(Observation, "observation")
        self.generate = client.action_client(Generate, "generate")
        name = node.get_fully_qualified_name()
        for topic in ("tokens", "action", "events"):
            wait_for(lambda: node.count_subscribers(f"{name}/{topic}") > 0, what=f"{topic} subscription")
        wait_for(lambda: self.observations.get_subscription_count() > 0, what="observation subscription")

    def publish(self, text, max_new_tokens, priority=Observation.PRIORITY_NORMAL, stamp_sec=0):
        msg = Observation(text=text, max_new_tokens=max_new_tokens, priority=priority)
        msg.header.stamp.sec = stamp_sec
        self.observations.publish(msg)

    def stream(self, request_id=None, stamp_sec=None):
        """Token ids and final chunk of one request (by id or by its observation's stamp), once final."""
        def chunks():
            return [c for c in self.tokens if (request_id is None or c.request_id == request_id)
                    and (stamp_sec is None or c.observation_stamp.sec == stamp_sec)]
        wait_for(lambda: any(c.final for c in chunks()), timeout=60.0, what="a final chunk")
        found = chunks()
        return [t for c in found for t in c.token_ids], found[-1]

    def goal(self, text, max_new_tokens, **fields):
        goal = Generate.Goal(**fields)
        goal.observation.text, goal.observation.max_new_tokens = text, max_new_tokens
        feedback = []
        return self.client.send_goal(self.generate, goal, feedback), feedback


@contextlib.contextmanager
def engine_held(node):
    """Keep the engine thread busy at a token boundary for the duration of the block."""
    release = threading.Event()
    held = node.worker.submit(lambda s: release.wait(60))
    try:
        yield
    finally:
        release.set()
    assert held.result(10)


@pytest.fixture(scope="module")
def streams(node_and_client):
    return Streams(*node_and_client)


@pytest.fixture
def fresh(node_and_client, streams):
    node, client = node_and_client
    assert client.call(Trigger, "reset").success
    for capsule in client.call(ListCapsules, "list_capsules").capsules:
        assert client.call(DropCapsule, "drop_capsule", capsule_id=capsule.id).success
    for received in (streams.tokens, streams.actions, streams.events):
        received.clear()
    return client, streams


def test_observation_streams_token_chunks_and_an_action_chunk(fresh):
    client, streams = fresh
    streams.publish("Pick up the cup.", 6, stamp_sec=11)
    ids, final = streams.stream(stamp_sec=11)
    chunks = [c for c in streams.tokens if c.request_id == final.request_id]
    assert [len(c.token_ids) for c in chunks] == [4, 2] and final.finish_reason == "length"
    assert final.position == 16 + 6 == client.call(ListCapsules, "list_capsules").live_position
    (action,) = wait_for(lambda: streams.actions, what="an action chunk")
    assert (action.request_id, action.horizon, action.dims) == (final.request_id, 2, 2)
    assert list(action.token_ids) == ids[:4] and action.observation_stamp.sec == 11
    assert list(action.values) == pytest.approx(DISCRETISER.decode(ids[:4]))
    (event,) = [e for e in streams.events if e.op == "observe"]
    assert event.success and (event.position_before, event.position_after) == (0, 16)


def test_normal_observations_queue_behind_the_running_generation(fresh):
    _, streams = fresh
    streams.publish("first", 8, stamp_sec=1)
    streams.publish("second", 3, stamp_sec=2)
    first_ids, first = streams.stream(stamp_sec=1)
    _, second = streams.stream(stamp_sec=2)
    assert first.finish_reason == "length" and len(first_ids) == 8  # not preempted by a normal observation
    assert second.position == first.position + len("second") + 3


def test_generate_goal_streams_feedback_and_returns_the_whole_result(fresh):
    client, streams = fresh
    handle, feedback = streams.goal("Hello robot.", 10)
    assert handle.accepted
    response = client.result(handle)
    result = response.result
    assert response.status == GoalStatus.STATUS_SUCCEEDED
    assert result.success and result.error_code == ErrorCode.OK and result.finish_reason == "length"
    assert [t for f in feedback for t in f.feedback.chunk.token_ids] == list(result.token_ids)
    assert feedback[-1].feedback.chunk.final and len(result.token_ids) == 10
    assert result.position == 12 + 10 and result.ttft_ms > 0 and result.text
    assert (result.tokens_per_step, result.acceptance_rate) == (1.0, 0.0)    # speculative_tokens 0: one per step


def test_generate_with_sampling_override_and_reseed_is_reproducible(fresh):
    client, streams = fresh
    sampled = dict(override_sampling=True, temperature=1.0, top_p=1.0, top_k=0, reseed=True, seed=5)
    client.call(Snapshot, "snapshot", capsule_id="empty")
    first = client.result(streams.goal("Go.", 8, **sampled)[0]).result
    assert client.call(Restore, "restore", capsule_id="empty").success
    again = client.result(streams.goal("Go.", 8, **sampled)[0]).result
    assert client.call(Restore, "restore", capsule_id="empty").success
    greedy = client.result(streams.goal("Go.", 8)[0]).result
    assert list(first.token_ids) == list(again.token_ids) != list(greedy.token_ids)


def test_cancel_stops_the_goal_at_the_next_token_boundary(node_and_client, fresh):
    node, _ = node_and_client
    client, streams = fresh
    handle, feedback = streams.goal("Tell a long story.", 400)
    wait_for(lambda: feedback, what="first feedback")
    # Hold the engine thread at a token boundary while the cancel travels, so that on a loaded machine
    # the greedy stream cannot reach its end-of-sequence token (~140 tokens in) before the cancel does.
    with engine_held(node):
        cancel = client.wait(handle.cancel_goal_async(), 10.0)
        assert len(cancel.goals_canceling) == 1
    response = client.result(handle)
    result = response.result
    assert response.status == GoalStatus.STATUS_CANCELED
    assert result.finish_reason == "canceled" and result.error_code == ErrorCode.CANCELED
    assert 4 <= len(result.token_ids) < 400
    assert result.position == client.call(ListCapsules, "list_capsules").live_position


def test_a_goal_canceled_while_it_waits_never_starts(node_and_client, fresh):
    """A normal-priority goal waits behind a running generation; canceled meanwhile, it must not ingest anything."""
    node, _ = node_and_client
    client, streams = fresh
    with engine_held(node):                                  # the goal queues behind the busy engine
        handle, feedback = streams.goal("never run", 8)
        cancel = client.wait(handle.cancel_goal_async(), 10.0)
        assert len(cancel.goals_canceling) == 1
    response = client.result(handle)
    assert response.status == GoalStatus.STATUS_CANCELED
    assert response.result.error_code == ErrorCode.CANCELED and response.result.token_ids.tolist() == []
    assert not feedback
    assert client.call(ListCapsules, "list_capsules").live_position == 0
    assert not [e for e in streams.events if e.op == "observe"]


def test_goals_beyond_the_limit_are_rejected_and_services_keep_answering(node_and_client, fresh):
    """Waiting goals hold executor threads; the node caps them so that other callbacks still find a free one."""
    from flashrt_ros.node import MAX_GOALS_IN_FLIGHT
    node, _ = node_and_client
    client, streams = fresh
    with engine_held(node):                                  # every goal now waits for the engine
        handles = [streams.goal(f"goal {i}", 2)[0] for i in range(MAX_GOALS_IN_FLIGHT)]
        assert all(h.accepted for h in handles)
        assert not streams.goal("one too many", 2)[0].accepted
        cancel = client.wait(handles[0].cancel_goal_async(), 5.0)      # needs a free thread while all wait
        assert len(cancel.goals_canceling) == 1
    assert client.result(handles[0]).status == GoalStatus.STATUS_CANCELED
    assert all(client.result(h).status == GoalStatus.STATUS_SUCCEEDED for h in handles[1:])
    again = streams.goal("room again", 2)[0]
    assert again.accepted
    assert client.result(again).status == GoalStatus.STATUS_SUCCEEDED    # ends here, not in the next test


@pytest.mark.parametrize("text,tokens,code", [("x" * 600, 4, ErrorCode.CONTEXT_OVERFLOW),
                                              ("fine", 0, ErrorCode.INVALID_ARGUMENT)])
def test_refused_goal_aborts_with_its_code_and_changes_nothing(fresh, text, tokens, code):
    client, streams = fresh
    handle, _ = streams.goal(text, tokens)
    response = client.result(handle)
    assert response.status == GoalStatus.STATUS_ABORTED
    assert not response.result.success and response.result.error_code == code and response.result.message
    assert client.call(ListCapsules, "list_capsules").live_position == 0


def test_urgent_observation_preempts_a_goal_and_resume_is_token_identical(fresh):
    client, streams = fresh
    streams.publish("Count the cups on the table.", 0)
    wait_for(lambda: [e for e in streams.events if e.op == "observe"], what="base observed")
    assert client.call(Snapshot, "snapshot", capsule_id="base").success
    whole = list(client.result(streams.goal(" One", 40)[0]).result.token_ids)
    assert len(set(whole)) > 5
    assert client.call(Restore, "restore", capsule_id="base").success

    handle, feedback = streams.goal(" One", 40)
    wait_for(lambda: feedback, what="first feedback")
    streams.publish("Stop!", 3, priority=Observation.PRIORITY_URGENT, stamp_sec=99)
    response = client.result(handle)
    interrupted = response.result
    assert response.status == GoalStatus.STATUS_ABORTED
    assert interrupted.finish_reason == "preempted" and interrupted.error_code == ErrorCode.PREEMPTED
    assert 0 < len(interrupted.token_ids) < 40
    urgent_ids, urgent = streams.stream(stamp_sec=99)
    # The urgent request continues from wherever the goal was interrupted (timing), so the tiny model's
    # random weights may end it early at an end-of-sequence token.
    assert (urgent.finish_reason, len(urgent_ids)) == ("length", 3) or urgent.finish_reason == "stop"

    resume = client.call(Resume, "resume")
    assert resume.success and resume.remaining_tokens == 40 - len(interrupted.token_ids)
    resumed_ids, resumed = streams.stream(request_id=resume.request_id)
    assert list(interrupted.token_ids) + resumed_ids == whole
    assert resumed.position == interrupted.position + len(resumed_ids)

    ops = [(e.op, e.result_id) for e in streams.events if e.op in ("preempt", "resume")]
    capsule = ops[0][1]
    assert capsule.startswith("interrupted-") and ops == [("preempt", capsule), ("resume", capsule)]
    again = client.call(Resume, "resume", capsule_id=capsule)
    assert not again.success and again.error_code == ErrorCode.NOTHING_TO_RESUME
