"""Session (the node's ROS-free core) on a real tiny Engine: outputs, events, preemption, validation."""
import pytest

from flashrt_ros.discretiser import Discretiser
from flashrt_ros.runtime import (INTERRUPTED_PREFIX, MAX_LABEL_BYTES, Engine, EngineConfig, ErrorCode, FlashRTError,
                                 SamplingParams)
from flashrt_ros.session import (PRIORITY_URGENT, ActionOutput, EventOutput, ObservationInput, Session,
                                 TokenOutput)

MAX_CONTEXT = 256
SAMPLED = SamplingParams(temperature=1.0)  # seeded sampling: varied tokens, reproducible from the arena RNG


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(model="tiny", max_context=MAX_CONTEXT, capsule_budget_bytes=512 << 10))


@pytest.fixture
def outputs():
    return []


def make_session(engine, outputs, discretiser=None, chunk=4):
    engine.reset()
    for info in engine.capsules():
        engine.drop(info.id)
    return Session(engine, discretiser=discretiser or Discretiser(bins=255, token_offset=257),
                   default_sampling=SAMPLED, emit=outputs.append, stream_chunk_tokens=chunk)


@pytest.fixture
def session(engine, outputs):
    return make_session(engine, outputs)


def of(outputs, kind):
    return [o for o in outputs if isinstance(o, kind)]


def run(gen):
    while gen.step():
        pass
    return gen.outcome.result()


def state(engine):
    """Everything a refused request must leave unchanged."""
    return engine.live_checksum(), engine.position, [(c.id, c.checksum) for c in engine.capsules()]


def test_observation_tokens_are_ids_then_text_then_values(engine, session, outputs):
    obs = ObservationInput(token_ids=[1, 2, 3], text="go", values=[-1.0, 0.0, 1.0])
    assert session.observe(obs) is None  # max_new_tokens == 0: ingest only
    observed = engine.live_checksum()
    expected = [1, 2, 3] + engine.tokenizer.encode("go") + session.discretiser.encode([-1.0, 0.0, 1.0])
    engine.reset()
    engine.ingest(expected)
    assert engine.live_checksum() == observed
    (event,) = of(outputs, EventOutput)
    assert (event.op, event.success, event.position_before, event.position_after) == ("observe", True, 0, len(expected))


def test_generation_streams_chunks_and_a_final_result(engine, session, outputs):
    gen = session.observe(ObservationInput(text="hello", max_new_tokens=10, stamp_ns=42))
    assert session.active is gen
    result = run(gen)
    assert session.active is None
    chunks = of(outputs, TokenOutput)
    assert [len(c.token_ids) for c in chunks] == [4, 4, 2]
    assert [c.final for c in chunks] == [False, False, True]
    assert chunks[-1].finish_reason == "length" == result.finish_reason
    assert [t for c in chunks for t in c.token_ids] == result.token_ids
    assert [c.position for c in chunks] == [9, 13, 15] and result.position == engine.position == 15
    assert all(c.request_id == gen.request_id and c.observation_stamp_ns == 42 for c in chunks)
    assert result.text == engine.tokenizer.decode(result.token_ids)
    assert result.error_code == ErrorCode.OK and result.ttft_ms > 0


def test_generation_ends_when_the_context_is_full(engine, session):
    session.observe(ObservationInput(token_ids=[7] * (MAX_CONTEXT - 3)))
    result = run(session.observe(ObservationInput(max_new_tokens=10)))  # continue without new input
    assert result.finish_reason == "context_full"
    assert len(result.token_ids) == 3 and engine.position == MAX_CONTEXT


def test_action_is_decoded_once_the_request_finishes(engine, outputs):
    d = Discretiser(low=0.0, high=1.0, bins=engine.vocab_size, token_offset=0, dims=2, horizon=3)
    session = make_session(engine, outputs, discretiser=d)
    result = run(session.observe(ObservationInput(text="act", max_new_tokens=8, stamp_ns=7)))
    (action,) = of(outputs, ActionOutput)
    assert outputs[-1] is action  # after the final TokenOutput
    assert action.token_ids == result.token_ids[:6]
    assert action.values == d.decode(result.token_ids[:6])
    assert (action.horizon, action.dims, action.observation_stamp_ns) == (3, 2, 7)

    outputs.clear()
    run(session.observe(ObservationInput(text="act", max_new_tokens=5)))  # 5 < 2 x 3 values
    assert not of(outputs, ActionOutput)


def test_preempted_then_resumed_stream_equals_an_uninterrupted_run(engine, session, outputs):
    obs = ObservationInput(text="Count the cups.", max_new_tokens=12)
    whole = run(session.observe(obs)).token_ids
    assert len(set(whole)) > 3  # a varied stream, so a wrong continuation cannot match by accident

    engine.reset()
    outputs.clear()
    first = session.observe(obs)
    for _ in range(5):
        first.step()
    urgent = session.observe(ObservationInput(text="Stop!", max_new_tokens=3, priority=PRIORITY_URGENT))
    interrupted = first.outcome.result()
    assert interrupted.finish_reason == "preempted" and interrupted.error_code == ErrorCode.PREEMPTED
    assert len(interrupted.token_ids) == 5
    capsule_id = f"interrupted-{first.request_id}"
    assert session.interrupted() == {capsule_id: 7}
    run(urgent)

    answer = session.resume()
    resumed_gen = session.active
    assert answer.request_id == resumed_gen.request_id not in (first.request_id, urgent.request_id)
    assert answer.remaining_tokens == resumed_gen.remaining == 7
    resumed = run(resumed_gen)
    assert interrupted.token_ids + resumed.token_ids == whole
    assert session.interrupted() == {}

    ops = [(e.op, e.result_id, e.request_id, e.running_request_id, e.success) for e in of(outputs, EventOutput)]
    assert ops == [("observe", "", first.request_id, 0, True), ("preempt", capsule_id, 0, first.request_id, True),
                   ("observe", "", urgent.request_id, first.request_id, True),
                   ("resume", capsule_id, resumed_gen.request_id, 0, True)]
    with pytest.raises(FlashRTError) as err:
        session.resume()  # a resume consumes its record
    assert err.value.code == ErrorCode.NOTHING_TO_RESUME


def test_resumed_request_completes_the_action_started_before_preemption(engine, outputs):
    d = Discretiser(low=0.0, high=1.0, bins=engine.vocab_size, token_offset=0, dims=3, horizon=2)
    session = make_session(engine, outputs, discretiser=d)
    first = session.observe(ObservationInput(text="act", max_new_tokens=6))
    for _ in range(4):
        first.step()
    assert session.observe(ObservationInput(text="!", priority=PRIORITY_URGENT)) is None  # ingest-only preempts too
    before = first.outcome.result().token_ids
    assert not of(outputs, ActionOutput)  # a preempted request owes its action
    session.resume()
    resumed = run(session.active)
    (action,) = of(outputs, ActionOutput)
    assert action.request_id == resumed.request_id
    assert action.token_ids == before + resumed.token_ids


def test_snapshot_between_steps_keeps_the_stream_token_identical(engine, session, outputs):
    obs = ObservationInput(text="hello", max_new_tokens=8)
    whole = run(session.observe(obs)).token_ids
    engine.reset()
    gen = session.observe(obs)
    for _ in range(3):
        gen.step()
    snap = session.snapshot("mid", "between two tokens")
    assert snap.position == engine.position
    assert run(gen).token_ids == whole
    assert engine.capsule("mid").position == snap.position


def test_restore_during_a_generation_cancels_it(engine, session):
    session.observe(ObservationInput(text="base"))
    session.snapshot("base")
    gen = session.observe(ObservationInput(text="more", max_new_tokens=20))
    gen.step()
    session.restore("base")
    result = gen.outcome.result()
    assert result.finish_reason == "canceled" and result.error_code == ErrorCode.CANCELED
    assert session.active is None and engine.position == engine.capsule("base").position


def test_each_state_operation_emits_exactly_one_event(engine, session, outputs):
    session.observe(ObservationInput(text="abc"))
    session.snapshot("a", "first")
    session.observe(ObservationInput(text="def"))
    session.fork("a", "b", "copy", switch_to=True)
    session.rollback(capsule_id="a")
    session.observe(ObservationInput(text="gh"))
    session.rollback(steps=1)
    session.drop("b")
    session.reset()
    events = of(outputs, EventOutput)
    assert [e.op for e in events] == ["observe", "snapshot", "observe", "fork", "rollback", "observe",
                                      "rollback", "drop", "reset"]
    assert [e.seq for e in events] == list(range(1, 10))
    assert all(e.success and e.error_code == 0 for e in events)
    fork, rollback_to, rollback_steps = events[3], events[4], events[6]
    assert (fork.capsule_id, fork.source_id, fork.label, fork.switch_to, fork.result_id) == ("b", "a", "copy", True, "b")
    assert (rollback_to.capsule_id, rollback_to.steps, rollback_to.position_after) == ("a", 0, 3)
    assert (rollback_steps.steps, rollback_steps.position_before, rollback_steps.position_after) == (1, 5, 3)
    assert events[-1].position_after == 0


def test_snapshot_without_id_gets_one_and_observation_label_takes_a_capsule(engine, session, outputs):
    session.observe(ObservationInput(text="abc", snapshot_label="after abc"))
    (info,) = engine.capsules()
    assert info.label == "after abc" and info.position == 3
    assert [(e.op, e.capsule_id, e.result_id) for e in of(outputs, EventOutput)] == [
        ("observe", "", ""), ("snapshot", "", info.id)]  # the request as made ("" = generated), then the id


def test_observation_label_asks_the_engine_for_room_at_the_position_after_ingestion(engine, session, monkeypatch):
    """The capsule-room check goes through the engine's public API, for the position the capsule will have."""
    asked = []
    check = engine.check_capsule_room
    monkeypatch.setattr(engine, "check_capsule_room",
                        lambda *positions, label: (asked.append((positions, label)), check(*positions, label=label)))
    session.observe(ObservationInput(text="ab"))
    session.observe(ObservationInput(text="cde", snapshot_label="labelled"))
    assert asked == [((5,), "labelled")] and engine.capsules()[0].position == 5


def test_urgent_labelled_observation_that_cannot_keep_both_capsules_changes_nothing(outputs):
    """Preempting keeps the interrupted stream as a capsule first; if that and the label capsule do not both fit,
    the observation is refused before the running generation is touched."""
    probe = Engine(EngineConfig(model="tiny", max_context=256))
    prompt, urgent = probe.tokenizer.encode("hello robot"), probe.tokenizer.encode("STOP")
    at = len(prompt) + 3
    # the label capsule shares the interrupted one's rows: it adds the fixed state and len(urgent) rows
    budget = probe.arena.live_nbytes(at) + probe.arena.live_nbytes(len(urgent)) - 1
    engine = Engine(EngineConfig(model="tiny", max_context=256, capsule_budget_bytes=budget))
    session = make_session(engine, outputs)
    running = session.observe(ObservationInput(token_ids=prompt, max_new_tokens=20))
    for _ in range(3):
        running.step()
    before = engine.live_checksum()
    with pytest.raises(FlashRTError) as refused:
        session.observe(ObservationInput(token_ids=urgent, max_new_tokens=8, priority=PRIORITY_URGENT,
                                         snapshot_label="after-stop"))
    assert refused.value.code == ErrorCode.BUDGET_EXCEEDED
    assert engine.live_checksum() == before and engine.position == at and engine.capsules() == []
    assert session.active is running and running.step()


def test_a_refused_generation_ends_with_one_error_chunk_after_its_event(engine, outputs):
    session = make_session(engine, outputs)
    session.observe(ObservationInput(text="base"))
    running = session.observe(ObservationInput(text="!", max_new_tokens=20))
    running.step()
    outputs.clear()
    with pytest.raises(FlashRTError):
        session.observe(ObservationInput(token_ids=[engine.vocab_size], max_new_tokens=4, stamp_ns=77))
    event, chunk = outputs
    assert isinstance(event, EventOutput) and not event.success and event.error_code == ErrorCode.TOKEN_OUT_OF_RANGE
    assert chunk == TokenOutput(running.request_id + 1, [], "", engine.position, True, "error", 77)
    assert session.active is running and not running.finished
    with pytest.raises(FlashRTError):  # nothing to generate: nobody waits, so no chunk
        session.observe(ObservationInput(token_ids=[-1], stamp_ns=78))
    assert len(outputs) == 3 and isinstance(outputs[2], EventOutput)
    running.stop("canceled")
    assert session.observe(ObservationInput(text="?", max_new_tokens=1)).request_id == running.request_id + 2


REFUSALS = [
    ("restore unknown", lambda s: s.restore("nope"), ErrorCode.UNKNOWN_CAPSULE),
    ("restore malformed", lambda s: s.restore("../etc"), ErrorCode.INVALID_CAPSULE_ID),
    ("snapshot duplicate", lambda s: s.snapshot("base"), ErrorCode.DUPLICATE_CAPSULE_ID),
    ("snapshot malformed", lambda s: s.snapshot("a b"), ErrorCode.INVALID_CAPSULE_ID),
    ("snapshot with a reserved id", lambda s: s.snapshot(f"{INTERRUPTED_PREFIX}7"), ErrorCode.INVALID_CAPSULE_ID),
    ("fork to a reserved id", lambda s: s.fork("base", f"{INTERRUPTED_PREFIX}7"), ErrorCode.INVALID_CAPSULE_ID),
    ("fork of live to a reserved id", lambda s: s.fork("", f"{INTERRUPTED_PREFIX}7"), ErrorCode.INVALID_CAPSULE_ID),
    ("snapshot label too long", lambda s: s.snapshot("l", "x" * (MAX_LABEL_BYTES + 1)), ErrorCode.INVALID_ARGUMENT),
    ("observation label too long", lambda s: s.observe(ObservationInput(token_ids=[1],
                                                                         snapshot_label="x" * (MAX_LABEL_BYTES + 1))),
     ErrorCode.INVALID_ARGUMENT),
    ("fork unknown source", lambda s: s.fork("nope", "x"), ErrorCode.UNKNOWN_CAPSULE),
    ("rollback both", lambda s: s.rollback("base", 1), ErrorCode.INVALID_ARGUMENT),
    ("rollback neither", lambda s: s.rollback(), ErrorCode.INVALID_ARGUMENT),
    ("rollback too far", lambda s: s.rollback(steps=1000), ErrorCode.NO_HISTORY),
    ("drop unknown", lambda s: s.drop("nope"), ErrorCode.UNKNOWN_CAPSULE),
    ("resume nothing", lambda s: s.resume(), ErrorCode.NOTHING_TO_RESUME),
    ("resume plain capsule", lambda s: s.resume("base"), ErrorCode.NOTHING_TO_RESUME),
    ("token out of range", lambda s: s.observe(ObservationInput(token_ids=[1, 9999])), ErrorCode.TOKEN_OUT_OF_RANGE),
    ("context overflow", lambda s: s.observe(ObservationInput(token_ids=[1] * MAX_CONTEXT)),
     ErrorCode.CONTEXT_OVERFLOW),
    ("empty observation", lambda s: s.observe(ObservationInput()), ErrorCode.INVALID_ARGUMENT),
    ("bad sampling", lambda s: s.generate(ObservationInput(text="x", max_new_tokens=2), True, 1.0, 0.0),
     ErrorCode.INVALID_ARGUMENT),
    ("temperature below the minimum", lambda s: s.generate(ObservationInput(text="x", max_new_tokens=2), True,
                                                           1.4e-45), ErrorCode.INVALID_ARGUMENT),
    ("goal without tokens to generate", lambda s: s.generate(ObservationInput(text="x")), ErrorCode.INVALID_ARGUMENT),
    ("goal with a bad seed", lambda s: s.generate(ObservationInput(text="x", max_new_tokens=2), reseed=True,
                                                  seed=2**63), ErrorCode.INVALID_ARGUMENT),
    ("cancel of another request", lambda s: s.cancel(999), ErrorCode.INVALID_ARGUMENT),
    ("nan value", lambda s: s.observe(ObservationInput(values=[float("nan")])), ErrorCode.INVALID_ARGUMENT),
    ("capsule over budget", lambda s: s.observe(ObservationInput(token_ids=[1] * 200, snapshot_label="big")),
     ErrorCode.BUDGET_EXCEEDED),
]


@pytest.mark.parametrize("name,request_fn,code", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refused_request_changes_nothing_and_reports_one_event(engine, outputs, name, request_fn, code):
    session = make_session(engine, outputs)
    session.observe(ObservationInput(text="the base"))
    session.snapshot("base")
    if code == ErrorCode.BUDGET_EXCEEDED:
        for i in range(100):  # fill the budget until a 200-token capsule cannot fit
            try:
                session.snapshot(f"fill{i}")
            except FlashRTError:
                break
    gen = session.observe(ObservationInput(text="!", max_new_tokens=50))
    gen.step()
    before, seq = state(engine), len(of(outputs, EventOutput))
    with pytest.raises(FlashRTError) as err:
        request_fn(session)
    assert err.value.code == code
    assert state(engine) == before
    assert session.active is gen and not gen.finished  # not even the running generation noticed
    (event,) = of(outputs, EventOutput)[seq:]
    assert not event.success and event.error_code == code and event.message


def test_a_client_cannot_take_the_id_a_preempted_stream_will_need(engine, session, outputs):
    """interrupted-<n> is the node's: refused for a client, so request n, once preempted, is still resumable."""
    first = session.observe(ObservationInput(text="go", max_new_tokens=8))
    with pytest.raises(FlashRTError) as err:
        session.snapshot(f"{INTERRUPTED_PREFIX}{first.request_id}")
    assert err.value.code == ErrorCode.INVALID_CAPSULE_ID and "reserved" in err.value.message
    first.step()
    session.observe(ObservationInput(text="!", priority=PRIORITY_URGENT))
    assert session.interrupted() == {f"{INTERRUPTED_PREFIX}{first.request_id}": first.remaining}
    assert session.resume().request_id > first.request_id


def test_refused_request_reports_the_live_position_it_left(engine, session):
    session.observe(ObservationInput(text="abc"))
    with pytest.raises(FlashRTError) as err:
        session.rollback(steps=99)
    assert err.value.position == engine.position == 3


def test_a_generate_goal_event_carries_its_observation_and_sampling(engine, session, outputs):
    obs = ObservationInput(text="plan", max_new_tokens=3, stamp_ns=5)
    run(session.generate(obs, override_sampling=True, temperature=0.5, top_p=0.9, top_k=7, reseed=True, seed=11))
    (event,) = of(outputs, EventOutput)
    assert event.op == "generate" and event.observation == obs and event.request_id == 1
    assert (event.override_sampling, event.temperature, event.top_p, event.top_k, event.reseed, event.seed) == (
        True, 0.5, 0.9, 7, True, 11)


def test_cancel_is_an_event_at_its_token_boundary(engine, session, outputs):
    gen = session.observe(ObservationInput(text="go", max_new_tokens=20))
    for _ in range(3):
        gen.step()
    session.cancel(gen.request_id)
    assert gen.outcome.result().finish_reason == "canceled" and session.active is None
    event = of(outputs, EventOutput)[-1]
    assert (event.op, event.request_id, event.running_request_id, event.position_before) == (
        "cancel", gen.request_id, gen.request_id, 5)


def test_deactivate_cancels_refuses_everything_until_activate(engine, session, outputs):
    gen = session.observe(ObservationInput(text="go", max_new_tokens=20))
    gen.step()
    session.deactivate()
    assert gen.outcome.result().finish_reason == "canceled"
    before = state(engine)
    outputs.clear()
    with pytest.raises(FlashRTError) as err:
        session.observe(ObservationInput(text="x", max_new_tokens=2, stamp_ns=9))
    assert err.value.code == ErrorCode.NOT_ACTIVE
    event, chunk = outputs  # a topic observation while inactive is answered: refused event, then error chunk
    assert (event.op, event.success, event.error_code) == ("observe", False, ErrorCode.NOT_ACTIVE)
    assert chunk.final and chunk.finish_reason == "error" and chunk.observation_stamp_ns == 9
    for call in (lambda: session.snapshot(), session.list_capsules, lambda: session.rollback(steps=1)):
        with pytest.raises(FlashRTError) as err:
            call()
        assert err.value.code == ErrorCode.NOT_ACTIVE
    assert state(engine) == before
    session.activate()
    assert session.snapshot().capsule.position == engine.position
    ops = [e.op for e in of(outputs, EventOutput)]
    assert ops == ["observe", "snapshot", "rollback", "activate", "snapshot"]  # list leaves no event


def test_the_first_activation_of_a_fresh_session_leaves_no_event(engine, outputs):
    session = Session(engine, discretiser=Discretiser(bins=255, token_offset=257), emit=outputs.append,
                      active=False)
    session.activate()
    session.deactivate()
    session.activate()
    assert [e.op for e in of(outputs, EventOutput)] == ["deactivate", "activate"]


def test_steps_keep_their_value_end_to_end(engine, session, outputs):
    """Rollback.steps is uint32, and so is StateEvent.steps: 2**31 is recorded as 2**31."""
    from flashrt_ros import ros_convert as conv
    from flashrt_ros.msg import StateEvent
    from rclpy.serialization import deserialize_message, serialize_message

    session.observe(ObservationInput(text="abc"))
    with pytest.raises(FlashRTError):
        session.rollback(steps=2**31)
    event = of(outputs, EventOutput)[-1]
    msg = deserialize_message(serialize_message(conv.state_event(event, conv.ns_to_time(0))), StateEvent)
    assert msg.steps == 2**31 == event.steps


def _service_calls(session):
    """One successful call of each state-changing service operation, by op (the table's rows)."""
    return {
        "snapshot": lambda: session.snapshot(), "drop": lambda: session.drop("spare"),
        "restore": lambda: session.restore("base"), "rollback": lambda: session.rollback(steps=1),
        "reset": session.reset, "fork": lambda: session.fork("base", switch_to=True),
        "fork_live": lambda: session.fork(switch_to=True),
    }


@pytest.mark.parametrize("name", ["snapshot", "drop", "restore", "rollback", "reset", "fork", "fork_live"])
def test_a_running_generation_ends_exactly_when_the_table_says_the_operation_replaces_the_state(engine, outputs, name):
    from types import SimpleNamespace

    from flashrt_ros.operations import OPERATIONS

    session = make_session(engine, outputs)
    session.observe(ObservationInput(text="base"))
    session.snapshot("base")
    session.snapshot("spare")
    gen = session.observe(ObservationInput(text="!", max_new_tokens=30))
    gen.step()
    _service_calls(session)[name]()
    op = OPERATIONS["fork" if name.startswith("fork") else name]
    request = SimpleNamespace(switch_to=True, source_id="" if name == "fork_live" else "base")
    assert gen.finished == op.replaces(request)
    assert (gen.outcome.result().finish_reason == "canceled") if gen.finished else (session.active is gen)
