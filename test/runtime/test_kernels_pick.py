"""The greedy pick kernel against its reference (the masked fill + torch.argmax): the same token for every row.

Logits are drawn to make the pick hard: few distinct values (ties for the maximum, in one block and across blocks
of the first pass), masks that clear the maximum, rows with every token masked, NaN and inf logits, a vocabulary
that is not a multiple of 32 or of the kernel's block, row strides of a view. Without CUDA the kernel runs in Triton's
interpreter (conftest sets TRITON_INTERPRET=1); tests marked gpu run the 0.8B vocabulary on the device.
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashrt_ros.runtime import constraint
from flashrt_ros.runtime.kernels import pick
from flashrt_ros.runtime.kernels._layout import LayoutError
from flashrt_ros.runtime.kernels._triton import triton

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
needs_triton = pytest.mark.skipif(triton is None, reason="triton is not importable")
BLOCK = pick._BLOCK


def case(seed: int, rows: int, vocab: int, distinct: int, masked: float, specials: bool):
    """Logits [rows, vocab] (a column view of a wider buffer) with ``distinct`` values per row, mask words with a
    fraction ``masked`` of bits clear (row 0 all clear when rows > 2), and some NaN/inf logits with ``specials``."""
    g = torch.Generator().manual_seed(seed)
    buffer = torch.randint(0, distinct, (rows, vocab + 7), generator=g).float() - distinct / 2
    logits = buffer[:, 3:3 + vocab]
    if specials:
        spots = torch.randint(0, vocab, (rows, 2), generator=g)
        logits[torch.arange(rows), spots[:, 0]] = float("nan")
        logits[torch.arange(rows), spots[:, 1]] = float("inf")
    words = constraint.mask_words(vocab, torch.device("cpu"), rows)
    bits = torch.rand(rows, words.shape[1] * 32, generator=g) >= masked
    if rows > 2:
        bits[0] = False
    packed = (bits.view(rows, -1, 32).long() << torch.arange(32)).sum(-1)        # bit i of word w: token 32 w + i
    words.copy_(packed - (packed >= 1 << 31).long() * (1 << 32))                   # as int32 (two's complement)
    return logits.to(DEVICE), words.to(DEVICE), constraint.mask_lookup(vocab, DEVICE)


@needs_triton
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 5),
       vocab=st.sampled_from([1, 31, 33, BLOCK - 1, BLOCK + 1, 2 * BLOCK + 40]),
       distinct=st.sampled_from([1, 3, 1000]), masked=st.sampled_from([0.0, 0.5, 0.99]), specials=st.booleans())
def test_greedy_pick_triton_picks_the_references_token(seed, rows, vocab, distinct, masked, specials):
    logits, words, lookup = case(seed, rows, vocab, distinct, masked, specials)
    want = pick.greedy_pick(logits, words, lookup)
    got = pick.greedy_pick_triton(logits, words, lookup)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    masked_logits = pick.apply_mask(logits, words, lookup)
    nan_as_inf = torch.where(masked_logits.isnan(), float("inf"), masked_logits).argmax(-1)
    assert torch.equal(got, nan_as_inf), (got, nan_as_inf)      # the kernel's contract: a NaN counts as +inf
    assert specials or torch.equal(got, want), (got, want)        # without NaN, the reference's token


@needs_triton
def test_greedy_pick_triton_takes_the_first_of_tied_maxima_across_blocks():
    """The maximum in three blocks of the first pass, twice in the middle one: the earliest index wins, as in
    torch.argmax; masking it moves the pick to the next, masking every token picks 0."""
    vocab = 3 * BLOCK + 5
    logits = torch.zeros(1, vocab, device=DEVICE)
    for index in (2 * BLOCK + 9, BLOCK + 7, BLOCK + 3, 3 * BLOCK + 1):
        logits[0, index] = 5.0
    words = constraint.mask_words(vocab, DEVICE, 1)
    lookup = constraint.mask_lookup(vocab, DEVICE)
    assert int(pick.greedy_pick_triton(logits, words, lookup)[0]) == BLOCK + 3 == int(logits.argmax())
    words[0, (BLOCK + 3) // 32] &= ~(1 << ((BLOCK + 3) % 32))
    assert int(pick.greedy_pick_triton(logits, words, lookup)[0]) == BLOCK + 7
    words.zero_()
    assert int(pick.greedy_pick_triton(logits, words, lookup)[0]) == 0 == int(pick.greedy_pick(logits, words, lookup))


@needs_triton
def test_greedy_pick_triton_refuses_bad_layouts():
    logits = torch.zeros(2, 100, device=DEVICE)
    lookup = constraint.mask_lookup(100, DEVICE)
    with pytest.raises(LayoutError, match="words must be torch.int32"):
        pick.greedy_pick_triton(logits, constraint.mask_words(100, DEVICE, 2).long(), lookup)
    with pytest.raises(LayoutError, match=r"must be \[R, >= V / 32\]"):
        pick.greedy_pick_triton(logits, constraint.mask_words(100, DEVICE, 1), lookup)
    with pytest.raises(LayoutError, match="unit stride"):
        pick.greedy_pick_triton(logits.t().contiguous().t(), constraint.mask_words(100, DEVICE, 2), lookup)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 4])
def test_gpu_greedy_pick_at_the_model_vocabulary(rows):
    vocab = 248320
    for seed, distinct, masked in ((1, 1 << 20, 0.0), (2, 7, 0.3), (3, 2, 0.999)):
        logits, words, lookup = case(seed, rows, vocab, distinct, masked, False)
        assert torch.equal(pick.greedy_pick_triton(logits, words, lookup), pick.greedy_pick(logits, words, lookup))
