"""The operations table is the single description of every operation: check that node, Session, interfaces
and events agree with it, so a drift between any two of them fails here."""
import dataclasses
import inspect

import pytest

from flashrt_ros.msg import StateEvent
from flashrt_ros.operations import CONSTRAINT_FIELDS, OPERATIONS, READ_ONLY, SAMPLING_FIELDS, resolve_type, services
from flashrt_ros.session import EventOutput, Session

OPS = list(OPERATIONS.values())


@pytest.mark.parametrize("op", [o for o in OPS if o.method], ids=lambda o: o.op)
def test_session_method_takes_exactly_the_request_fields(op):
    params = [p for p in inspect.signature(getattr(Session, op.method)).parameters if p != "self"]
    assert params == list(op.fields)


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.op)
def test_the_event_carries_every_request_field(op):
    event_fields = {f.name for f in dataclasses.fields(EventOutput)}
    assert set(op.fields) <= event_fields
    assert set(op.fields) <= set(StateEvent.get_fields_and_field_types())


@pytest.mark.parametrize("op", services(), ids=lambda o: o.op)
def test_service_request_and_response_match_the_table(op):
    srv = resolve_type(op.ros_type)
    assert set(op.fields) <= set(srv.Request.get_fields_and_field_types())
    response = srv.Response.get_fields_and_field_types()
    assert {"success", "message"} <= set(response)
    if op.op != "reset":  # std_srvs/Trigger: the code goes into the message
        assert "error_code" in response
        assert {f.name for f in dataclasses.fields(op.result)} <= set(response)


def test_generate_event_fields_are_the_goal_fields():
    goal = resolve_type("flashrt_ros/action/Generate").Goal.get_fields_and_field_types()
    assert set(OPERATIONS["generate"].fields) == {"observation", *SAMPLING_FIELDS, *CONSTRAINT_FIELDS} == set(goal)


def test_every_state_changing_operation_leaves_an_event():
    """Only reads leave none; every other row is replayable from its event."""
    assert READ_ONLY == {"list"}
    assert all(o.kind in ("service", "action", "topic", "lifecycle", "parameter", "consequence") for o in OPS)


def test_steps_is_the_same_type_in_the_request_and_the_event():
    rollback = resolve_type("flashrt_ros/srv/Rollback").Request.get_fields_and_field_types()
    assert rollback["steps"] == StateEvent.get_fields_and_field_types()["steps"] == "uint32"
