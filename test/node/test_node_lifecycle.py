"""Lifecycle of the flashrt node through its lifecycle services, /diagnostics, and parameter files."""
import time
from pathlib import Path

import pytest
import yaml
from action_msgs.msg import GoalStatus
from conftest import TINY_PARAMS, RosClient, running_node, wait_for
from diagnostic_msgs.msg import DiagnosticArray
from lifecycle_msgs.msg import State, Transition
from lifecycle_msgs.srv import ChangeState, GetState
from std_srvs.srv import Trigger

from flashrt_ros.action import Generate
from flashrt_ros.msg import ErrorCode, Observation, StateEvent, TokenChunk
from flashrt_ros.params import PARAMETERS, read_settings
from flashrt_ros.srv import ListCapsules, Snapshot

CONFIG = Path(__file__).resolve().parents[2] / "config"


def lifecycle_state(client) -> int:
    return client.call(GetState, "get_state").current_state.id


def transition(client, transition_id) -> bool:
    return client.call(ChangeState, "change_state", transition=Transition(id=transition_id)).success


def goal(text, max_new_tokens):
    g = Generate.Goal()
    g.observation.text, g.observation.max_new_tokens = text, max_new_tokens
    return g


def test_diagnostics_report_engine_figures(node_and_client):
    node, client = node_and_client
    arrays = client.subscribe(DiagnosticArray, "/diagnostics")
    client.call(Snapshot, "snapshot", capsule_id="diag")

    def ours():
        return [{kv.key: kv.value for kv in s.values} for a in arrays for s in a.status
                if s.name == f"{node.get_fully_qualified_name()}: engine"
                and any(kv.value == "1" for kv in s.values if kv.key == "capsule_count")]
    values = wait_for(ours, what="a diagnostics message after the snapshot")[-1]
    for key in ("ttft_ms", "decode_tokens_per_s", "arena_bytes", "capsule_bytes", "position", "last_error",
                "speculative_tokens", "acceptance_rate", "tokens_per_step"):
        assert key in values
    assert int(values["arena_bytes"]) > 0 and int(values["capsule_bytes"]) > 0 and values["active"] == "True"
    engine = node.worker.submit(lambda s: (s.engine.fingerprint, s.engine.kernel_name)).result(10)
    assert (values["fingerprint"], values["kernel"]) == engine  # what the bag tools read instead of loading the model


def test_deactivate_refuses_requests_and_reconfigure_starts_clean(node_and_client):
    node, client = node_and_client
    assert lifecycle_state(client) == State.PRIMARY_STATE_ACTIVE
    action = client.action_client(Generate, "generate")
    tokens = client.subscribe(TokenChunk, "tokens")
    events = client.subscribe(StateEvent, "events")
    long_goal = client.send_goal(action, goal("Hello robot.", 400), [])  # (no end-of-sequence in 400)
    wait_for(lambda: tokens, what="the goal's first chunk")

    assert transition(client, Transition.TRANSITION_DEACTIVATE)
    assert lifecycle_state(client) == State.PRIMARY_STATE_INACTIVE
    stopped = client.result(long_goal)  # a running generation ends cleanly at its next boundary
    assert stopped.status == GoalStatus.STATUS_ABORTED and stopped.result.finish_reason == "canceled"

    refused = client.call(Snapshot, "snapshot")
    assert not refused.success and refused.error_code == ErrorCode.NOT_ACTIVE
    reset = client.call(Trigger, "reset")
    assert not reset.success and reset.message.startswith("NOT_ACTIVE")
    late = client.result(client.send_goal(action, goal("hi", 2), []))
    assert late.status == GoalStatus.STATUS_ABORTED and late.result.error_code == ErrorCode.NOT_ACTIVE
    position = node.worker.submit(lambda s: s.engine.position).result(10)
    observations = client.publisher(Observation, "observation")
    wait_for(lambda: observations.get_subscription_count() > 0, what="observation subscription")
    observations.publish(Observation(text="ignored"))
    asking = Observation(text="answer me", max_new_tokens=2)
    asking.header.stamp.sec = 4242
    observations.publish(asking)  # while inactive: answered by a final error chunk and a refused event
    answer = wait_for(lambda: [t for t in tokens if t.observation_stamp.sec == 4242], what="the error chunk")
    assert answer[0].final and answer[0].finish_reason == "error" and answer[0].token_ids.tolist() == []
    assert node.worker.submit(lambda s: s.engine.position).result(10) == position
    def refused():
        found = [e for e in events if e.op == "observe" and not e.success]
        return found if len(found) >= 2 else None

    refusals = wait_for(refused, what="both refused events")
    assert [e.error_code for e in refusals] == [ErrorCode.NOT_ACTIVE] * 2
    assert refusals[1].observation.text == "answer me" and refusals[1].request_id == answer[0].request_id
    ops = [e.op for e in events]
    assert ops.index("deactivate") < ops.index("snapshot")  # the transition is an event, before what it refused

    assert transition(client, Transition.TRANSITION_CLEANUP)
    assert lifecycle_state(client) == State.PRIMARY_STATE_UNCONFIGURED and node.worker is None
    assert client.call(ListCapsules, "list_capsules").error_code == ErrorCode.NOT_ACTIVE

    assert transition(client, Transition.TRANSITION_CONFIGURE)
    assert transition(client, Transition.TRANSITION_ACTIVATE)
    listing = client.call(ListCapsules, "list_capsules")
    assert listing.success and listing.capsules == [] and listing.live_position == 0  # a new engine
    assert client.call(Snapshot, "snapshot").success


def test_autostart_false_waits_unconfigured_and_a_bad_model_fails_configure(ros_context):
    with running_node(ros_context, "/t_manual", **{**TINY_PARAMS, "autostart": False,
                                                  "model": "/nonexistent/model"}) as node:
        client = RosClient(ros_context, node.get_fully_qualified_name())
        try:
            assert lifecycle_state(client) == State.PRIMARY_STATE_UNCONFIGURED
            assert client.call(Snapshot, "snapshot").error_code == ErrorCode.NOT_ACTIVE
            assert not transition(client, Transition.TRANSITION_CONFIGURE)
            assert lifecycle_state(client) == State.PRIMARY_STATE_UNCONFIGURED and node.worker is None
        finally:
            client.close()


def flat_keys(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from flat_keys(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


@pytest.mark.parametrize("name", ["default.yaml", "thor.yaml"])
def test_parameter_files_set_only_declared_parameters(name):
    params = dict(flat_keys(yaml.safe_load((CONFIG / name).read_text())["/**"]["ros__parameters"]))
    declared = {p[0]: type(p[1]) for p in PARAMETERS}
    assert set(params) == set(declared)  # no typo is silently ignored, nothing left implicit
    assert all(type(v) is declared[k] for k, v in params.items())


@pytest.mark.parametrize("name", ["default.yaml", "thor.yaml"])
def test_parameter_file_reaches_the_node(ros_context, name):
    """The file is loaded by rcl (--params-file) into a node renamed as `ros2 launch ... node_name:=arm_llm`
    renames it; the engine is not built here."""
    params = dict(flat_keys(yaml.safe_load((CONFIG / name).read_text())["/**"]["ros__parameters"]))
    remap = ["-r", "__node:=arm_llm"]
    with running_node(ros_context, "/", cli_args=["--ros-args", *remap, "--params-file", str(CONFIG / name)],
                      autostart=False) as node:
        assert node.get_name() == "arm_llm"
        for key, value in params.items():
            if key != "autostart":
                assert node.get_parameter(key).value == value, key
        settings = read_settings(node)
    assert settings.engine.device == params["device"] and settings.engine.dtype == params["dtype"]
    assert settings.engine.capsule_budget_bytes == params["capsule_budget_mb"] << 20
    assert settings.discretiser.action_size == params["discretiser.horizon"] * params["discretiser.dims"]


def test_default_parameter_file_starts_an_active_node(ros_context):
    with running_node(ros_context, "/", cli_args=["--ros-args", "--params-file", str(CONFIG / "default.yaml")]) as node:
        client = RosClient(ros_context, node.get_fully_qualified_name())
        try:
            assert lifecycle_state(client) == State.PRIMARY_STATE_ACTIVE
            listing = client.call(ListCapsules, "list_capsules")
            assert listing.success and listing.budget_bytes == 64 << 20
        finally:
            client.close()


def test_a_request_that_times_out_is_withdrawn_and_never_runs(ros_context):
    import threading

    with running_node(ros_context, "/t_timeout", **{**TINY_PARAMS, "request_timeout_s": 0.2}) as node:
        client = RosClient(ros_context, node.get_fully_qualified_name())
        try:
            release = threading.Event()
            busy = node.worker.submit(lambda s: release.wait(30))  # hold the engine thread
            late = client.call(Snapshot, "snapshot", capsule_id="late")
            assert not late.success and late.error_code == ErrorCode.TIMEOUT and "withdrawn" in late.message
            release.set()
            busy.result(10)
            assert client.call(ListCapsules, "list_capsules").capsules == []
        finally:
            client.close()
