"""Session.observe_group: observations that queued up together are one prefill, each with its own event, and the
offline bag replay re-coalesces the recorded groups (a prefill of A+B is not byte-identical to A, then B)."""
import pytest

from flashrt_ros.bag.bagfile import Record
from flashrt_ros.bag.replay import advance, apply, to_message
from flashrt_ros.bag.script import build_script
from flashrt_ros.discretiser import Discretiser
from flashrt_ros.runtime import Engine, EngineConfig, ErrorCode
from flashrt_ros.session import PRIORITY_URGENT, EventOutput, ObservationInput, Session, TokenOutput

TEXTS = [f" obs {i}: x={i * 0.37:.3f};" for i in range(12)]


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(model="tiny", max_context=1024, capsule_budget_bytes=1 << 20))


def fresh(engine, outputs):
    engine.reset()
    for info in engine.capsules():
        engine.drop(info.id)
    return Session(engine, discretiser=Discretiser(bins=255, token_offset=257), emit=outputs.append)


def events(outputs):
    return [o for o in outputs if isinstance(o, EventOutput)]


def observations(texts, stamp0=1, **last):
    group = [ObservationInput(text=t, stamp_ns=stamp0 + i) for i, t in enumerate(texts)]
    for name, value in last.items():
        setattr(group[-1], name, value)
    return group


def test_a_group_is_one_prefill_with_an_event_per_observation_at_its_own_positions(engine):
    outputs = []
    session = fresh(engine, outputs)
    session.observe_group(observations(TEXTS))
    grouped = engine.live_checksum()
    spans = [len(engine.tokenizer.encode(t)) for t in TEXTS]
    got = events(outputs)
    assert [e.op for e in got] == ["observe"] * len(TEXTS) and all(e.success for e in got)
    assert [e.observation.text for e in got] == TEXTS and [e.observation.stamp_ns for e in got] == list(range(1, 13))
    assert [e.count for e in got] == list(range(len(TEXTS) - 1, -1, -1))
    assert [e.position_after - e.position_before for e in got] == spans
    assert [e.position_before for e in got[1:]] == [e.position_after for e in got[:-1]] and got[0].position_before == 0
    assert engine.position == sum(spans)
    # the same tokens as one plain prefill of the concatenation: byte-identical
    engine.reset()
    engine.ingest([t for text in TEXTS for t in engine.tokenizer.encode(text)])
    assert engine.live_checksum() == grouped


def test_a_refused_observation_is_left_out_as_it_would_be_alone(engine):
    outputs = []
    session = fresh(engine, outputs)
    group = observations(TEXTS[:3])
    group.insert(1, ObservationInput(token_ids=[10 ** 6], stamp_ns=99))  # out of the vocabulary
    session.observe_group(group)
    got = events(outputs)
    assert [e.success for e in got] == [True, False, True, True]
    assert got[1].error_code == ErrorCode.TOKEN_OUT_OF_RANGE
    assert got[1].position_before == got[1].position_after == got[0].position_after == got[2].position_before
    assert [e.count for e in got] == [3, 2, 1, 0]
    assert engine.position == sum(len(engine.tokenizer.encode(t)) for t in TEXTS[:3])


def test_the_last_observation_generates_from_and_snapshots_what_arrived_with_it(engine):
    outputs = []
    session = fresh(engine, outputs)
    gen = session.observe_group(observations(TEXTS[:3], max_new_tokens=3, snapshot_label="seen"))
    position = engine.position
    assert [e.op for e in events(outputs)] == ["observe"] * 3 + ["snapshot"]
    assert events(outputs)[2].request_id == gen.request_id and events(outputs)[0].request_id == 0
    [capsule] = engine.capsules()
    assert capsule.position == position and capsule.label == "seen"
    while gen.step():
        pass
    assert gen.outcome.result().finish_reason == "length"
    with pytest.raises(ValueError):
        session.observe_group(observations(TEXTS[:2], max_new_tokens=1)[::-1])


def test_an_urgent_group_preempts_the_running_generation_once(engine):
    outputs = []
    session = fresh(engine, outputs)
    gen = session.observe(ObservationInput(text="count:", max_new_tokens=20))
    gen.step()
    before = engine.position
    session.observe_group(observations(TEXTS[:2], priority=PRIORITY_URGENT))
    got = events(outputs)
    assert [e.op for e in got] == ["observe", "preempt", "observe", "observe"]
    assert (got[2].running_request_id, got[2].position_before) == (gen.request_id, before)
    assert got[3].running_request_id == 0
    assert gen.outcome.result().finish_reason == "preempted"
    assert session.active is None


def as_records(outputs):
    return [Record(*(lambda topic, msg: (topic, 0, msg))(*to_message(o))) for o in outputs
            if isinstance(o, (EventOutput, TokenOutput))]


def test_offline_replay_re_coalesces_the_recorded_groups_exactly(engine):
    """A session of single observations and groups, replayed from its events: same events, same state. Replaying
    the same observations one by one gives the same positions but not the same bytes, which is why the event
    records the group."""
    outputs = []
    session = fresh(engine, outputs)
    session.observe(ObservationInput(text=TEXTS[0], stamp_ns=1))
    session.observe_group(observations(TEXTS[1:6], stamp0=2))
    session.observe_group(observations(TEXTS[6:9], stamp0=7, max_new_tokens=4))
    while session.active.step():
        pass
    session.observe_group(observations(TEXTS[9:], stamp0=10))
    live = engine.live_checksum(), engine.position
    script = build_script(as_records(outputs))
    assert [1 + len(call.also) for call in script] == [1, 5, 3, 3]

    replayed = []
    session = fresh(engine, replayed)
    for call in script:
        advance(session, call)
        apply(session, call)
    while session.active is not None:
        session.active.step()
    assert (engine.live_checksum(), engine.position) == live
    strip = lambda outs: [{**vars(o), "latency_ms": 0} for o in outs]  # noqa: E731
    assert strip(events(replayed)) == strip(events(outputs))
    assert [o for o in replayed if isinstance(o, TokenOutput)] == [o for o in outputs if isinstance(o, TokenOutput)]

    session = fresh(engine, [])
    for text in TEXTS:
        session.observe(ObservationInput(text=text))
    assert engine.position == live[1] - 4  # the 4 generated tokens
