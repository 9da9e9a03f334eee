"""Constrained Generate goals on a Session (tiny engine, random weights): json_schema / grammar / output_type,
the typed message, refusals that change nothing, incomplete outputs, preemption and resume mid-constraint."""
import json

import jsonschema
import pytest
from geometry_msgs.msg import Twist

from flashrt_ros import ros_schema
from flashrt_ros.runtime import Engine, EngineConfig, ErrorCode, FlashRTError
from flashrt_ros.session import PRIORITY_URGENT, EventOutput, ObservationInput, TypedOutput
from test_session import make_session, run, state

TWIST = "geometry_msgs/msg/Twist"
SCHEMA = json.dumps({"type": "object", "properties": {"skill": {"enum": ["grasp", "place", "wave"]},
                                                      "count": {"type": "integer", "minimum": 0, "maximum": 9}},
                     "required": ["skill", "count"], "additionalProperties": False})


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(model="tiny", max_context=1024, capsule_budget_bytes=2 << 20))


@pytest.fixture
def outputs():
    return []


@pytest.fixture
def session(engine, outputs):
    return make_session(engine, outputs, chunk=8)


def test_output_type_twist_ends_with_a_typed_message_equal_to_the_text(session, outputs):
    result = run(session.generate(ObservationInput(text="go", max_new_tokens=400), output_type=TWIST))
    assert result.finish_reason == "stop", result.message
    (typed,) = [o for o in outputs if isinstance(o, TypedOutput)]
    assert typed.type_name == TWIST and typed.text == result.text and isinstance(typed.message, Twist)
    value = json.loads(result.text)
    jsonschema.validate(value, json.loads(ros_schema.schema_for(TWIST)))
    assert typed.message.linear.x == float(value["linear"]["x"])
    assert typed.message.angular.z == float(value["angular"]["z"])
    (event,) = [o for o in outputs if isinstance(o, EventOutput)]
    assert event.op == "generate" and event.output_type == TWIST      # what a bag replays


def test_json_schema_and_grammar_goals_constrain_the_text(session):
    result = run(session.generate(ObservationInput(text="pick", max_new_tokens=200), json_schema=SCHEMA))
    jsonschema.validate(json.loads(result.text), json.loads(SCHEMA))
    result = run(session.generate(ObservationInput(text="yes?", max_new_tokens=20), grammar='root ::= "yes" | "no"'))
    assert result.text in ("yes", "no") and result.finish_reason == "stop"


def test_max_new_tokens_before_the_grammar_completes_is_incomplete(session):
    result = run(session.generate(ObservationInput(text="go", max_new_tokens=10), output_type=TWIST))
    assert result.finish_reason == "incomplete" and "not valid JSON" in result.message
    with pytest.raises(ValueError):
        json.loads(result.text)


def test_the_next_unconstrained_goal_is_free_again(session, engine):
    run(session.generate(ObservationInput(text="yes?", max_new_tokens=20), grammar='root ::= "yes"'))
    free = run(session.generate(ObservationInput(text="", token_ids=[1], max_new_tokens=30)))
    assert engine.constraint is None and free.text not in ("", "yes")


@pytest.mark.parametrize("fields, says", [
    ({"output_type": "geometry_msgs/msg/Nope"}, "cannot import"),
    ({"output_type": "not a type"}, "not a message type name"),
    ({"output_type": "geometry_msgs/srv/Twist"}, "not a message type name"),
    ({"json_schema": '{"type": "objectx"}'}, "objectx"),
    ({"json_schema": "{not json"}, "bad json_schema"),
    ({"grammar": "start: foo("}, "Expected"),
    ({"json_schema": SCHEMA, "grammar": 'root ::= "a"'}, "at most one"),
])
def test_a_bad_constraint_is_invalid_argument_and_changes_nothing(session, engine, outputs, fields, says):
    running = session.generate(ObservationInput(text="count", max_new_tokens=50))
    running.step()
    before = state(engine)
    with pytest.raises(FlashRTError) as err:
        session.generate(ObservationInput(text="go", max_new_tokens=40), **fields)
    assert err.value.code == ErrorCode.INVALID_ARGUMENT and says in err.value.message
    assert state(engine) == before and session.active is running and not running.finished
    event = [o for o in outputs if isinstance(o, EventOutput)][-1]
    assert not event.success and event.error_code == ErrorCode.INVALID_ARGUMENT


def test_preempted_constrained_goal_resumes_to_the_uninterrupted_output(session, engine, outputs):
    goal = ObservationInput(text="go", max_new_tokens=400)
    session.generate(goal, reseed=True, seed=9, output_type=TWIST)
    whole = run(session.active)
    engine.reset()
    outputs.clear()
    first = session.generate(goal, reseed=True, seed=9, output_type=TWIST)
    for _ in range(20):
        first.step()
    urgent = session.observe(ObservationInput(text="free text now", max_new_tokens=12, priority=PRIORITY_URGENT))
    assert first.outcome.result().finish_reason == "preempted"
    urgent_text = run(urgent).text
    session.resume()
    resumed = run(session.active)
    assert first.outcome.result().token_ids + resumed.token_ids == whole.token_ids
    assert resumed.finish_reason == "stop"
    typed = [o for o in outputs if isinstance(o, TypedOutput)]
    assert [t.request_id for t in typed] == [resumed.request_id] and typed[0].text == whole.text
    with pytest.raises(ValueError):
        json.loads(urgent_text)                            # the urgent request ran unconstrained


# ---- observations that generate take the same constraint fields (msg/Observation.msg) ----------------------------

def test_an_observation_that_generates_is_constrained_and_typed_like_a_goal(session, outputs):
    """An Observation with max_new_tokens > 0 and output_type: the text is the type's JSON and the parsed message is
    emitted as a TypedOutput; its 'observe' event carries the observation with its output_type (what a bag
    replays). json_schema and grammar constrain the text the same way."""
    result = run(session.observe(ObservationInput(text="go", max_new_tokens=400, output_type=TWIST)))
    assert result.finish_reason == "stop", result.message
    (typed,) = [o for o in outputs if isinstance(o, TypedOutput)]
    assert typed.type_name == TWIST and typed.text == result.text and isinstance(typed.message, Twist)
    jsonschema.validate(json.loads(result.text), json.loads(ros_schema.schema_for(TWIST)))
    (event,) = [o for o in outputs if isinstance(o, EventOutput)]
    assert event.op == "observe" and event.observation.output_type == TWIST
    result = run(session.observe(ObservationInput(text="pick", max_new_tokens=200, json_schema=SCHEMA)))
    jsonschema.validate(json.loads(result.text), json.loads(SCHEMA))
    result = run(session.observe(ObservationInput(text="yes?", max_new_tokens=20, grammar='root ::= "yes" | "no"')))
    assert result.text in ("yes", "no") and result.finish_reason == "stop"


@pytest.mark.parametrize("observation, goal, says", [
    (ObservationInput(text="go", json_schema=SCHEMA), {}, "needs max_new_tokens > 0"),
    (ObservationInput(text="go", max_new_tokens=40, json_schema='{"type": "objectx"}'), {}, "objectx"),
    (ObservationInput(text="go", max_new_tokens=40, json_schema=SCHEMA, output_type=TWIST), {}, "at most one"),
    (ObservationInput(text="go", max_new_tokens=40, json_schema=SCHEMA), {"output_type": TWIST}, "not both"),
])
def test_a_bad_observation_constraint_is_invalid_argument_and_changes_nothing(session, engine, outputs, observation,
                                                                              goal, says):
    running = session.generate(ObservationInput(text="count", max_new_tokens=50))
    running.step()
    before = state(engine)
    with pytest.raises(FlashRTError) as err:
        session.generate(observation, **goal) if goal else session.observe(observation)
    assert err.value.code == ErrorCode.INVALID_ARGUMENT and says in err.value.message
    assert state(engine) == before and session.active is running and not running.finished
    event = [o for o in outputs if isinstance(o, EventOutput)][-1]
    assert not event.success and event.error_code == ErrorCode.INVALID_ARGUMENT


def test_the_last_observation_of_a_group_generates_under_its_constraint(session, engine, outputs):
    """A group's last observation may generate: its constraint applies after the group's one prefill; a
    constraint on an earlier one (which cannot generate) refuses that one alone."""
    group = [ObservationInput(text="a", stamp_ns=1), ObservationInput(text="b", stamp_ns=2, json_schema=SCHEMA),
             ObservationInput(text="c", stamp_ns=3, max_new_tokens=200, json_schema=SCHEMA)]
    result = run(session.observe_group(group))
    jsonschema.validate(json.loads(result.text), json.loads(SCHEMA))
    observed = [o for o in outputs if isinstance(o, EventOutput) and o.op == "observe"]
    assert [e.success for e in observed] == [True, False, True] and "max_new_tokens" in observed[1].message
