"""Capsule files carry the grammar matcher's state (issue 30): a capsule taken mid-constrained generation, exported
(or spilled to disk) and imported into another engine, or listed by a fresh engine after a restart, restores with
its matcher and continues token-identically; a file whose constraint does not rebuild is refused with
CHECKSUM_MISMATCH, nothing changed."""
import dataclasses
import json

import pytest

from capsule_helpers import assemble, split
from flashrt_ros.runtime import Engine, EngineConfig, ErrorCode, SamplingParams
from flashrt_ros.runtime.constraint import compile_grammar
from test_runtime_capsules import refused

CONFIG = EngineConfig(model="tiny", max_context=512, prefill_chunk=16, seed=3)
PROMPT = list(b"answer in JSON: ")
WARM = SamplingParams(temperature=1.0)
SCHEMA = json.dumps({"type": "object", "properties": {
    "plan": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 4},
    "speed": {"type": "integer", "minimum": 0, "maximum": 999}}, "required": ["plan", "speed"]})
KEY = b"q" * 32


def make_engine(folder, **overrides) -> Engine:
    return Engine(dataclasses.replace(CONFIG, capsule_dir=str(folder), **overrides))


def start(engine: Engine) -> None:
    engine.reset()
    engine.reseed(7)
    engine.ingest(PROMPT)
    engine.constrain(engine.compile_constraint("json_schema", SCHEMA))


def mid_capsule(engine: Engine, capsule_id: str = "mid", head_tokens: int = 9) -> tuple[list[int], list[int]]:
    """(tokens before the capsule, the uninterrupted rest), the capsule ``capsule_id`` taken between them."""
    start(engine)
    stream = engine.generate(300, WARM)
    head = [next(stream) for _ in range(head_tokens)]
    engine.snapshot(capsule_id)
    rest = list(stream)
    assert engine.constraint.stopped and len(rest) > 5
    return head, rest


def continues(engine: Engine, capsule_id: str, head: list[int], rest: list[int]) -> None:
    engine.reset()
    engine.ingest(list(b"another stream"))          # no live matcher: the capsule brings it back
    engine.restore(capsule_id)
    assert engine.constraint is not None and engine.constraint.tokens == head
    assert list(engine.generate(300, WARM)) == rest


def test_an_exported_capsule_restores_its_matcher_in_another_engine_and_after_a_restart(tmp_path):
    source = make_engine(tmp_path)
    head, rest = mid_capsule(source)
    source.export_capsule("mid")
    assert split((tmp_path / "mid.capsule").read_bytes())[0]["constraint"] == {
        "grammar": source.constraint.grammar, "tokens": head}
    other = make_engine(tmp_path / "elsewhere")
    (tmp_path / "elsewhere" / "mid.capsule").write_bytes((tmp_path / "mid.capsule").read_bytes())
    other.import_capsule("mid")
    continues(other, "mid", head, rest)
    restarted = make_engine(tmp_path)               # lists mid.capsule as a disk-tier capsule at start
    assert [c.id for c in restarted.capsules()] == ["mid"]
    continues(restarted, "mid", head, rest)


def test_a_spilled_capsule_keeps_its_matcher_across_a_restart(tmp_path):
    source = make_engine(tmp_path)
    head, rest = mid_capsule(source)
    source.spill("mid", "disk")
    continues(source, "mid", head, rest)
    source.spill("mid", "disk")
    source.close()
    continues(make_engine(tmp_path), "mid", head, rest)


def test_an_unconstrained_capsule_file_has_no_constraint_field(tmp_path):
    engine = make_engine(tmp_path)
    engine.ingest(PROMPT)
    engine.snapshot("plain")
    engine.export_capsule("plain")
    assert set(split((tmp_path / "plain.capsule").read_bytes())[0]) == {"auth", "fingerprint", "info"}


def forged(path, key=None, **constraint) -> None:
    """Rewrite a capsule file's constraint and recompute its digests (what anyone can do without the key)."""
    header, payload = split(path.read_bytes())
    header["constraint"].update(constraint)
    path.write_bytes(assemble(header, payload, key))


OTHER_GRAMMAR = compile_grammar("regex", "[0-9]{40}")


@pytest.mark.parametrize("edit, says", [
    ({"grammar": OTHER_GRAMMAR}, "does not rebuild"),             # a valid grammar that refuses the tokens
    ({"grammar": "not a grammar"}, "does not rebuild"),
    ({"tokens": [9999]}, "does not rebuild"),                        # outside tiny's vocabulary
    ({"tokens": "abc"}, "constraint tokens"),                         # caught by the header checks
])
def test_a_file_whose_constraint_does_not_rebuild_is_refused(tmp_path, edit, says):
    """An unsigned file's digest can be recomputed after an edit; its constraint is rebuilt before anything is
    read or stored (import), and again before a restore of a file listed at start: CHECKSUM_MISMATCH naming why,
    the store and the live state unchanged."""
    source = make_engine(tmp_path)
    mid_capsule(source)
    source.export_capsule("mid")
    forged(tmp_path / "mid.capsule", **edit)
    other = make_engine(tmp_path / "elsewhere")
    (tmp_path / "elsewhere" / "mid.capsule").write_bytes((tmp_path / "mid.capsule").read_bytes())
    start(other)
    live_tokens = list(other.generate(4, WARM))
    with refused(other, ErrorCode.CHECKSUM_MISMATCH) as err:
        other.import_capsule("mid")
    assert says in err.value.message and other.capsules() == [] and other.constraint.tokens == live_tokens
    restarted = make_engine(tmp_path)
    if "tokens" in edit and not isinstance(edit["tokens"], list):
        assert restarted.capsules() == [] and "constraint tokens" in restarted.capsule_dir_refused[0]
        return
    start(restarted)
    live_tokens = list(restarted.generate(4, WARM))
    with refused(restarted, ErrorCode.CHECKSUM_MISMATCH) as err:
        restarted.restore("mid")
    assert says in err.value.message and restarted.constraint.tokens == live_tokens


def test_a_signed_file_whose_constraint_was_edited_is_refused_by_its_header_tag(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY)
    source = make_engine(tmp_path / "caps", capsule_key_file=str(key_file))
    mid_capsule(source)
    source.export_capsule("mid")
    path = tmp_path / "caps" / "mid.capsule"
    forged(path, key=b"x" * 32, grammar=OTHER_GRAMMAR)               # re-signed with another key
    other = make_engine(tmp_path / "caps", capsule_key_file=str(key_file))
    assert other.capsules() == [] and "capsule key" in other.capsule_dir_refused[0]
    with refused(other, ErrorCode.CHECKSUM_MISMATCH) as err:
        other.import_capsule("mid")
    assert "capsule key" in err.value.message
