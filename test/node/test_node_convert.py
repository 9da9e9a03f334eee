"""ros_convert's times: any float a capsule file's ``created`` may hold, and any int ns, give a Time message that
survives the wire unchanged (int32 ``sec``), in range exactly and saturated outside it."""
import math

from builtin_interfaces.msg import Time
from hypothesis import given, strategies as st
from rclpy.serialization import deserialize_message, serialize_message

from flashrt_ros.ros_convert import TIME_MAX_NS, TIME_MIN_NS, capsule_msg, ns_to_time, seconds_to_time, time_to_ns
from flashrt_ros.runtime.capsule.capsule import CapsuleInfo

INT32 = (-(2**31), 2**31 - 1)


def on_the_wire(stamp: Time) -> Time:
    return deserialize_message(serialize_message(stamp), Time)


def valid(stamp: Time) -> bool:
    return INT32[0] <= stamp.sec <= INT32[1] and 0 <= stamp.nanosec < 1_000_000_000


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_any_created_time_becomes_a_time_that_survives_the_wire(created):
    info = CapsuleInfo(id="c", parent="", label="", position=0, nbytes=0, tier="device", checksum="", created=created)
    stamp = capsule_msg(info).created  # 1e20 and 1e308 raised OverflowError here, killing the node
    assert valid(stamp) and on_the_wire(stamp) == stamp
    ns = time_to_ns(stamp)
    if math.isnan(created):
        assert ns == 0
    elif created * 1e9 >= TIME_MAX_NS:
        assert ns == TIME_MAX_NS  # after 2038: the last instant a Time holds, not a negative sec
    elif created * 1e9 <= TIME_MIN_NS:
        assert ns == TIME_MIN_NS
    else:
        assert abs(ns - created * 1e9) <= max(1.0, abs(created) * 1e9 * 2**-50)


@given(st.integers(min_value=-(2**80), max_value=2**80))
def test_any_ns_is_saturated_to_the_time_range_and_exact_inside_it(ns):
    stamp = ns_to_time(ns)
    assert valid(stamp) and on_the_wire(stamp) == stamp
    assert time_to_ns(stamp) == min(max(ns, TIME_MIN_NS), TIME_MAX_NS)


def test_a_date_after_2038_keeps_a_positive_sec():
    year_2100 = 4_102_444_800.0
    assert seconds_to_time(year_2100).sec == INT32[1]
    assert on_the_wire(seconds_to_time(year_2100)).sec == INT32[1]


def test_an_observation_keeps_its_constraint_through_the_wire():
    """ObservationInput -> Observation -> CDR -> ObservationInput: every field, the constraint's included (what a
    StateEvent records and a bag replays)."""
    from flashrt_ros.msg import Observation
    from flashrt_ros.ros_convert import observation_in, observation_msg
    from flashrt_ros.session import ObservationInput

    for constraint in ({"json_schema": '{"type": "integer"}'}, {"grammar": 'root ::= "a"'},
                       {"output_type": "geometry_msgs/msg/Twist"}):
        obs = ObservationInput(text="go", token_ids=[1, 2], values=[0.5], max_new_tokens=9, snapshot_label="l",
                               stamp_ns=123, **constraint)
        wire = deserialize_message(serialize_message(observation_msg(obs)), Observation)
        assert observation_in(wire) == obs
