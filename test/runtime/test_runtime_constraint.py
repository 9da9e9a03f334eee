"""Constrained decoding on the tiny model (random weights): outputs follow the grammar whatever the model prefers,
and the matcher is live state (snapshot, restore, fork, rollback continue exactly)."""
import json

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from flashrt_ros.runtime import Engine, EngineConfig, ErrorCode, FlashRTError, SamplingParams

CONFIG = EngineConfig(model="tiny", max_context=1024, prefill_chunk=16, seed=3)
PROMPT = list(b"answer in JSON: ")
WARM = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(CONFIG)


def start(engine: Engine, kind: str, text: str, seed: int = 0) -> None:
    engine.reset()
    engine.reseed(seed)
    engine.ingest(PROMPT)
    engine.constrain(engine.compile_constraint(kind, text))


def text_of(tokens) -> str:
    return bytes(t for t in tokens if t < 256).decode()


def leaf_schemas():
    return st.one_of(
        st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                  st.integers(-50, 50), st.integers(0, 100)),
        st.just({"type": "boolean"}),
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 4)),
        st.builds(lambda vals: {"enum": vals}, st.lists(st.sampled_from(["go", "stop", "left", 1, True]),
                                                         min_size=1, max_size=3, unique=True)),
    )


def schemas():
    return st.recursive(
        leaf_schemas(),
        lambda inner: st.one_of(
            st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n}, inner, st.integers(0, 3)),
            st.builds(lambda props: {"type": "object", "properties": props, "required": sorted(props),
                                     "additionalProperties": False},
                      st.dictionaries(st.sampled_from(["a", "b", "vx", "name"]), inner, min_size=1, max_size=3)),
        ),
        max_leaves=5,
    )


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=schemas(), seed=st.integers(0, 2 ** 32))
def test_every_completed_output_validates_against_its_schema(engine, schema, seed):
    start(engine, "json_schema", json.dumps(schema), seed)
    tokens = list(engine.generate(600, WARM))
    assert engine.constraint.stopped and engine.constraint.accepting, f"did not complete: {text_of(tokens)!r}"
    jsonschema.validate(json.loads(text_of(tokens)), schema)


def test_unconstrained_random_model_does_not_produce_json(engine):
    """The property above holds because of the constraint: the same stream without it is not JSON."""
    engine.reset()
    engine.ingest(PROMPT)
    tokens = list(engine.generate(40, WARM))
    with pytest.raises(ValueError):
        json.loads(text_of(tokens))


@pytest.mark.parametrize("kind, text, pattern", [
    ("regex", r"(left|right) [0-9]{2}", r"(left|right) [0-9]{2}"),
    ("lark", 'start: "move " DIR\nDIR: "up" | "down"', r"move (up|down)"),
    ("gbnf", 'root ::= "yes" | "no"', r"yes|no"),
])
def test_grammar_kinds_constrain_the_output(engine, kind, text, pattern):
    import re
    start(engine, kind, text)
    tokens = list(engine.generate(50, WARM))
    assert re.fullmatch(pattern, text_of(tokens)), text_of(tokens)


SCHEMA = json.dumps({"type": "object", "properties": {
    "plan": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 4},
    "speed": {"type": "integer", "minimum": 0, "maximum": 999}}, "required": ["plan", "speed"]})


def uninterrupted(engine, seed=7):
    start(engine, "json_schema", SCHEMA, seed)
    return list(engine.generate(300, WARM))


def test_snapshot_restore_and_fork_mid_constraint_continue_token_identical(engine):
    reference = uninterrupted(engine)
    assert len(reference) > 12 and engine.constraint.stopped
    start(engine, "json_schema", SCHEMA, 7)
    head = list(engine.generate(9, WARM))
    engine.snapshot("mid")
    engine.fork(capsule_id="mid-fork")
    assert head + list(engine.generate(300, WARM)) == reference
    for capsule in ("mid", "mid-fork"):
        engine.reset()                                # no live matcher, another stream: the capsule brings both back
        engine.ingest(list(b"something else entirely"))
        engine.restore(capsule)
        assert head + list(engine.generate(300, WARM)) == reference
    engine.drop("mid")
    engine.drop("mid-fork")


def test_rollback_by_k_rolls_the_matcher_back_by_k(engine):
    reference = uninterrupted(engine)
    start(engine, "json_schema", SCHEMA, 7)
    head = list(engine.generate(10, WARM))
    engine.rollback(steps=4)
    assert engine.constraint.tokens == head[:6]
    assert head[:6] + list(engine.generate(300, WARM)) == reference


def test_restoring_an_unconstrained_capsule_into_a_constrained_stream_clears_the_masks(engine):
    """The mask words are cleared when a matcher goes away (and only then: a restore between unconstrained states
    launches nothing for them), so an unconstrained capsule restored mid-constraint continues as it was taken."""
    engine.reset()
    engine.ingest(PROMPT)
    engine.snapshot("free")
    free = list(engine.generate(12, WARM))
    engine.restore("free")
    start(engine, "regex", "[0-9]{8}")
    list(engine.generate(4, WARM))
    assert not (engine._mask_words == -1).all()           # the matcher's masks are in the words
    engine.restore("free")
    assert engine.constraint is None and (engine._mask_words == -1).all()
    assert list(engine.generate(12, WARM)) == free
    engine.restore("free")                                # unconstrained into unconstrained: still clear
    assert (engine._mask_words == -1).all() and list(engine.generate(12, WARM)) == free
    engine.drop("free")


def test_a_grammar_compiles_once_and_the_cache_is_bounded(monkeypatch):
    """The same schema sent with every observation is compiled once; a refused one is refused every time; at most
    COMPILED_GRAMMARS grammars are kept, the least recently used dropped first."""
    from flashrt_ros.runtime import constraint, engine as engine_module

    fresh = Engine(CONFIG)
    compiled = []
    real = constraint.compile_grammar
    monkeypatch.setattr(constraint, "compile_grammar", lambda kind, text: compiled.append(text) or real(kind, text))
    first = fresh.compile_constraint("regex", "[0-9]{3}")
    assert fresh.compile_constraint("regex", "[0-9]{3}") is first and compiled == ["[0-9]{3}"]
    for _ in range(2):
        with pytest.raises(FlashRTError) as err:
            fresh.compile_constraint("json_schema", "{not json")
        assert err.value.code == ErrorCode.INVALID_ARGUMENT
    assert compiled.count("{not json") == 2
    monkeypatch.setattr(engine_module, "COMPILED_GRAMMARS", 3)
    for n in range(4):                                   # [0-9]{3} is the least recently used: dropped
        fresh.compile_constraint("regex", f"a{{{n + 1}}}")
    fresh.compile_constraint("regex", "[0-9]{3}")
    assert compiled.count("[0-9]{3}") == 2 and len(fresh._compiled_grammars) == 3


def test_rollback_past_the_constraint_start_leaves_the_stream_unconstrained(engine):
    start(engine, "regex", "[0-9]{8}")
    list(engine.generate(3, WARM))
    engine.rollback(steps=4)                              # 3 tokens and the prompt
    assert engine.constraint is None
    assert (engine._mask_words == -1).all()


def test_matcher_rebuilt_from_its_state_equals_the_live_one(engine):
    """The capsule keeps (grammar, tokens); a matcher rebuilt from them allows exactly the same next tokens."""
    from flashrt_ros.runtime.constraint import Constraint
    start(engine, "json_schema", SCHEMA, 11)
    list(engine.generate(7, WARM))
    live, rebuilt = torch.zeros(16, dtype=torch.int32), torch.zeros(16, dtype=torch.int32)
    engine.constraint.fill_mask(live)
    Constraint(engine._llg(), engine.constraint.state()).fill_mask(rebuilt)
    assert torch.equal(live, rebuilt) and not (live == -1).all()


@pytest.mark.parametrize("kind, text, says", [
    ("json_schema", '{"type": "objectx"}', "objectx"),
    ("json_schema", '{"type": ', "bad json_schema"),
    ("lark", "start: foo(", "Expected"),
    ("regex", "(unclosed", "regex"),
    ("yaml", "a: b", "grammar kind"),
])
def test_a_bad_grammar_is_invalid_argument_and_changes_nothing(engine, kind, text, says):
    start(engine, "regex", "[a-z]{5}")
    list(engine.generate(2, WARM))
    before, tokens = engine.live_bytes().clone(), list(engine.constraint.tokens)
    with pytest.raises(FlashRTError) as err:
        engine.compile_constraint(kind, text)
    assert err.value.code == ErrorCode.INVALID_ARGUMENT and says in str(err.value)
    assert torch.equal(engine.live_bytes(), before) and engine.constraint.tokens == tokens


def test_an_hf_tokenizer_json_is_given_to_llguidance(tmp_path):
    """tokenizer.json (byte-level BPE, as Qwen's) -> llguidance: the mask allows exactly the tokens that keep the
    output inside the grammar, multi-byte tokens included."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from flashrt_ros.runtime.constraint import Constraint, ConstraintState, compile_grammar, llg_tokenizer
    from flashrt_ros.runtime.tokenizer import HFTokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["left 12 right 34 stop 56"] * 50, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = HFTokenizer(tmp_path / "tokenizer.json")
    vocab = tok.get_vocab_size()
    constraint = Constraint(llg_tokenizer(hf, vocab, [tok.token_to_id("<|end|>")]),
                            ConstraintState(compile_grammar("regex", "(left|right) [0-9]{2}")))
    words = torch.zeros((vocab + 31) // 32, dtype=torch.int32)

    def allowed_texts():
        constraint.fill_mask(words)
        return {hf.decode([i]) for i in range(vocab) if (int(words[i // 32]) >> (i % 32)) & 1}

    first = allowed_texts()
    assert {"left", "l", "r"} <= first                          # a whole word (a BPE merge) and first bytes
    assert all("left".startswith(t) or "right".startswith(t) for t in first)
    for token in hf.encode("left 1"):
        constraint.accept(token)
    assert allowed_texts() == {str(d) for d in range(10)}          # one more digit, and nothing that is two


@pytest.mark.parametrize("sampling", [None, WARM])
def test_the_overlapped_constrained_step_equals_the_step_driven_by_hand(engine, sampling):
    """A constrained plain step runs its pick and its forward apart, accepting the token and computing the next mask
    in between (on CUDA while the forward runs): its tokens and final bytes are those of the pick and the forward
    driven by hand with the mask computed before each step."""
    start(engine, "json_schema", SCHEMA, 7)
    want = list(engine.generate(300, sampling))
    state = engine.live_bytes()
    assert engine.constraint.stopped
    start(engine, "json_schema", SCHEMA, 7)
    engine.sampler.configure(sampling or SamplingParams())
    matcher, words, got = engine.constraint, engine._mask_words[0], []
    while not matcher.stopped:
        matcher.fill_mask(words)
        engine._sample_step(sampling is None)()
        engine._forward_step(engine._kv_bucket(engine.arena.position() + 1))()
        got.append(int(engine._tokens[0]))
        matcher.accept(got[-1])
    engine._moved_to(None)                            # driven by hand: the engine reads the position from the arena
    assert got == want and torch.equal(engine.live_bytes(), state)
