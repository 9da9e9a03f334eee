"""Capsule files as an attacker tries them: every header field is authenticated, payload edits that a linear
checksum misses are caught (by the file digest and by the device checksum), forged files are refused when a key is
configured, sizes are checked before anything is allocated, and a killed writer never leaves a visible half-file."""
import dataclasses
import json
import os
import signal
import struct
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capsule_helpers import assemble, flip_capsule_byte, split
from flashrt_ros.runtime import Engine, ErrorCode, FlashRTError
from flashrt_ros.runtime.capsule import file as capsule_file
from flashrt_ros.runtime import checksum as checksum_module
from flashrt_ros.runtime.checksum import checksum
from test_runtime_capsules import CONFIG, PROMPT, greedy, refused

KEY = b"k" * 32


def make_engine(folder, **overrides) -> Engine:
    return Engine(dataclasses.replace(CONFIG, capsule_dir=str(folder), **overrides))


@pytest.fixture
def engine(tmp_path):
    eng = make_engine(tmp_path)
    eng.ingest(PROMPT)
    eng.snapshot("s", label="grasp")
    return eng


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("key") / "capsule.key"
    path.write_bytes(KEY)
    return path


# ---- the file as a forger sees it ---------------------------------------------------------------------------

def edit_header(blob: bytes, **info) -> bytes:
    """The same file with info fields changed and its digests kept (not recomputed)."""
    header, payload = split(blob)
    header["info"].update(info)
    encoded = json.dumps(header).encode()
    tag = capsule_file._TAG_BYTES
    header_tag_at = len(blob) - tag - len(payload) - tag
    return (capsule_file._PRELUDE.pack(capsule_file._MAGIC, capsule_file._VERSION, len(encoded)) + encoded
            + blob[header_tag_at:])


def refused_file(engine, capsule_id, code=ErrorCode.CHECKSUM_MISMATCH, says=""):
    with refused(engine, code) as error:
        engine.import_capsule(capsule_id)
    assert says in error.value.message
    return error.value


# ---- round trip -------------------------------------------------------------------------------------------------

def test_round_trip_into_a_fresh_engine_is_byte_exact_and_token_identical(engine, tmp_path):
    continuation = greedy(engine, 6)
    assert engine.export_capsule("s") == engine.capsule("s")
    assert capsule_file.capsule_file_ids(tmp_path) == ["s"]
    assert [p.name for p in tmp_path.iterdir()] == ["s.capsule"], "no temporary file left behind"
    info, fingerprint = capsule_file.read_capsule_header(tmp_path / "s.capsule")
    assert (info.id, info.label, info.position, info.tier, fingerprint) == (
        "s", "grasp", len(PROMPT), "disk", engine.fingerprint)
    fresh = make_engine(tmp_path)
    imported = fresh.import_capsule("s")
    original = engine.capsule("s")
    assert (imported.id, imported.label, imported.created, imported.checksum, imported.nbytes) == (
        original.id, original.label, original.created, original.checksum, original.nbytes)
    assert torch.equal(fresh.capsule_bytes("s"), engine.capsule_bytes("s"))
    fresh.restore("s", verify_checksum=True)
    assert greedy(fresh, 6) == continuation


# ---- header edits -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [("label", "release"), ("parent", "root"), ("created", 1.0),
                                          ("id", "other"), ("checksum", "0" * 32), ("position", 3)])
def test_an_edited_header_field_is_refused(engine, tmp_path, field, value):
    engine.export_capsule("s")
    engine.drop("s")
    path = tmp_path / "s.capsule"
    path.write_bytes(edit_header(path.read_bytes(), **{field: value}))
    refused_file(engine, "s", says="does not match its digest")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.floats(0, 1, exclude_max=True), mask=st.integers(1, 255))
def test_any_flipped_bit_anywhere_in_the_file_is_refused(engine, tmp_path, where, mask):
    path = tmp_path / "s.capsule"
    if not path.exists():
        engine.export_capsule("s")
        engine.drop("s")
    blob = bytearray(path.read_bytes())
    good = bytes(blob)
    blob[int(where * len(blob))] ^= mask
    path.write_bytes(bytes(blob))
    with refused(engine, ErrorCode.CHECKSUM_MISMATCH):
        engine.import_capsule("s")
    path.write_bytes(good)


# ---- the chosen 3-word edit that a linear sum misses ----------------------------------------------------------

def linear_sum(data: torch.Tensor) -> tuple[int, int]:
    """The checksum capsules had before (sum of c_i * w_i and sum of w_i over int32 words)."""
    words = [int(w) for w in data.view(torch.int32)]
    return (sum(w * ((((i * 2654435761) & 0xFFFFFF) | 1)) for i, w in enumerate(words)) % 2**64,
            sum(words) % 2**64)


def three_word_edit(data: torch.Tensor) -> dict[int, int]:
    """{word index: new int32 value} for 3 words whose edit leaves :func:`linear_sum` unchanged: deltas d with
    sum(d) = 0 and sum(c * d) = 0, i.e. d_a = c_b - c_c, d_b = c_c - c_a, d_c = c_a - c_b."""
    words = data.view(torch.int32)
    mult = lambda i: (((i * 2654435761) & 0xFFFFFF) | 1)  # noqa: E731
    for a in range(1, words.numel() - 2):
        b, c = a + 1, a + 2
        for sign in (1, -1):
            deltas = {a: mult(b) - mult(c), b: mult(c) - mult(a), c: mult(a) - mult(b)}
            edit = {i: int(words[i]) + sign * d for i, d in deltas.items()}
            if all(-2**31 <= v < 2**31 for v in edit.values()) and any(deltas.values()):
                return edit
    raise AssertionError("no word triple fits in int32")


def apply_edit(data: torch.Tensor, edit: dict[int, int]) -> torch.Tensor:
    edited = data.clone()
    for index, value in edit.items():
        edited.view(torch.int32)[index] = value
    return edited


def test_the_chosen_three_word_edit_defeats_a_linear_sum_but_not_the_checksum_or_the_file(engine, tmp_path):
    data = engine.capsule_bytes("s")
    edit = three_word_edit(data)
    edited = apply_edit(data, edit)
    assert not torch.equal(edited, data)
    assert linear_sum(edited) == linear_sum(data), "the attack works against the old linear sum"
    assert checksum(edited) != checksum(data)

    engine.export_capsule("s")            # in the file: the digest refuses it (header untouched)
    path = tmp_path / "s.capsule"
    header, payload = split(path.read_bytes())
    blob = path.read_bytes()
    start = len(blob) - len(payload) - 32
    path.write_bytes(blob[:start] + edited.numpy().tobytes() + blob[-32:])
    engine.drop("s")
    refused_file(engine, "s", says="payload does not match its digest")
    # with the digest recomputed over the edited payload, the header's device checksum still refuses it (a forger
    # can recompute that too: only a key stops one, see the forged-file tests)
    path.write_bytes(assemble(header, edited.numpy().tobytes()))
    refused_file(engine, "s", says="device checksum")

    engine.ingest([1])                    # in memory: verify_checksum refuses it
    engine.snapshot("m")
    before = engine.capsule_bytes("m")
    for index, value in three_word_edit(before).items():
        for k, (old, new) in enumerate(zip(struct.pack("<i", int(before.view(torch.int32)[index])),
                                           struct.pack("<i", value))):
            if old != new:
                flip_capsule_byte(engine, "m", 4 * index + k, old ^ new)
    assert linear_sum(engine.capsule_bytes("m")) == linear_sum(before)
    with refused(engine, ErrorCode.CHECKSUM_MISMATCH):
        engine.restore("m", verify_checksum=True)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(min_size=4, max_size=512),
       edits=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(-2**31, 2**31 - 1)),
                      min_size=2, max_size=8))
def test_random_multi_word_edits_change_the_checksum(data, edits):
    original = torch.frombuffer(bytearray(data[:len(data) // 4 * 4]), dtype=torch.uint8)
    edited = apply_edit(original, {int(where * (original.numel() // 4)): value for where, value in edits})
    assert torch.equal(edited, original) or checksum(edited) != checksum(original)


def reference_checksum(data: bytes) -> str:
    """checksum.py's definition in Python integers (pins the wrapping int64 arithmetic of the torch path)."""
    mask, m, length = (1 << 64) - 1, checksum_module, len(data)
    data += bytes(-length % 4)
    s1 = s2 = 0
    for i in range(len(data) // 4):
        z = ((i * m._GOLDEN + int.from_bytes(data[4 * i:4 * i + 4], "little", signed=True)) * m._MIX1) & mask
        z = ((z ^ (z >> 32)) * m._MIX2) & mask
        z ^= z >> 29
        s1, s2 = s1 + z, s2 + z * z
    return f"{s1 & mask:016x}{(s2 + length) & mask:016x}"


@pytest.mark.parametrize("size", [0, 1, 6, 64, 1001])
def test_the_checksum_is_its_definition_in_any_number_of_chunks(size, monkeypatch):
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(size))
    assert checksum(data) == reference_checksum(bytes(data.tolist()))
    monkeypatch.setattr(checksum_module, "_CHUNK_WORDS", 5)
    assert checksum(data) == checksum_module.checksum_torch(data)


@settings(max_examples=40, deadline=None)
@given(data=st.binary(max_size=200), cuts=st.lists(st.integers(0, 200), max_size=6), odd_offset=st.booleans())
def test_the_checksum_of_parts_is_the_checksum_of_their_concatenation(data, cuts, odd_offset):
    """Parts of any lengths (not word multiples, empty ones, views at odd byte offsets) checksum as one buffer."""
    whole = torch.tensor(list(b"x" * odd_offset + data), dtype=torch.uint8)[int(odd_offset):]
    bounds = sorted({0, len(data), *(min(c, len(data)) for c in cuts)})
    parts = [whole[lo:hi] for lo, hi in zip(bounds, bounds[1:])] + [whole[:0]]
    assert checksum(parts) == checksum(whole) == reference_checksum(data)


def test_the_checksum_covers_the_length():
    data = torch.tensor([1, 2, 3], dtype=torch.uint8)
    assert checksum(data) != checksum(torch.tensor([1, 2, 3, 0], dtype=torch.uint8))


# ---- forged files and keys ------------------------------------------------------------------------------------

@pytest.fixture
def forged(tmp_path):
    """A capsule of another model (other weights seed) whose fingerprint field is rewritten to this engine's and
    whose digests are recomputed: what a forger without the key can make."""
    other = make_engine(tmp_path / "other", seed=1)
    other.ingest(PROMPT)
    other.snapshot("f")
    other.export_capsule("f")

    def make(target: Engine, signing_key: bytes | None = None):
        header, payload = split((tmp_path / "other" / "f.capsule").read_bytes())
        header["fingerprint"] = target.fingerprint
        header["auth"] = "hmac-sha256" if signing_key else "sha256"
        target.capsule_file("f").write_bytes(assemble(header, payload, signing_key))
        return other
    return make


def test_without_a_key_a_forged_file_imports_and_restores(engine, forged):
    """The documented limit: without capsule_key_file, the digest cannot tell a forgery from a real file."""
    other = forged(engine)
    engine.import_capsule("f")
    engine.restore("f")
    assert torch.equal(engine.live_bytes(), other.capsule_bytes("f"))


def test_with_a_key_a_forged_file_is_refused(tmp_path, key_file, forged):
    engine = make_engine(tmp_path, capsule_key_file=str(key_file))
    forged(engine)
    refused_file(engine, "f", says="not signed")
    forged(engine, signing_key=b"x" * 32)
    refused_file(engine, "f", says="another key")


def test_signed_files_move_between_engines_with_the_same_key_only(tmp_path, key_file):
    signer = make_engine(tmp_path, capsule_key_file=str(key_file))
    signer.ingest(PROMPT)
    signer.snapshot("s")
    signer.export_capsule("s")
    assert split((tmp_path / "s.capsule").read_bytes())[0]["auth"] == "hmac-sha256"
    refused_file(make_engine(tmp_path), "s", says="none configured")
    other_key = tmp_path / "other.key"
    other_key.write_bytes(b"y" * 32)
    refused_file(make_engine(tmp_path, capsule_key_file=str(other_key)), "s", says="another key")
    reader = make_engine(tmp_path, capsule_key_file=str(key_file))
    reader.import_capsule("s")
    reader.restore("s", verify_checksum=True)
    foreign = make_engine(tmp_path / "foreign", seed=1, capsule_key_file=str(key_file))
    (tmp_path / "foreign" / "s.capsule").write_bytes((tmp_path / "s.capsule").read_bytes())
    refused_file(foreign, "s", ErrorCode.FINGERPRINT_MISMATCH)


@pytest.mark.parametrize("content, says", [(None, "cannot be read"), (b"", "holds 0 bytes"),
                                           (b"short", "at least")])
def test_an_unusable_key_file_fails_the_engine(tmp_path, content, says):
    path = tmp_path / "key"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(FlashRTError) as error:
        make_engine(tmp_path, capsule_key_file=str(path))
    assert error.value.code == ErrorCode.INVALID_ARGUMENT and says in error.value.message


def test_a_capsule_dir_that_is_a_file_fails_the_engine(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(FlashRTError) as error:
        make_engine(tmp_path / "file")
    assert error.value.code == ErrorCode.INVALID_ARGUMENT and "capsule_dir" in error.value.message


# ---- sizes, truncation, old formats -------------------------------------------------------------------------

def test_truncated_extended_and_foreign_files_are_refused(engine, tmp_path):
    engine.export_capsule("s")
    engine.drop("s")
    path = tmp_path / "s.capsule"
    blob = path.read_bytes()
    for damaged, says in [(blob[:-1], "truncated or extended"), (blob + b"\0", "truncated or extended"),
                          (blob[:capsule_file._PRELUDE.size + 5], "ends inside its header"),
                          (blob[:10], "ends inside its prelude"), (b"", "ends inside its prelude"),
                          (b"GIF89a" + blob[6:], "not a flashrt capsule file"),
                          (blob[:16] + struct.pack("<I", 3) + blob[20:], "unknown format version 3"),
                          (assemble(b"[" * 8000 + b"]" * 8000, b""), "header: not JSON"),
                          (assemble(b"\xff{}", b""), "header: not JSON"),
                          (assemble(b"[]", b""), "exactly the fields"),
                          (assemble(b"x" * (capsule_file.MAX_HEADER_BYTES + 1), b""), "more than")]:
        path.write_bytes(damaged)
        refused_file(engine, "s", says=says)


def test_a_version_1_file_is_refused_with_the_reason(engine, tmp_path):
    header = json.dumps({"info": dataclasses.asdict(engine.capsule("s")), "fingerprint": engine.fingerprint})
    payload = engine.capsule_bytes("s").numpy().tobytes()
    engine.drop("s")
    (tmp_path / "s.capsule").write_bytes(struct.pack("<16sIQ", capsule_file._MAGIC, 1, len(header))
                                         + header.encode() + payload)
    refused_file(engine, "s", says="version 1 is unauthenticated")


def test_a_header_whose_size_lies_is_refused_before_reading_the_payload(engine, tmp_path):
    engine.export_capsule("s")
    engine.drop("s")
    path = tmp_path / "s.capsule"
    header, payload = split(path.read_bytes())
    for info, says in [({"position": header["info"]["position"] + 9}, "does not match its position"),
                       ({"nbytes": len(payload) - 4}, "does not match its position"),
                       ({"position": CONFIG.max_context + 1}, "does not match its position")]:
        lying = {**header, "info": {**header["info"], **info}}
        path.write_bytes(assemble(lying, payload[:lying["info"]["nbytes"]]))
        refused_file(engine, "s", says=says)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_capsule_round_trips_through_the_host_staging_buffer(tmp_path, monkeypatch):
    monkeypatch.setattr(capsule_file, "CHUNK_BYTES", 4096 + 3)      # many chunks and a partial last one
    engine, fresh = (make_engine(tmp_path, device="cuda", dtype="bfloat16") for _ in range(2))
    engine.ingest(PROMPT)
    engine.snapshot("s")
    continuation = greedy(engine, 6)
    engine.export_capsule("s")
    assert fresh.import_capsule("s").tier == "device"
    assert torch.equal(fresh.capsule_bytes("s").cpu(), engine.capsule_bytes("s").cpu())
    fresh.restore("s", verify_checksum=True)
    assert greedy(fresh, 6) == continuation


RSS_SCRIPT = textwrap.dedent("""
    import json, os, resource, sys
    from capsule_helpers import assemble, split
    from test_runtime_capsules import CONFIG, PROMPT
    import dataclasses
    from flashrt_ros.runtime import Engine, EngineConfig, FlashRTError
    folder = sys.argv[1]
    engine = Engine(dataclasses.replace(CONFIG, capsule_dir=folder))
    engine.ingest(PROMPT)
    engine.snapshot("s")
    engine.export_capsule("s")
    engine.drop("s")
    header, payload = split(open(os.path.join(folder, "s.capsule"), "rb").read())
    results = []
    for lie in ({"nbytes": 2 << 30}, {"nbytes": 2 << 30, "position": (2 << 30) // 3}):
        info = {**header["info"], **lie}
        blob = assemble({**header, "info": info}, b"")
        with open(os.path.join(folder, "s.capsule"), "wb") as f:   # sparse: the declared size, mostly a hole
            f.write(blob[:-32])
            f.truncate(len(blob) - 32 + info["nbytes"] + 32)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            engine.import_capsule("s")
            results.append(None)
        except FlashRTError as err:
            results.append([err.code.name, err.message,
                            (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024])
    print(json.dumps(results))
""")


def test_a_huge_sparse_file_with_a_lying_header_is_refused_with_bounded_memory(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                         env=env, timeout=120, check=True)
    results = json.loads(out.stdout.strip().splitlines()[-1])
    for code, message, grown in results:
        assert code == "CHECKSUM_MISMATCH" and "does not match its position" in message
        assert grown < 64 << 20, f"refusing a 2 GiB file cost {grown / 2**20:.0f} MiB"


# ---- crash safety ---------------------------------------------------------------------------------------------

def killed_while_writing(engine, capsule_id: str, stage: str) -> None:
    """Write the capsule's file in a forked child that blocks at ``stage`` ('payload': after its first payload chunk, 'fsync':
    before the rename) and tells the parent so through a pipe; the parent then SIGKILLs it."""
    ready_r, ready_w = os.pipe()
    block_r, block_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        try:
            os.close(ready_r)

            def block():
                os.write(ready_w, b"x")
                os.read(block_r, 1)                 # nobody ever writes: blocks until killed

            if stage == "payload":
                chunks = capsule_file._payload_chunks

                def stalled(data):
                    it = chunks(data)
                    yield next(it)
                    block()
                    yield from it
                capsule_file._payload_chunks = stalled
                capsule_file.CHUNK_BYTES = 64
            else:
                os.fsync = lambda fd: block()
            capsule_file.write_capsule_file(engine.store.full_capsule(capsule_id), engine.capsule_file(capsule_id))
        finally:
            os._exit(1)
    os.close(ready_w)
    assert os.read(ready_r, 1) == b"x", "the writer died before it blocked"
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    for fd in (ready_r, block_r, block_w):
        os.close(fd)


@pytest.mark.parametrize("stage", ["payload", "fsync"])
def test_a_writer_killed_mid_write_leaves_no_visible_file(engine, tmp_path, stage):
    killed_while_writing(engine, "s", stage)
    assert capsule_file.capsule_file_ids(tmp_path) == []
    leftovers = [p.name for p in tmp_path.iterdir()]
    assert leftovers and all(name.startswith(".s.capsule.") for name in leftovers), leftovers
    with refused(engine, ErrorCode.UNKNOWN_CAPSULE):
        engine.import_capsule("s")


def test_a_writer_killed_while_replacing_a_file_leaves_the_old_one_intact(engine, tmp_path):
    engine.export_capsule("s")
    old = (tmp_path / "s.capsule").read_bytes()
    engine.drop("s")
    engine.ingest([5, 6, 7])
    engine.snapshot("s")
    killed_while_writing(engine, "s", "payload")
    assert (tmp_path / "s.capsule").read_bytes() == old
    engine.drop("s")
    assert engine.import_capsule("s").position == len(PROMPT)


# ---- engine refusals ------------------------------------------------------------------------------------------

def test_export_and_import_refusals_change_nothing(engine, tmp_path):
    engine.export_capsule("s")
    blob = (tmp_path / "s.capsule").read_bytes()
    (tmp_path / "renamed.capsule").write_bytes(blob)
    files = sorted(tmp_path.iterdir())
    disabled = Engine(CONFIG)
    for call, code in [(lambda: disabled.export_capsule("s"), ErrorCode.NO_CAPSULE_DIR),
                       (lambda: disabled.import_capsule("s"), ErrorCode.NO_CAPSULE_DIR)]:
        with refused(disabled, code):
            call()
    for call, code in [(lambda: engine.export_capsule("nope"), ErrorCode.UNKNOWN_CAPSULE),
                       (lambda: engine.export_capsule("s"), ErrorCode.DUPLICATE_CAPSULE_ID),
                       (lambda: engine.export_capsule("../s"), ErrorCode.INVALID_CAPSULE_ID),
                       (lambda: engine.import_capsule("../s"), ErrorCode.INVALID_CAPSULE_ID),
                       (lambda: engine.import_capsule("nope"), ErrorCode.UNKNOWN_CAPSULE),
                       (lambda: engine.import_capsule("s"), ErrorCode.DUPLICATE_CAPSULE_ID),
                       (lambda: engine.import_capsule("renamed"), ErrorCode.INVALID_ARGUMENT)]:
        with refused(engine, code):
            call()
    assert sorted(tmp_path.iterdir()) == files
    tight = make_engine(tmp_path, capsule_budget_bytes=engine.capsule("s").nbytes - 1)
    with refused(tight, ErrorCode.BUDGET_EXCEEDED):
        tight.import_capsule("s")

