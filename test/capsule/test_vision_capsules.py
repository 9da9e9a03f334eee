"""Capsules of a stream with images (issue 32): the M-RoPE delta is arena state, so snapshots, restores, forks and
rollbacks across an image are byte-exact and their continuations token-identical; a stateful randomised test
against a naive re-run of the operations that made each state."""
import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

import hf_vision as hv
from flashrt_ros.runtime import Engine, EngineConfig, FlashRTError
from flashrt_ros.runtime.arena import ROPE_DELTA
from flashrt_ros.runtime.config import PRESETS
from flashrt_ros.runtime.vision import ingest_length

VISION = PRESETS["tiny-vl"].vision
CONFIG = EngineConfig(model="tiny-vl", max_context=192, prefill_chunk=16, history_depth=6, image_min_pixels=1)
TOWER = hv.preset_tower(VISION)
IMAGES = [hv.image(4, 6, seed=1, vision=VISION), hv.image(6, 2, seed=2, vision=VISION),
          hv.image(2, 2, seed=3, vision=VISION)]
PROMPT = [10, 11, 12, IMAGES[0], 13, 14]


def vision_engine(config: EngineConfig = CONFIG) -> Engine:
    engine = Engine(config)
    engine.model.visual = TOWER
    return engine


@pytest.fixture
def engine():
    return vision_engine()


def greedy(engine, n):
    return list(engine.generate(n, stop_token_ids=()))


def test_restore_after_an_image_is_byte_exact_and_token_identical(engine):
    engine.ingest(PROMPT)
    assert engine.rope_delta == 3 - 6
    engine.snapshot("seen")
    continuation = greedy(engine, 10)
    engine.ingest([20, 21, IMAGES[1]])              # another image moves the delta further
    assert engine.rope_delta == -3 + 3 - 3
    engine.restore("seen")
    assert torch.equal(engine.live_bytes(), engine.capsule_bytes("seen"))
    assert engine.rope_delta == -3
    assert greedy(engine, 10) == continuation


def test_capsules_before_and_after_an_image_restore_exactly(engine):
    engine.ingest(PROMPT[:3])
    engine.snapshot("before")
    engine.ingest(PROMPT[3:])
    engine.snapshot("after")
    after = greedy(engine, 6)
    engine.restore("before")
    assert torch.equal(engine.live_bytes(), engine.capsule_bytes("before")) and engine.rope_delta == 0
    engine.ingest(PROMPT[3:])                        # the same image again from the earlier capsule
    assert torch.equal(engine.live_bytes(), engine.capsule_bytes("after"))
    assert greedy(engine, 6) == after
    engine.restore("after")
    assert engine.rope_delta == -3 and greedy(engine, 6) == after


def test_a_fork_per_plan_from_the_post_image_capsule(engine):
    """A planner's pattern: one capsule after the camera frame, one fork per candidate plan continued on its own;
    each plan's tokens equal a cold run of frame + plan, and the root still restores byte-exactly."""
    engine.ingest(PROMPT)
    root = engine.snapshot("frame")
    root_bytes = engine.capsule_bytes("frame")
    plans = {"left": [30, 31], "right": [40, 41, 42], "stop": [50]}
    outcomes = {}
    for name, text in plans.items():
        engine.fork("frame", f"plan-{name}", switch=True)
        engine.ingest(text)
        outcomes[name] = greedy(engine, 5)
    cold = vision_engine()
    for name, text in plans.items():
        cold.reset()
        cold.ingest(PROMPT)
        cold.ingest(text)
        assert greedy(cold, 5) == outcomes[name], name
    engine.restore("frame")
    assert engine.capsule("frame").position == root.position
    assert torch.equal(engine.live_bytes(), root_bytes)


def test_rollback_by_steps_across_an_image_restores_the_delta(engine):
    engine.ingest(PROMPT[:3])
    before = engine.live_bytes()
    engine.ingest(PROMPT[3:])                        # one commit boundary, the image with its text
    after = engine.live_bytes()
    tokens = greedy(engine, 4)
    assert engine.rollback(steps=4) == ingest_length(PROMPT)
    assert torch.equal(engine.live_bytes(), after) and engine.rope_delta == -3
    assert engine.rollback(steps=1) == 3
    assert torch.equal(engine.live_bytes(), before) and engine.rope_delta == 0
    engine.ingest(PROMPT[3:])
    assert greedy(engine, 4) == tokens


def test_rollback_to_a_capsule_across_an_image(engine):
    engine.ingest(PROMPT[:3])
    engine.snapshot("text")
    engine.ingest(PROMPT[3:])
    greedy(engine, 3)
    engine.rollback("text")
    assert torch.equal(engine.live_bytes(), engine.capsule_bytes("text")) and engine.rope_delta == 0


def test_kv_only_restore_after_an_image_still_diverges(engine):
    engine.ingest(PROMPT)
    engine.snapshot("s")
    logits = engine.next_token_logits()
    continuation = greedy(engine, 8)
    engine.ingest([60, 61, IMAGES[2], 62])
    engine.restore("s", kv_only=True)
    assert engine.rope_delta == -3                   # the metadata came back with the KV
    assert (engine.next_token_logits() - logits).norm() > 1e-3 * logits.norm()
    assert greedy(engine, 8) != continuation
    engine.restore("s")
    assert greedy(engine, 8) == continuation


def test_speculative_plan_after_an_image_matches_plain_decoding():
    """The 5-row verify step reads the delta from the arena (its rows' metadata carry it): the speculative plan's
    greedy tokens after an image are the plain plan's."""
    plain, speculative = vision_engine(), vision_engine(dataclasses.replace(CONFIG, speculative_tokens=3))
    for engine in (plain, speculative):
        engine.ingest(PROMPT)
    assert greedy(speculative, 12) == greedy(plain, 12)


def test_mtp_draft_rotates_at_the_delta(engine):
    """An MTP draft writes the head's KV row of the next token as the one-row decode forward of that token does:
    with the delta after an image (a draft at the plain position would rotate its key elsewhere)."""
    engine.ingest(PROMPT)
    engine.snapshot("s")
    position, token, kv_len = engine.position, torch.tensor([77]), engine.kv_buckets[0]
    with torch.inference_mode():
        engine.model.mtp_draft(token, engine.arena["hidden"][None].clone(), torch.tensor([position]), kv_len)
        drafted = engine.arena["mtp_kv"][position].clone()
        engine.restore("s")
        engine.model.forward(token, kv_len)
    assert int(engine.arena["meta"][ROPE_DELTA]) == -3
    assert torch.equal(engine.arena["mtp_kv"][position], drafted)


# ---- stateful: operations against a naive re-run -------------------------------------------------------------

CHOICES = [[7], [8, 9, 10], IMAGES[:1], [11, IMAGES[1], 12], [IMAGES[2], 13, IMAGES[0]]]


class VisionStreamMachine(RuleBasedStateMachine):
    """The naive model of a live state is the list of operations that made it from a reset (each ingest call with
    its items, each generated token); the twin re-runs that list from a reset, and its arena must equal the
    engine's byte for byte after every step. Capsules map to the lists they were taken at; a rollback by k drops
    the last k operations (each one commit boundary) where the history holds them."""

    @initialize()
    def start(self):
        if not ENGINES:                   # built once: construction dominates a tiny engine's cost
            ENGINES.extend([vision_engine(), vision_engine()])
        self.engine, self.twin = ENGINES
        for info in self.engine.capsules():
            self.engine.drop(info.id)
        self.engine.reset()
        self.twin.reset()
        self.ops: list = []
        self.kept = 1                     # commit boundaries the engine's history holds (the live one included)
        self.capsules: dict[str, list] = {}

    def replay(self, ops) -> None:
        self.twin.reset()
        for op in ops:
            self.apply(self.twin, op)

    @staticmethod
    def apply(engine, op):
        kind, value = op
        return engine.ingest(value) if kind == "ingest" else greedy(engine, 1)

    def step(self, op):
        self.apply(self.engine, op)
        self.apply(self.twin, op)
        self.ops.append(op)
        self.kept = min(self.kept + 1, CONFIG.history_depth)

    @rule(choice=st.sampled_from(range(len(CHOICES))))
    def ingest(self, choice):
        if self.engine.position + ingest_length(CHOICES[choice]) > CONFIG.max_context - 8:   # room to generate
            return
        self.step(("ingest", CHOICES[choice]))

    @precondition(lambda self: self.ops)
    @rule(n=st.integers(1, 3))
    def generate(self, n):
        for _ in range(n):
            self.step(("generate", 1))

    @rule(capsule_id=st.sampled_from("abc"))
    def snapshot(self, capsule_id):
        if capsule_id in self.capsules:
            self.engine.drop(capsule_id)
        self.engine.snapshot(capsule_id)
        self.capsules[capsule_id] = list(self.ops)

    @precondition(lambda self: self.capsules)
    @rule(data=st.data(), fork=st.booleans())
    def restore(self, data, fork):
        source = data.draw(st.sampled_from(sorted(self.capsules)))
        if fork:
            target = "g" if source == "f" else "f"
            if target in self.capsules:
                self.engine.drop(target)
            self.engine.fork(source, target, switch=True)
            self.capsules[target] = self.capsules[source]
        else:
            self.engine.restore(source)
        self.ops = list(self.capsules[source])
        self.kept = 1
        self.replay(self.ops)

    @rule(steps=st.integers(1, 5))
    def rollback(self, steps):
        if steps >= self.kept:
            with pytest.raises(FlashRTError):
                self.engine.rollback(steps=steps)
            return
        self.engine.rollback(steps=steps)
        self.ops = self.ops[:-steps]
        self.kept -= steps
        self.replay(self.ops)

    @invariant()
    def same_state(self):
        if not hasattr(self, "twin"):
            return
        assert self.engine.position == self.twin.position
        assert self.engine.rope_delta == self.twin.rope_delta
        assert torch.equal(self.engine.live_bytes(), self.twin.live_bytes())


ENGINES: list[Engine] = []


def test_stateful_text_and_images_with_capsules_against_a_rerun():
    run_state_machine_as_test(VisionStreamMachine, settings=settings(
        max_examples=12, stateful_step_count=12, deadline=None, database=None,
        suppress_health_check=list(HealthCheck)))


def test_capsules_move_between_engines_with_and_without_the_tower(tmp_path):
    """The tower only turns the next image into embeddings, so it is left out of the fingerprint: a capsule taken
    after an image (this runtime's own tower and preprocessing, a raw camera frame) continues identically in an
    engine started with vision_tower off, which refuses images with the reason and changes nothing."""
    import numpy as np

    from flashrt_ros.runtime.errors import ErrorCode
    from flashrt_ros.runtime.vision.preprocess import Image
    config = EngineConfig(model="tiny-vl", max_context=512, capsule_dir=str(tmp_path), image_min_pixels=32 * 32)
    on, off = Engine(config), Engine(dataclasses.replace(config, vision_tower=False))
    assert on.fingerprint == off.fingerprint and on.visual is not None and off.visual is None
    frame = Image(np.random.default_rng(0).integers(0, 256, (48, 80, 3), dtype=np.uint8))
    on.ingest([72, 105, frame, 63])
    assert on.arena["meta"][ROPE_DELTA] != 0
    on.snapshot("seen")
    on.export_capsule("seen")
    want = greedy(on, 6)
    off.import_capsule("seen")
    off.restore("seen")
    before = off.live_bytes()
    with pytest.raises(FlashRTError) as err:
        off.ingest([frame])
    assert err.value.code == ErrorCode.INVALID_ARGUMENT and "vision_tower off" in err.value.message
    assert torch.equal(off.live_bytes(), before)
    assert greedy(off, 6) == want
