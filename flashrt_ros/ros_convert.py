"""Messages <-> Session dataclasses. Pure field copying; no behaviour lives here."""
from builtin_interfaces.msg import Time

from flashrt_ros.action import Generate
from flashrt_ros.msg import ActionChunk, CapsuleInfo, Observation, StateEvent, TokenChunk
from flashrt_ros.runtime import SamplingParams
from flashrt_ros.session import ActionOutput, EventOutput, ObservationInput, TokenOutput


def time_to_ns(stamp: Time) -> int:
    return stamp.sec * 1_000_000_000 + stamp.nanosec


def ns_to_time(ns: int) -> Time:
    return Time(sec=ns // 1_000_000_000, nanosec=ns % 1_000_000_000)


def observation_in(msg: Observation) -> ObservationInput:
    return ObservationInput(text=msg.text, token_ids=[int(t) for t in msg.token_ids],
                            values=[float(v) for v in msg.values], max_new_tokens=msg.max_new_tokens,
                            priority=msg.priority, snapshot_label=msg.snapshot_label,
                            stamp_ns=time_to_ns(msg.header.stamp))


def goal_sampling(goal: Generate.Goal) -> SamplingParams | None:
    """The goal's sampling override, or None for the node's sampling parameters."""
    if not goal.override_sampling:
        return None
    return SamplingParams(temperature=float(goal.temperature), top_k=int(goal.top_k), top_p=float(goal.top_p))


def capsule_msg(info) -> CapsuleInfo:
    created_ns = int(info.created * 1e9)
    return CapsuleInfo(id=info.id, parent=info.parent, label=info.label, position=info.position,
                       bytes=info.nbytes, tier=info.tier, checksum=info.checksum, created=ns_to_time(created_ns))


def token_chunk(out: TokenOutput, stamp: Time) -> TokenChunk:
    msg = TokenChunk(request_id=out.request_id, token_ids=out.token_ids, text=out.text, position=out.position,
                     final=out.final, finish_reason=out.finish_reason,
                     observation_stamp=ns_to_time(out.observation_stamp_ns))
    msg.header.stamp = stamp
    return msg


def action_chunk(out: ActionOutput, stamp: Time) -> ActionChunk:
    msg = ActionChunk(request_id=out.request_id, horizon=out.horizon, dims=out.dims, values=out.values,
                      token_ids=out.token_ids, observation_stamp=ns_to_time(out.observation_stamp_ns))
    msg.header.stamp = stamp
    return msg


def state_event(out: EventOutput, stamp: Time) -> StateEvent:
    msg = StateEvent(seq=out.seq, op=out.op, capsule_id=out.capsule_id, source_id=out.source_id, steps=out.steps,
                     switch_to=out.switch_to, position_before=out.position_before,
                     position_after=out.position_after, latency_ms=out.latency_ms, success=out.success,
                     error_code=int(out.error_code), message=out.message)
    msg.header.stamp = stamp
    return msg
