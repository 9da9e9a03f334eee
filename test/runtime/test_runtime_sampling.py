"""Seeded sampling: the RNG state lives in the arena, so capsules replay draws; filters and temperature behave."""
import dataclasses
import math

import pytest
import torch

from flashrt_ros.runtime import Engine, EngineConfig, ErrorCode, FlashRTError, SamplingParams
from flashrt_ros.runtime.arena import META_SLOTS, RNG_COUNTER, RNG_SEED
from flashrt_ros.runtime.sampler import Sampler

CONFIG = EngineConfig(model="tiny", max_context=256, prefill_chunk=16, seed=5)
PROMPT = list(b"sampling from a seeded stream")
WARM = SamplingParams(temperature=1.3, top_k=64, top_p=0.95)


@pytest.fixture
def engine() -> Engine:
    eng = Engine(CONFIG)
    eng.ingest(PROMPT)
    eng.snapshot("s")
    return eng


def run(engine: Engine, n: int, params: SamplingParams | None = None) -> list[int]:
    return list(engine.generate(n, params, stop_token_ids=[]))


def test_sampling_replays_after_restore_and_differs_from_greedy(engine):
    sampled = run(engine, 12, WARM)
    engine.restore("s")
    assert run(engine, 12, WARM) == sampled
    engine.restore("s")
    assert run(engine, 12) != sampled


def test_reseed_changes_the_draws_reproducibly(engine):
    sampled = run(engine, 12, WARM)
    engine.restore("s")
    engine.reseed(123)
    reseeded = run(engine, 12, WARM)
    assert reseeded != sampled
    engine.restore("s")
    engine.reseed(123)
    assert run(engine, 12, WARM) == reseeded
    engine.restore("s")                                       # the capsule carries the seed it was taken with
    assert run(engine, 12, WARM) == sampled


def test_rollback_by_steps_replays_sampled_draws(engine):
    sampled = run(engine, 6, WARM)
    engine.rollback(steps=3)
    assert run(engine, 3, WARM) == sampled[3:]


def test_reset_reseeds_to_the_configured_seed(engine):
    sampled = run(engine, 8, WARM)
    engine.reseed(99)
    engine.reset()
    engine.ingest(PROMPT)
    assert run(engine, 8, WARM) == sampled


def test_rng_state_mid_stream_travels_in_a_capsule_file(tmp_path):
    engine, fresh = (Engine(dataclasses.replace(CONFIG, capsule_dir=str(tmp_path))) for _ in range(2))
    engine.ingest(PROMPT)
    run(engine, 4, WARM)
    engine.snapshot("mid")
    rest = run(engine, 8, WARM)
    engine.export_capsule("mid")
    fresh.import_capsule("mid")
    fresh.restore("mid")
    assert run(fresh, 8, WARM) == rest


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, top_k=1),
                                    SamplingParams(temperature=5.0, top_p=1e-6)],
                         ids=["top_k=1", "tiny-top_p"])
def test_a_single_candidate_is_greedy(engine, params):
    greedy = run(engine, 10)
    engine.restore("s")
    assert run(engine, 10, params) == greedy


def test_every_sampled_token_passes_the_top_k_and_top_p_filters(engine):
    temperature, top_k, top_p = 1.5, 20, 0.6
    stream = engine.generate(15, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p), stop_token_ids=[])
    for _ in range(15):
        probs = (engine.next_token_logits() / temperature).softmax(-1)
        ordered, order = probs.sort(descending=True)
        nucleus = int(((ordered.cumsum(-1) - ordered) < top_p).sum())
        allowed = set(order[:min(top_k, nucleus)].tolist())
        assert next(stream) in allowed


def sampler_frequencies(logits: torch.Tensor, params: SamplingParams, draws: int) -> torch.Tensor:
    """Empirical distribution of the sampler's draws from fixed logits (the counter advances per draw)."""
    sampler = Sampler(logits.numel(), torch.device("cpu"))
    sampler.configure(params)
    meta = torch.zeros(META_SLOTS, dtype=torch.int64)
    meta[RNG_SEED] = 11
    counts = torch.zeros(logits.numel())
    for _ in range(draws):
        counts[sampler.sample(logits, meta)] += 1
    assert int(meta[RNG_COUNTER]) == draws
    return counts / draws


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5),
                                    SamplingParams(temperature=2.0, top_k=3),
                                    SamplingParams(temperature=1.0, top_p=0.7)],
                         ids=["t1", "t0.5", "t2-top3", "t1-top_p0.7"])
def test_sampler_draws_follow_the_filtered_tempered_softmax(params):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])
    probs = (logits / params.temperature).softmax(-1)
    if params.top_k:
        probs[params.top_k:] = 0.0
    keep = (probs.cumsum(-1) - probs) < params.top_p
    probs = torch.where(keep, probs, 0.0)
    expected = probs / probs.sum()
    draws = 2500
    observed = sampler_frequencies(logits, params, draws)
    assert bool((observed[expected == 0] == 0).all()), "a filtered token was drawn"
    tolerance = 4 * torch.sqrt(expected * (1 - expected) / draws) + 1e-3
    assert bool(((observed - expected).abs() <= tolerance).all()), (observed, expected)


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(temperature=math.nan), dict(temperature=101.0),
                                    dict(temperature=1.0, top_k=-1), dict(temperature=1.0, top_p=0.0),
                                    dict(temperature=1.0, top_p=1.5), dict(temperature=1.0, top_p=math.nan)])
def test_invalid_sampling_params_cannot_be_made(engine, kwargs):
    """Refused when made, so no invalid value reaches the engine (which therefore does not check again)."""
    with pytest.raises(FlashRTError) as error:
        SamplingParams(**kwargs)
    assert error.value.code == ErrorCode.INVALID_ARGUMENT
    assert engine.position == len(PROMPT)


def test_sampling_params_are_made_by_field_name_only():
    """The fields' order differs between SamplingParams (temperature, top_k, top_p), the Generate goal and the
    parameters (temperature, top_p, top_k): positional arguments could swap top_k and top_p unseen."""
    with pytest.raises(TypeError):
        SamplingParams(1.0, 0.9, 5)


def test_generate_needs_a_context():
    engine = Engine(CONFIG)
    with pytest.raises(FlashRTError) as error:
        engine.generate(3)
    assert error.value.code == ErrorCode.INVALID_ARGUMENT


def test_generation_stops_at_stop_tokens_and_at_the_context_end(engine):
    greedy = run(engine, 10)
    engine.restore("s")
    assert list(engine.generate(10, stop_token_ids=[greedy[3]])) == greedy[:greedy.index(greedy[3]) + 1]
    short = Engine(dataclasses.replace(CONFIG, max_context=len(PROMPT) + 6))
    short.ingest(PROMPT)
    assert len(run(short, 10, WARM)) == 6
    assert short.position == short.max_context
