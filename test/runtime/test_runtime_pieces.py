"""How a prefill is cut into pieces, and why padding a small piece to its bucket changes nothing.

A small piece runs as one fixed-shape bucket (one CUDA-graph replay); the padding rows must leave the arena
byte-identical to running the real tokens alone, or capsules would depend on the bucket a suffix happened to use.
"""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from flashrt_ros.runtime import Engine, EngineConfig
from flashrt_ros.runtime.engine import _piece_bucket, _pieces
from flashrt_ros.runtime.model import PIECE_BUCKET, SMALL_PIECE
from flashrt_ros.tools.verify import prompt_tokens


@given(count=st.integers(0, 5000), chunk_log2=st.integers(0, 12))
def test_pieces_cover_the_prompt_with_at_most_one_small_piece_last(count, chunk_log2):
    chunk = 1 << chunk_log2
    pieces = _pieces(count, chunk)
    assert sum(pieces) == count
    assert all(0 < p <= chunk for p in pieces)
    partial = [i for i, p in enumerate(pieces) if p % min(chunk, SMALL_PIECE)]
    assert partial in ([], [len(pieces) - 1])                     # only the tail is a partial piece
    eager = [p for p in pieces if p > SMALL_PIECE]
    assert all(p == chunk or p % SMALL_PIECE == 0 for p in eager)  # long pieces fold on whole delta-rule chunks
    assert _pieces(count, chunk) == pieces                         # a function of the length alone


@pytest.mark.parametrize("length", range(1, SMALL_PIECE + 1))
def test_piece_bucket_is_the_next_multiple_of_the_bucket_step(length):
    bucket = _piece_bucket(length)
    assert bucket % PIECE_BUCKET == 0 and length <= bucket < length + PIECE_BUCKET


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(model="tiny", max_context=512, prefill_chunk=64, capsule_budget_bytes=64 << 20))


def _run_bucket(engine, real, pad, start_bytes):
    """The arena storage after one small piece of ``real`` tokens padded with ``pad``, from ``start_bytes``."""
    engine.arena.storage.copy_(start_bytes)
    tokens = torch.tensor(real + pad, dtype=torch.int64)
    count = torch.tensor(len(real), dtype=torch.int64)
    with torch.inference_mode():
        engine.model.forward(tokens, engine._kv_bucket(engine.position + len(tokens)), count=count)
    return engine.arena.storage.clone()


@settings(max_examples=12, deadline=None)
@given(prefix_len=st.integers(1, 200), length=st.integers(1, SMALL_PIECE - 1), salt=st.integers(0, 1000))
def test_padding_rows_are_inert(engine, prefix_len, length, salt):
    """Whatever the padding tokens are, the whole arena (live and stale bytes alike) ends byte-identical: no padding
    row reaches any state buffer, the position, the last token or the hidden state."""
    engine.reset()
    engine.ingest(prompt_tokens(engine.vocab_size, prefix_len, f"prefix-{salt}"))
    start = engine.arena.storage.clone()
    real = prompt_tokens(engine.vocab_size, length, f"suffix-{salt}")
    pad_len = _piece_bucket(length) - length + PIECE_BUCKET       # also pad past the bucket the engine would use
    zeros = _run_bucket(engine, real, [0] * pad_len, start)
    noise = _run_bucket(engine, real, prompt_tokens(engine.vocab_size, pad_len, f"pad-{salt}"), start)
    assert torch.equal(zeros, noise)
    assert engine.arena.position() == prefix_len + length          # the model ran behind the engine's back


@settings(max_examples=12, deadline=None)
@given(prefix_len=st.integers(1, 200), length=st.integers(1, SMALL_PIECE - 1), salt=st.integers(0, 1000))
def test_a_padded_piece_computes_what_the_unpadded_piece_computes(engine, prefix_len, length, salt):
    """Against the same tokens run at their exact length: equal state, up to the GEMM library's rounding. (A GEMM's
    rows may round differently for a different row count: MKL and cuBLAS pick kernels by shape, so bytes can differ
    here. Byte-exactness comes from every path running a given piece in the same bucket, see _pieces.)"""
    engine.reset()
    engine.ingest(prompt_tokens(engine.vocab_size, prefix_len, f"prefix-{salt}"))
    before = engine.arena.storage.clone()
    suffix = prompt_tokens(engine.vocab_size, length, f"suffix-{salt}")
    engine.ingest(suffix)                                          # one padded small piece
    padded = {name: engine.arena[name].clone() for name in engine.arena.specs}
    engine.arena.storage.copy_(before)
    with torch.inference_mode():
        engine.model.forward(torch.tensor(suffix, dtype=torch.int64), engine._kv_bucket(prefix_len + length))
    for name, value in padded.items():
        torch.testing.assert_close(engine.arena[name], value, rtol=1e-4, atol=2e-5)
