"""Constrained decoding with MTP speculation (issue 30 item 5) on the trained model (its drafts are accepted).

A speculative step under a grammar masks the picked token, then the matcher walks the drafts to mask each verify
row (``Constraint.fill_verify_masks``): the model's check of every draft is its pick under the grammar, so a draft
the grammar forbids is never accepted and the tokens are exactly those of the same plan without drafts (the oracle
of test_speculative.py: a speculative engine asked for one token per generate call never drafts). The trained
model declares no end-of-sequence token, which a completed constrained output needs: a copy of its folder names
one (``eos``)."""
import json
import os
import shutil

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from flashrt_ros.runtime import Engine, EngineConfig, SamplingParams

from test_runtime_constraint import schemas
from test_speculative import SAMPLED, prompts

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "value": {"type": "integer"}},
     "required": ["name", "value"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["return", "self", "Decimal", "None"]}, "maxItems": 4},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "rate": {"type": "number"},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                                               "maxItems": 2}},
     "required": ["ok", "rate", "tags"], "additionalProperties": False},
]
EOS = 309                # a rare token of the trained vocabulary (a newline and 12 spaces), made its end of sequence


@pytest.fixture(scope="module")
def eos_model(trained, tmp_path_factory):
    """The trained model's folder with ``eos_token_id`` set."""
    folder = tmp_path_factory.mktemp("trained-eos") / "lm"
    shutil.copytree(trained[0], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": EOS}))
    return folder


def engine(folder, k: int, **overrides) -> Engine:
    return Engine(EngineConfig(model=str(folder), speculative_tokens=k, max_context=512, **overrides))


def start(e: Engine, prompt, schema, seed: int = 0) -> None:
    e.reset()
    e.reseed(seed)
    e.ingest(prompt)
    e.constrain(e.compile_constraint("json_schema", json.dumps(schema)))


def undrafted(e: Engine, tokens: int, sampling=None) -> list[int]:
    """The oracle: one token per generate call (no step drafts), until the grammar stops or ``tokens``."""
    out = []
    while len(out) < tokens and not e.constraint.stopped:
        out += e.generate(1, sampling)
        assert e.generation_stats.drafted == 0
    return out


def completed_json(e: Engine, tokens: list[int], schema) -> None:
    """The grammar completed (its last token, or the end-of-sequence token after it) and the text validates."""
    assert e.constraint.stopped and e.constraint.accepting, e.tokenizer.decode(tokens)
    jsonschema.validate(json.loads(e.tokenizer.decode([t for t in tokens if t != EOS])), schema)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_greedy_constrained_speculation_equals_the_constrained_plan_without_drafts(eos_model, kernels):
    """Three schemas x two prompts, k = 1, 2, 4: the tokens equal the oracle's, the outputs complete and validate,
    the live state's bytes at the end equal the oracle's, and drafts were accepted (the verify rows' masks were
    used). The one-row plan gives the same tokens on this model (a check, not the oracle). With Triton's
    interpreter (slow: minutes) one schema and prompt, k = 2, no one-row check."""
    if kernels == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU runs through its interpreter (test/conftest.py sets TRITON_INTERPRET=1)")
    oracle, plain = engine(eos_model, 1, kernels=kernels), engine(eos_model, 0, kernels="reference")
    cases = [(prompt, schema) for prompt in prompts(eos_model, oracle, 2, 24) for schema in SCHEMAS]
    drafts = (1, 2, 4)
    if kernels == "triton":
        cases, drafts = cases[:1], (2,)
    wants, states = [], []
    for prompt, schema in cases:
        start(oracle, prompt, schema)
        wants.append(undrafted(oracle, 60))
        completed_json(oracle, wants[-1], schema)
        states.append(oracle.live_bytes())
        if kernels == "reference":
            start(plain, prompt, schema)
            assert list(plain.generate(60)) == wants[-1]
    for k in drafts:
        spec = engine(eos_model, k, kernels=kernels)
        for (prompt, schema), want, state in zip(cases, wants, states):
            start(spec, prompt, schema)
            assert list(spec.generate(60)) == want, (k, schema)
            assert torch.equal(spec.live_bytes(), state)
        assert spec.speculative_stats.accepted >= (10 if kernels == "reference" else 2), spec.speculative_stats


SAMPLED_SCHEMA = {"type": "array", "items": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "n"], "additionalProperties": False}, "minItems": 1, "maxItems": 3}


def test_seeded_constrained_speculation_replays_from_a_capsule_and_rollback(eos_model, tmp_path):
    """Seeded sampling under a grammar with 3 drafts: the oracle's tokens; a capsule taken between two tokens of a
    step (mid-grammar) restores with its matcher after another stream and continues identically, also through its
    file in the draft-free engine; rollback by 3 tokens then goes on identically too."""
    spec, oracle = (engine(eos_model, k, capsule_dir=str(tmp_path)) for k in (3, 1))
    prompt = prompts(eos_model, oracle, 1, 20)[0]
    start(oracle, prompt, SAMPLED_SCHEMA, seed=5)
    want = undrafted(oracle, 120, SAMPLED)
    completed_json(oracle, want, SAMPLED_SCHEMA)
    start(spec, prompt, SAMPLED_SCHEMA, seed=5)
    assert list(spec.generate(120, SAMPLED)) == want
    assert spec.speculative_stats.accepted > 0
    start(spec, prompt, SAMPLED_SCHEMA, seed=5)
    stream = spec.generate(120, SAMPLED)
    head = [next(stream) for _ in range(9)]
    spec.snapshot("mid")
    assert head + list(stream) == want
    spec.export_capsule("mid")
    oracle.import_capsule("mid")
    for e in (spec, oracle):
        e.reset()
        e.ingest(prompt[:5])                          # another stream, no live matcher: the capsule brings both back
        e.restore("mid")
        assert e.constraint.tokens == head
        assert head + (list(e.generate(120, SAMPLED)) if e is spec else undrafted(e, 120, SAMPLED)) == want
    spec.restore("mid")
    more = list(spec.generate(5, SAMPLED))
    spec.rollback(steps=3)
    assert spec.constraint.tokens == head + more[:2]
    assert head + more[:2] + list(spec.generate(120, SAMPLED)) == want


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.too_slow])
@given(schema=schemas(), seed=st.integers(0, 2 ** 32))
def test_every_completed_speculative_output_validates_against_its_schema(eos_model, speculative, schema, seed):
    """With 3 drafts and sampling, whatever the schema: the output completes and validates."""
    start(speculative, prompts(eos_model, speculative, 1, 12)[0], schema, seed)
    tokens = list(speculative.generate(300, SamplingParams(temperature=1.0)))
    completed_json(speculative, tokens, schema)


@pytest.fixture(scope="module")
def speculative(eos_model):
    return engine(eos_model, 3)


def test_a_session_preempts_and_resumes_a_constrained_speculative_goal(eos_model, speculative):
    """The node's Session on a speculative engine: a json_schema goal preempted between two tokens (inside a step)
    by an urgent, unconstrained observation and resumed gives the uninterrupted goal's tokens, which validate."""
    from flashrt_ros.discretiser import Discretiser
    from flashrt_ros.session import PRIORITY_URGENT, ObservationInput, Session

    def finish(generation):
        while generation.step():
            pass
        return generation.outcome.result()

    prompt = prompts(eos_model, speculative, 2, 20)
    goal = ObservationInput(token_ids=prompt[0], max_new_tokens=120)
    fields = {"json_schema": json.dumps(SAMPLED_SCHEMA), "reseed": True, "seed": 5, "override_sampling": True,
              "temperature": SAMPLED.temperature, "top_k": SAMPLED.top_k, "top_p": SAMPLED.top_p}
    speculative.reset()
    session = Session(speculative, discretiser=Discretiser(bins=8, token_offset=0), emit=lambda _: None,
                      stream_chunk_tokens=4)
    whole = finish(session.generate(goal, **fields))
    assert whole.finish_reason == "stop" and whole.acceptance_rate > 0
    completed_json(speculative, whole.token_ids, SAMPLED_SCHEMA)
    first = session.generate(goal, **fields)
    for _ in range(3):                 # three chunks of 4: token 12 is inside a step of 1 + 3 drafts at most
        first.step()
    finish(session.observe(ObservationInput(token_ids=prompt[1][:5], max_new_tokens=3, priority=PRIORITY_URGENT)))
    interrupted = first.outcome.result()
    assert interrupted.finish_reason == "preempted"
    session.resume()
    resumed = finish(session.active)
    assert interrupted.token_ids + resumed.token_ids == whole.token_ids and resumed.finish_reason == "stop"
