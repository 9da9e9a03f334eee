"""Self-speculative decoding with the MTP head (runtime/speculative.py) on a model trained here (the ``trained``
fixture: its MTP head drafts tokens the model accepts, where random weights accept almost none).

Two decode plans. speculative_tokens = 0 runs main's one-row decode step (plan "flashrt-plan-2", main's
fingerprint and bytes); > 0 runs every step over STEP_ROWS rows ("flashrt-plan-3-spec"), whose GEMMs give other
bytes. The state's layout is the same, so capsules move between the two (restored byte for byte; each engine then
decodes by its own plan).

The oracle of speculation is therefore its own plan without drafts: a speculative engine asked for one token per
generate call never drafts (a step drafts at most the tokens still wanted minus one), so each of its steps is the
plan's draft-free STEP_ROWS-row step, token for token plain decoding at that plan. Every token, and the live
state's bytes after every token, must equal the oracle's with any number of drafts; so must every capsule operation
in between. Greedy tokens also equal the one-row plan's on this model (a check, not the oracle)."""
import os

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from flashrt_ros.runtime import Engine, EngineConfig, ErrorCode, FlashRTError, SamplingParams
from flashrt_ros.runtime.arena import POSITION
from flashrt_ros.runtime.engine import PLAN_VERSION, SPECULATIVE_PLAN_VERSION
from flashrt_ros.runtime.speculative import Stepper
from speculative_streams import assert_same_stream, engine, prompts, run, run_undrafted, undrafted

SAMPLED = SamplingParams(temperature=0.8, top_k=40, top_p=0.95)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_greedy_speculation_is_token_and_byte_identical_to_its_plan_without_drafts(trained, kernels):
    """k = 1..4, three prompts, at a short and a long context (the long one crosses a KV bucket, where drafts stop
    at the bucket's end): tokens and the live state after every token equal the oracle's (the plan's draft-free
    steps), and so does the state at a stop token inside a step; the drafts were accepted often (else no verify row
    was committed); the tokens are also the one-row plan's. With Triton's interpreter one short case, 1 and 4
    drafts."""
    if kernels == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU runs through its interpreter (test/conftest.py sets TRITON_INTERPRET=1)")
    folder, _ = trained
    oracle, plain = engine(folder, 1, kernels=kernels), engine(folder, 0, kernels=kernels)
    cases = [(p, 24) for p in prompts(folder, plain, 3, 20)] + [(p, 12) for p in prompts(folder, plain, 1, 250)]
    drafts = range(1, 5)
    if kernels == "triton":    # the interpreter is slow (all cases ran past 15 minutes): one short case, 1 and 4 drafts
        cases, drafts = [(cases[0][0][:12], 10)], (1, 4)
    wants = [run_undrafted(oracle, prompt, tokens) for prompt, tokens in cases]
    assert [want[0] for want in wants] == [run(plain, prompt, tokens)[0] for prompt, tokens in cases]
    for k in drafts:
        spec = engine(folder, k, kernels=kernels)
        assert spec.fingerprint == oracle.fingerprint != plain.fingerprint    # capsules move between any k > 0
        for (prompt, tokens), want in zip(cases, wants):
            assert_same_stream(run(spec, prompt, tokens), want)
            run_undrafted(oracle, prompt, tokens)      # the whole arena too: nothing past the position differs either
            assert torch.equal(spec.arena.storage, oracle.arena.storage)
            # a stop token inside a step: the state is the oracle's there, and the KV rows the step wrote past
            # it (accepted or rejected drafts) are zeroed, so after the reset nothing is left past the position
            stop = want[0][tokens // 2]
            cut = want[0].index(stop) + 1
            spec.reset()
            spec.ingest(prompt)
            assert list(spec.generate(tokens, stop_token_ids=[stop])) == want[0][:cut]
            assert torch.equal(spec.live_bytes(), want[1][cut - 1])
            for name in ("kv", "mtp_kv"):
                assert not spec.arena[name][spec.position:].any(), name
        stats = spec.speculative_stats
        assert stats.accepted >= (10 if kernels == "reference" else 2) and stats.tokens_per_step > 1.1, stats


def test_seeded_sampling_is_the_draw_of_its_plan_and_replays_from_a_capsule(trained, tmp_path):
    """A sampled stream with drafts is the draft-free stream of its plan (a draft is kept only where it equals the
    draw); a capsule taken between two tokens of a step continues token-identically with 3 drafts and, in another
    engine, without drafts."""
    folder, _ = trained
    spec, oracle = (engine(folder, k, capsule_dir=str(tmp_path)) for k in (3, 1))
    prompt = prompts(folder, oracle, 1, 30)[0]
    want = run_undrafted(oracle, prompt, 30, SAMPLED)
    assert_same_stream(run(spec, prompt, 30, SAMPLED), want)
    assert spec.speculative_stats.accepted > 0
    spec.reset()
    spec.ingest(prompt)
    stream = spec.generate(30, SAMPLED, stop_token_ids=[])
    head = [next(stream) for _ in range(7)]
    spec.snapshot("mid")
    rest = list(stream)
    assert head + rest == want[0]
    spec.export_capsule("mid")
    oracle.import_capsule("mid")
    for e in (spec, oracle):
        e.restore("mid")
        assert list(e.generate(23, SAMPLED, stop_token_ids=[])) == rest
        assert torch.equal(e.live_bytes(), want[1][-1])


@pytest.mark.parametrize("sampling", [None, SAMPLED], ids=["greedy", "sampled"])
def test_a_step_after_a_verify_takes_its_pick_and_never_a_stale_one(trained, sampling):
    """A step that starts where a verify left the state (the step before had drafts) takes that verify's pick
    instead of reading the LM head for it, also across generate calls; after a restore, a reseed or a change of
    sampling the state or the draw differs, so the step picks again. Every token is the oracle's."""
    folder, _ = trained
    spec, oracle = engine(folder, 2), engine(folder, 1)
    prompt = prompts(folder, oracle, 1, 24)[0]
    want = run_undrafted(oracle, prompt, 40, sampling)[0]
    steps, head_reads = [], []                   # (drafts, carried) of every step; LM-head reads for a first pick
    step, logits = spec.stepper.step, spec.model.logits
    spec.stepper.step = lambda k, greedy, kv_len, carried=False: steps.append((k, carried)) or step(k, greedy, kv_len,
                                                                                                      carried)
    spec.model.logits = lambda hidden=None, **kw: (head_reads.append(1) if hidden is spec.stepper.pick_rows
                                                   else None) or logits(hidden, **kw)

    def generate(tokens, params, carried_first: bool) -> list[int]:
        before = len(steps)
        out = list(spec.generate(tokens, params, stop_token_ids=[]))
        mine = steps[before:]
        assert mine[0][1] == carried_first, mine
        for (previous, _), (_, carried) in zip(mine, mine[1:]):
            assert carried == (previous > 0), mine        # carried exactly after a step with drafts
        assert len(head_reads) == sum(not carried for _, carried in steps), "a carried step read the LM head"
        return out

    spec.reset()
    spec.ingest(prompt)
    got = generate(20, sampling, carried_first=False)
    spec.snapshot("at20")
    got += generate(10, sampling, carried_first=steps[-1][0] > 0)      # same boundary, same sampling
    spec.restore("at20")                                                # the same state, but restored
    assert generate(10, sampling, carried_first=False) == want[20:30]
    got += generate(10, sampling, carried_first=steps[-1][0] > 0)
    assert got == want
    assert sum(carried for _, carried in steps) >= 5, steps
    other = SamplingParams(temperature=0.5) if sampling is None else None
    generate(3, other, carried_first=False)                             # another sampling
    spec.reseed(5)
    generate(3, other, carried_first=False)                             # another draw


def test_capsules_move_between_speculation_on_and_off(trained, tmp_path):
    """The two decode plans share the state's layout, so a capsule file taken with drafts on (between two tokens of
    a step) restores byte for byte into an engine with them off, and one taken with them off into the engine with
    them on; each then decodes by its own plan, repeatably (and, greedy on this model, the tokens the source would
    have produced: a check, not the oracle). A capsule of another model is still refused."""
    folder, _ = trained
    spec, plain = (engine(folder, k, capsule_dir=str(tmp_path)) for k in (4, 0))
    assert (plain.plan, spec.plan) == (PLAN_VERSION, SPECULATIVE_PLAN_VERSION) and plain.fingerprint != spec.fingerprint
    prompt = prompts(folder, plain, 1, 40)[0]
    for source, target, capsule_id in ((spec, plain, "on"), (plain, spec, "off")):
        source.reset()
        source.ingest(prompt)
        stream = source.generate(20, stop_token_ids=[])
        [next(stream) for _ in range(5)]
        source.snapshot(capsule_id)
        rest = list(stream)
        source.export_capsule(capsule_id)
        target.reset()
        target.ingest(prompt[:17])
        assert target.import_capsule(capsule_id).position == source.capsule(capsule_id).position
        target.restore(capsule_id)
        assert torch.equal(target.live_bytes(), source.capsule_bytes(capsule_id))
        continued = list(target.generate(15, stop_token_ids=[]))
        target.restore(capsule_id)
        assert list(target.generate(15, stop_token_ids=[])) == continued == rest
    foreign = Engine(EngineConfig(model="tiny", max_context=64, capsule_dir=str(tmp_path / "tiny")))
    foreign.ingest([1, 2, 3])
    foreign.snapshot("foreign")
    foreign.export_capsule("foreign")
    (tmp_path / "tiny" / "foreign.capsule").rename(tmp_path / "foreign.capsule")
    with pytest.raises(FlashRTError, match="another model or config") as err:
        plain.import_capsule("foreign")
    assert err.value.code == ErrorCode.FINGERPRINT_MISMATCH


def test_plain_engine_runs_mains_one_row_decode_step(trained):
    """speculative_tokens = 0 is main's plan: its fingerprint is the one-row plan's, and its decode leaves the
    arena's bytes of main's one-row step (the model run over one token per step, driven here by hand), greedy and
    sampled; the speculative plan has another fingerprint."""
    folder, _ = trained
    plain, by_hand = engine(folder, 0), engine(folder, 0)
    assert plain.plan == PLAN_VERSION == "flashrt-plan-2"     # main's plan: capsules of main stay valid
    assert plain.fingerprint == by_hand.fingerprint != engine(folder, 2).fingerprint
    prompt = prompts(folder, plain, 1, 30)[0]
    for sampling in (None, SAMPLED):
        tokens = run(plain, prompt, 12, sampling)[0]
        by_hand.reset()
        by_hand.ingest(prompt)
        by_hand.sampler.configure(sampling or SamplingParams())
        model, arena, buffer = by_hand.model, by_hand.arena, torch.zeros(1, dtype=torch.int64)
        for want in tokens:
            logits = model.logits()
            buffer.copy_(by_hand.sampler.sample(logits, arena["meta"]) if sampling else logits.argmax(-1, keepdim=True))
            assert int(buffer) == want
            model.forward(buffer, by_hand._kv_bucket(int(arena["meta"][POSITION]) + 1))
        assert torch.equal(plain.arena.storage, arena.storage)


def test_speculative_tokens_is_checked():
    for bad in (-1, 5):
        with pytest.raises(FlashRTError, match="speculative_tokens") as err:
            EngineConfig(speculative_tokens=bad).validate()
        assert err.value.code == ErrorCode.INVALID_ARGUMENT


class SpeculationAgainstOracle(RuleBasedStateMachine):
    """Steps with drafts interleaved with snapshot / restore / fork / rollback / a capsule taken between two tokens
    of one step, on a speculative engine and on the oracle (an engine of the same plan fed one token per generate
    call: no drafts), the model: after every rule the tokens and the live bytes agree."""
    folder = None

    @initialize()
    def start(self):
        self.spec, self.oracle = engine(self.folder, 3), engine(self.folder, 1)
        prompt = prompts(self.folder, self.oracle, 1, 16)[0]
        for e in (self.spec, self.oracle):
            e.ingest(prompt)
        self.ids: list[str] = []
        self.check()

    def check(self):
        assert self.spec.position == self.oracle.position
        assert torch.equal(self.spec.live_bytes(), self.oracle.live_bytes())

    def both(self, call):
        results = [call(e) for e in (self.spec, self.oracle)]
        assert results[0] == results[1]
        self.check()
        return results[0]

    @precondition(lambda self: 0 < self.spec.position < 400)
    @rule(tokens=st.integers(1, 9), sampled=st.booleans())
    def generate(self, tokens, sampled):
        sampling = SAMPLED if sampled else None
        self.both(lambda e: list(self.stream(e, tokens, sampling)))

    def stream(self, e: Engine, tokens: int, sampling=None):
        if e is self.oracle:
            return undrafted(e, tokens, sampling)
        return e.generate(tokens, sampling, stop_token_ids=[])

    @precondition(lambda self: 0 < self.spec.position < 400)
    @rule(before=st.integers(1, 6), after=st.integers(0, 6), restore=st.booleans())
    def capsule_inside_a_step(self, before, after, restore):
        """Take ``before`` tokens, snapshot between two tokens (inside a step of the speculative engine), maybe
        restore it (the generation then goes on from the restored state), take ``after`` more."""
        capsule_id = f"c{len(self.ids)}"
        streams = [self.stream(e, before + after) for e in (self.spec, self.oracle)]
        heads = [[next(s) for _ in range(before)] for s in streams]
        assert heads[0] == heads[1]
        self.both(lambda e: e.snapshot(capsule_id).position)
        self.ids.append(capsule_id)
        if restore:
            self.both(lambda e: e.restore(capsule_id).position)
        tails = [list(s) for s in streams]
        assert tails[0] == tails[1]
        self.check()

    @precondition(lambda self: self.ids)
    @rule(data=st.data())
    def restore(self, data):
        capsule_id = data.draw(st.sampled_from(self.ids))
        self.both(lambda e: e.restore(capsule_id).position)

    @precondition(lambda self: self.ids)
    @rule(data=st.data())
    def fork_and_switch(self, data):
        source = data.draw(st.sampled_from(self.ids))
        new_id = f"f{len(self.ids)}"
        self.both(lambda e: e.fork(source, new_id, switch=True).position)
        self.ids.append(new_id)

    @rule(steps=st.integers(1, 4))
    def rollback(self, steps):
        def back(e):
            try:
                return e.rollback(steps=steps)
            except FlashRTError as err:
                return err.code
        self.both(back)


@pytest.mark.timeout(900)
def test_speculation_against_its_plan_without_drafts_stateful(trained):
    SpeculationAgainstOracle.folder = trained[0]
    SpeculationAgainstOracle.TestCase.settings = settings(
        max_examples=6, stateful_step_count=8, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    SpeculationAgainstOracle.TestCase().runTest()


def test_session_preempts_and_resumes_a_speculative_stream_and_reports_its_figures(trained):
    """The node's Session on a speculative engine: a request preempted between two tokens of a step and resumed
    gives the oracle's tokens, and each result carries the request's acceptance rate and tokens per step."""
    from flashrt_ros.discretiser import Discretiser
    from flashrt_ros.session import PRIORITY_URGENT, ObservationInput, Session

    folder, _ = trained
    oracle, spec = engine(folder, 1), engine(folder, 3)
    prompt = prompts(folder, oracle, 2, 30)
    want = run_undrafted(oracle, prompt[0], 24)[0]

    def finish(generation):
        while generation.step():
            pass
        return generation.outcome.result()

    session = Session(spec, discretiser=Discretiser(bins=8, token_offset=0), emit=lambda _: None,
                      stream_chunk_tokens=4)
    first = session.observe(ObservationInput(token_ids=prompt[0], max_new_tokens=24))
    for _ in range(2):                 # two chunks of 4: token 8 is inside a step of 1 + 3 drafts at most
        first.step()
    finish(session.observe(ObservationInput(token_ids=prompt[1][:5], max_new_tokens=3, priority=PRIORITY_URGENT)))
    interrupted = first.outcome.result()
    session.resume()
    resumed = finish(session.active)
    assert interrupted.token_ids + resumed.token_ids == want
    assert resumed.tokens_per_step > 1 and 0 < resumed.acceptance_rate <= 1
    stats = spec.generation_stats
    assert (resumed.acceptance_rate, resumed.tokens_per_step) == (stats.acceptance_rate, stats.tokens_per_step)


def test_a_constraint_without_an_end_of_sequence_token_is_refused_on_either_plan(trained):
    """Constraints run on both plans (test_speculative_constraint.py); this trained model declares no
    end-of-sequence token, which a completed constrained output needs: refused on each plan before anything
    changes."""
    folder, _ = trained
    for k in (2, 0):
        e = engine(folder, k)
        e.ingest(prompts(folder, e, 1, 20)[0])
        before = e.live_bytes()
        with pytest.raises(FlashRTError) as no_eos:
            e.compile_constraint("json_schema", '{"type": "integer"}')
        assert no_eos.value.code == ErrorCode.INVALID_ARGUMENT and "end-of-sequence" in no_eos.value.message
        assert e.constraint is None and torch.equal(e.live_bytes(), before)


def test_a_draft_vocabulary_changes_the_drafts_and_nothing_else(trained, tmp_path, monkeypatch):
    """draft_vocab N: every draft is among the first N token ids (the head reads only those rows of the LM head),
    the tokens and the live state after every token are the oracle's, the acceptance differs from full-vocabulary
    drafts, and the fingerprint is the same, so a capsule taken with one draft vocabulary continues identically
    under another."""
    folder, _ = trained
    oracle = engine(folder, 1)
    prompt = prompts(folder, oracle, 1, 20)[0]
    want = run_undrafted(oracle, prompt, 24)
    drafts_seen = []
    real_draft = Stepper._draft

    def recording_draft(self, k, kv_len):
        real_draft(self, k, kv_len)
        drafts_seen.extend(self.tokens[1:k + 1].tolist())
    monkeypatch.setattr(Stepper, "_draft", recording_draft)
    full = engine(folder, 2)
    assert_same_stream(run(full, prompt, 24), want)
    full_drafts, drafts_seen[:] = list(drafts_seen), []
    narrow = engine(folder, 2, draft_vocab=64, capsule_dir=str(tmp_path))
    assert narrow.fingerprint == full.fingerprint
    assert_same_stream(run(narrow, prompt, 24), want)
    assert drafts_seen and max(drafts_seen) < 64 and max(full_drafts) >= 64   # the text's ids reach past 64
    assert narrow.speculative_stats.accepted != full.speculative_stats.accepted

    narrow.reset()
    narrow.ingest(prompt)
    head = list(narrow.generate(7, stop_token_ids=[]))
    narrow.snapshot("mid")
    narrow.export_capsule("mid")
    wide = engine(folder, 3, capsule_dir=str(tmp_path))
    wide.import_capsule("mid")
    wide.restore("mid")
    assert head + list(wide.generate(24 - 7, stop_token_ids=[])) == want[0]


def test_draft_vocab_is_checked(trained):
    folder, _ = trained
    with pytest.raises(FlashRTError) as negative:
        EngineConfig(draft_vocab=-1).validate()
    with pytest.raises(FlashRTError) as too_large:
        engine(folder, 1, draft_vocab=321)
    assert negative.value.code == too_large.value.code == ErrorCode.INVALID_ARGUMENT
    assert "draft_vocab" in negative.value.message and "320" in too_large.value.message
