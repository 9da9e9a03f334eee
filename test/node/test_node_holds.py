"""EngineWorker holds (``~/hold``, live bag replay) on a real tiny Engine: they expire on wall time however often
the thread wakes, holds on requests that never run expire, and their number is bounded."""
import threading
import time

import pytest

from flashrt_ros.discretiser import Discretiser
from flashrt_ros.engine_worker import EngineWorker
from flashrt_ros.runtime import Engine, EngineConfig, ErrorCode, FlashRTError
from flashrt_ros.session import ObservationInput, Session

HOLD_TIMEOUT_S = 0.3
DIAGNOSTICS_PERIOD_S = 0.01  # far more often than the hold timeout: each wakes the engine thread


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(model="tiny", max_context=256, capsule_budget_bytes=256 << 10))


@pytest.fixture
def worker(engine):
    engine.reset()
    session = Session(engine, discretiser=Discretiser(bins=255, token_offset=257), emit=lambda _: None)
    worker = EngineWorker(session, hold_timeout_s=HOLD_TIMEOUT_S, max_holds=100)
    stop = threading.Event()

    def diagnostics():  # as the node's /diagnostics timer does: a passive read, over and over
        while not stop.wait(DIAGNOSTICS_PERIOD_S):
            worker.submit(Session.diagnostics, passive=True)

    thread = threading.Thread(target=diagnostics, daemon=True)
    thread.start()
    yield worker
    stop.set()
    thread.join()
    worker.shutdown()


def test_a_hold_nobody_serves_expires_on_wall_time_while_diagnostics_wake_the_thread(worker):
    worker.hold([(1, 8)])  # request 1 will stop at position 8 (its prompt is 4 tokens)
    start = time.monotonic()
    gen = worker.submit(lambda s: s.observe(ObservationInput(token_ids=[1, 2, 3, 4], max_new_tokens=16))).result(10)
    outcome = gen.outcome.result(timeout=10 * HOLD_TIMEOUT_S + 5)  # the old worker held it forever
    assert outcome.finish_reason == "length" and len(outcome.token_ids) == 16
    assert time.monotonic() - start >= HOLD_TIMEOUT_S  # it did wait at the hold first
    assert worker.hold_count == 0


def test_holds_on_requests_that_never_run_expire_once_the_thread_is_idle(worker):
    worker.hold([(10**12, 1), (10**12, 2), (7, 3)])  # request ids the idle node will not reach
    assert worker.hold_count == 3
    deadline = time.monotonic() + 10 * HOLD_TIMEOUT_S + 5
    while worker.hold_count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker.hold_count == 0
    gen = worker.submit(lambda s: s.observe(ObservationInput(token_ids=[1], max_new_tokens=4))).result(10)
    assert gen.outcome.result(timeout=10).finish_reason == "length"


def test_holds_of_an_ended_request_are_dropped_when_the_next_one_starts(worker):
    worker.hold([(1, 200)])  # request 1 ends long before position 200
    gen = worker.submit(lambda s: s.observe(ObservationInput(token_ids=[1], max_new_tokens=2))).result(10)
    assert gen.outcome.result(timeout=10).finish_reason == "length"
    worker.submit(lambda s: s.observe(ObservationInput(token_ids=[1], max_new_tokens=1))).result(10)
    assert worker.hold_count == 0


def test_holds_past_the_limit_are_refused_whole(worker):
    worker.hold((10**9, p) for p in range(60))
    with pytest.raises(FlashRTError) as refused:
        worker.hold((10**9 + 1, p) for p in range(41))
    assert refused.value.code == ErrorCode.BUDGET_EXCEEDED and "limit of 100" in refused.value.message
    assert worker.hold_count == 60  # none of the refused call's holds was kept
    worker.hold((10**9 + 1, p) for p in range(40))
    assert worker.hold_count == 100


def test_shutdown_closes_the_engine_once_its_thread_has_ended(engine, monkeypatch):
    """The node lets the engine go through EngineWorker.shutdown (cleanup, shutdown, destroy): the tiers must be closed
    there, so a spill file being written completes and a dropped capsule's file never comes back after a restart."""
    closed = []
    monkeypatch.setattr(engine, "close", lambda: closed.append(threading.current_thread().name))
    session = Session(engine, discretiser=Discretiser(bins=255, token_offset=257), emit=lambda _: None)
    worker = EngineWorker(session)
    worker.submit(lambda s: s.engine.ingest([1, 2, 3])).result(timeout=30)
    assert closed == []
    worker.shutdown()
    worker.shutdown()
    assert closed == [threading.current_thread().name]
