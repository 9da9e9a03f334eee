"""The grammar mask on logits and the greedy pick: reference (plain PyTorch) and a Triton kernel for the pick.

A mask row is int32 words over the vocabulary: token v is allowed when bit ``v % 32`` of word ``v // 32`` is set
(:func:`apply_mask`; ``constraint.mask_words`` makes them, every bit set while no grammar is live). The greedy pick
is the argmax of each row over its allowed tokens. Unfused it is five elementwise launches for the mask and one for
the argmax per row; :func:`greedy_pick_triton` is two launches for every row of a step.
"""
from __future__ import annotations

import torch

from ._layout import require, require_launchable, require_rows
from ._triton import jit, tl, triton

_BLOCK = 4096   # logits per program of the first pass (a 248k vocabulary: 61 programs a row)


def apply_mask(logits: torch.Tensor, words: torch.Tensor, lookup: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Logits [..., V] with the tokens whose bit is clear in ``words`` [..., W] set to -inf; ``lookup``: the word
    index and bit of every token id (``constraint.mask_lookup``). Device ops only, so a graph can capture it."""
    word_index, bit = lookup
    allowed = (words[..., word_index] >> bit) & 1
    return logits.masked_fill(allowed == 0, float("-inf"))


def greedy_pick(logits: torch.Tensor, words: torch.Tensor, lookup: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The greedy token of each row: logits [R, V] fp32, words [R, W] int32. Returns [R] int64 (a tie goes to the
    first maximum, as ``torch.argmax``'s)."""
    return apply_mask(logits, words, lookup).argmax(-1)


@jit
def _block_argmax_kernel(logits_ptr, logits_row, words_ptr, words_row, best_ptr, index_ptr, vocab, blocks,
                         BLOCK: tl.constexpr):
    """Program (row, block): the largest allowed logit of the block and its first index. A NaN logit counts as
    +inf (torch.argmax takes a NaN as the maximum); a masked one as -inf, whatever it was."""
    row, block = tl.program_id(0), tl.program_id(1)
    ids = block * BLOCK + tl.arange(0, BLOCK)
    inside = ids < vocab
    x = tl.load(logits_ptr + row * logits_row + ids, mask=inside, other=float("-inf")).to(tl.float32)
    words = tl.load(words_ptr + row * words_row + ids // 32, mask=inside, other=0)
    allowed = ((words >> (ids % 32)) & 1) != 0
    x = tl.where(x != x, float("inf"), x)
    x = tl.where(allowed & inside, x, float("-inf"))
    best = tl.max(x, axis=0)
    first = tl.min(tl.where(x == best, ids, vocab), axis=0)
    tl.store(best_ptr + row * blocks + block, best)
    tl.store(index_ptr + row * blocks + block, tl.minimum(first, vocab - 1))


@jit
def _row_argmax_kernel(best_ptr, index_ptr, out_ptr, blocks, vocab, BLOCKS: tl.constexpr):
    """Program row: the first block holding the row's maximum gives its index (blocks are in vocabulary order)."""
    row = tl.program_id(0)
    slots = tl.arange(0, BLOCKS)
    inside = slots < blocks
    best = tl.load(best_ptr + row * blocks + slots, mask=inside, other=float("-inf"))
    index = tl.load(index_ptr + row * blocks + slots, mask=inside, other=vocab)
    top = tl.max(best, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(inside & (best == top), index, vocab), axis=0).to(tl.int64))


def greedy_pick_triton(logits: torch.Tensor, words: torch.Tensor,
                       lookup: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """:func:`greedy_pick` in two launches for all rows: per (row, block of the vocabulary) the best allowed logit
    and its first index, then per row the first block with the row's maximum. ``lookup`` is not read: the kernel
    derives each token's word and bit from its id by the same rule. Rows whose every token is masked pick 0, as
    the reference does."""
    op = "greedy_pick_triton"
    require_launchable(op, logits, words)
    require_rows(op, "logits", logits, 2)
    require_rows(op, "words", words, 2, torch.int32)
    rows, vocab = logits.shape
    require(words.shape[0] == rows and words.shape[1] * 32 >= vocab, op,
            f"words {tuple(words.shape)} must be [R, >= V / 32] for logits {tuple(logits.shape)}")
    blocks = triton.cdiv(vocab, _BLOCK)
    best = torch.empty(rows, blocks, dtype=torch.float32, device=logits.device)
    index = torch.empty(rows, blocks, dtype=torch.int32, device=logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    _block_argmax_kernel[(rows, blocks)](logits, logits.stride(0), words, words.stride(0), best, index, vocab, blocks,
                                         BLOCK=_BLOCK, num_warps=8)
    _row_argmax_kernel[(rows,)](best, index, out, blocks, vocab, BLOCKS=triton.next_power_of_2(blocks), num_warps=4)
    return out
