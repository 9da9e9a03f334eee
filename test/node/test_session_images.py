"""Observations with images through the Session (issue 32): items in the order token_ids, images, text, values;
events and positions count image tokens; a refused image refuses its observation alone and nothing else moves; a
group of observations with images is one prefill."""
import pytest
import torch

import hf_vision as hv
from flashrt_ros.discretiser import Discretiser
from flashrt_ros.runtime import Engine, EngineConfig, ErrorCode, FlashRTError
from flashrt_ros.runtime.config import PRESETS
from flashrt_ros.runtime.vision import ingest_length
from flashrt_ros.runtime.vision.prepared import PreparedImage
from flashrt_ros.session import EventOutput, ObservationInput, Session, TokenOutput

VISION = PRESETS["tiny-vl"].vision
CONFIG = EngineConfig(model="tiny-vl", max_context=256, capsule_budget_bytes=1 << 20, image_min_pixels=1)
DISCRETISER = Discretiser(bins=255, token_offset=257)
FRAME, SIDE = hv.image(4, 6, seed=1, vision=VISION), hv.image(2, 4, seed=2, vision=VISION)


@pytest.fixture(scope="module")
def engine():
    engine = Engine(CONFIG)
    engine.model.visual = hv.preset_tower(VISION)
    return engine


def fresh(engine, outputs):
    engine.reset()
    for info in engine.capsules():
        engine.drop(info.id)
    return Session(engine, discretiser=DISCRETISER, emit=outputs.append)


def events(outputs):
    return [o for o in outputs if isinstance(o, EventOutput)]


def items_of(engine, obs):
    """The order the contract gives: token ids, images, text, values."""
    return [*obs.token_ids, *obs.images, *engine.tokenizer.encode(obs.text), *DISCRETISER.encode(obs.values)]


def test_an_observation_ingests_token_ids_images_text_values_in_order(engine):
    outputs = []
    session = fresh(engine, outputs)
    obs = ObservationInput(token_ids=[1, 2], images=[FRAME, SIDE], text="look", values=[0.25, -0.5],
                           max_new_tokens=5, snapshot_label="seen")
    generation = session.observe(obs)
    event = events(outputs)[0]
    length = ingest_length(items_of(engine, obs))
    assert length == 2 + FRAME.token_count + 2 + SIDE.token_count + 2 + 4 + 2
    assert (event.success, event.position_before, event.position_after) == (True, 0, length)
    ingested = engine.capsule_bytes(engine.capsules()[0].id)      # the observation's snapshot_label capsule
    while generation.step():
        pass
    produced = list(generation.generated_ids)
    engine.reset()
    engine.ingest(items_of(engine, obs))
    assert engine.live_bytes().equal(ingested)
    assert produced and list(engine.generate(len(produced))) == produced


def test_a_refused_image_refuses_its_observation_and_nothing_else_changes(engine):
    outputs = []
    session = fresh(engine, outputs)
    session.observe(ObservationInput(text="before", snapshot_label="kept"))
    checksum, capsules, position = engine.live_checksum(), engine.capsules(), engine.position
    bad = PreparedImage(FRAME.patches[:5], FRAME.grid, VISION.spatial_merge_size)    # rows do not match its grid
    for obs in (ObservationInput(images=[bad], text="x", max_new_tokens=3, stamp_ns=7),
                ObservationInput(images=[hv.image(4, 4, vision=VISION)] * 50, stamp_ns=8)):   # past max_context
        with pytest.raises(FlashRTError):
            session.observe(obs)
    got = events(outputs)[-2:]
    assert [e.success for e in got] == [False, False]
    assert got[0].error_code == ErrorCode.INVALID_ARGUMENT and "patches must be" in got[0].message
    assert got[1].error_code == ErrorCode.CONTEXT_OVERFLOW
    finals = [o for o in outputs if isinstance(o, TokenOutput)]
    assert [(o.final, o.finish_reason, o.observation_stamp_ns) for o in finals] == [(True, "error", 7)]
    assert engine.live_checksum() == checksum and engine.position == position
    assert [(c.id, c.position) for c in engine.capsules()] == [(c.id, c.position) for c in capsules]


def test_images_refused_by_a_model_without_a_tower():
    outputs = []
    session = Session(Engine(EngineConfig(model="tiny", max_context=128)), discretiser=DISCRETISER,
                      emit=outputs.append)
    with pytest.raises(FlashRTError):
        session.observe(ObservationInput(images=[FRAME], text="x"))
    event = events(outputs)[0]
    assert not event.success and event.error_code == ErrorCode.INVALID_ARGUMENT
    assert "has no vision tower" in event.message and session.engine.position == 0


def test_a_group_with_images_is_one_prefill_with_image_positions_counted(engine):
    outputs = []
    session = fresh(engine, outputs)
    bad = PreparedImage(FRAME.patches, (1, 3, 8), VISION.spatial_merge_size)       # h not a multiple of the merge
    group = [ObservationInput(text="a", images=[FRAME], stamp_ns=1), ObservationInput(images=[bad], stamp_ns=2),
             ObservationInput(token_ids=[5], images=[SIDE], values=[0.1], stamp_ns=3)]
    session.observe_group(group)
    got = events(outputs)
    assert [e.success for e in got] == [True, False, True]
    spans = [ingest_length(items_of(engine, group[0])), 0, ingest_length(items_of(engine, group[2]))]
    assert [e.position_after - e.position_before for e in got] == spans
    assert [e.position_before for e in got] == [0, spans[0], spans[0]]
    grouped = engine.live_checksum()
    engine.reset()
    engine.ingest(items_of(engine, group[0]) + items_of(engine, group[2]))       # one prefill of the accepted
    assert engine.live_checksum() == grouped


def test_an_operation_asked_for_during_an_image_runs_at_the_boundary_after_it(engine):
    """An image is one unit: a snapshot submitted to the engine thread while the tower is still encoding (blocked
    here) runs after the whole image and its text are ingested, never between its tokens."""
    import threading

    from flashrt_ros.engine_worker import EngineWorker

    outputs = []
    session = fresh(engine, outputs)
    tower, started, release = engine.model.visual, threading.Event(), threading.Event()

    class SlowTower(torch.nn.Module):
        def forward(self, patches, grid):
            started.set()
            assert release.wait(10)
            return tower(patches, grid)

    worker = EngineWorker(session)
    engine.model.visual = SlowTower()
    try:
        obs = ObservationInput(token_ids=[1], images=[FRAME], text="ab")
        observed = worker.submit(lambda s: s.observe(obs), when_idle=True)
        assert started.wait(10)
        snapshot = worker.submit(lambda s: s.snapshot(label="mid"))
        release.set()
        observed.result(timeout=10)
        info = snapshot.result(timeout=10).capsule
    finally:
        engine.model.visual = tower
        worker.shutdown()
    assert info.position == ingest_length(items_of(engine, obs)) == engine.position
