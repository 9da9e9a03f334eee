"""The depthwise causal conv of a Gated DeltaNet layer: reference (plain PyTorch) and Triton kernel.

``count`` (a 0-d int64 device tensor, 1 <= count <= L) marks a fixed-size bucket whose rows from ``count`` on are
padding: only the real rows enter the conv state, so a padded piece leaves the state as an unpadded one would. Its
value is never read on the host (graph capture).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._layout import require, require_count, require_launchable, require_model_dtype, require_rows
from ._rounding import round_like
from ._triton import jit, tl, triton

_BLOCK_C = 128       # channels per program, contiguous in memory (coalesced)
_BLOCK_L = 32        # output rows per program in a prefill; a piece of at most this many rows is one launch


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                count: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal conv + SiLU over ``x`` [L, C] continuing from ``state`` [K-1, C] (time-major).

    The state is updated in place to the last K-1 real inputs, so a stream conv'd in pieces equals one conv over all
    of it. Output rows from ``count`` on are unspecified.
    """
    window = torch.cat([state, x.to(state.dtype)], dim=0)               # [K-1+L, C]
    out = F.conv1d(window.t().unsqueeze(0), weight.unsqueeze(1), groups=weight.shape[0])
    if count is None:
        state.copy_(window[x.shape[0]:])
    else:   # rows count .. count+K-2 of the window are the last K-1 of cat(state, x[:count])
        state.copy_(window.index_select(0, count + torch.arange(state.shape[0], device=window.device)))
    return F.silu(out[0].t()).to(x.dtype)


@jit
def _conv_window(x_ptr, x_row, state_ptr, end, cols, col_mask, C, K: tl.constexpr, K_POW2: tl.constexpr):
    """The state after the first ``end`` rows of x: rows end .. end+K-2 of cat(state, x), for this program's
    channels, as (its [K_POW2, BLOCK_C] values, their row index r, the mask of real rows and channels)."""
    r = tl.arange(0, K_POW2)
    src = (end + r - (K - 1)).to(tl.int64)            # row in x; negative: row src + K - 1 of the old state
    live = (r < K - 1)[:, None] & col_mask[None, :]
    from_x = tl.load(x_ptr + src[:, None] * x_row + cols[None, :], mask=live & (src >= 0)[:, None], other=0.0)
    from_state = tl.load(state_ptr + (src + K - 1)[:, None] * C + cols[None, :], mask=live & (src < 0)[:, None],
                         other=0.0)
    return tl.where((src < 0)[:, None], from_state, from_x.to(from_state.dtype)), r, live


@jit
def _conv_state_update(x_ptr, x_row, state_ptr, count_ptr, L, cols, col_mask, C, K: tl.constexpr,
                       K_POW2: tl.constexpr, HAS_COUNT: tl.constexpr):
    """state <- its window after ``count`` rows (L without a count) for this program's channels. A barrier separates
    every read of the old state (also the caller's) from the writes."""
    if HAS_COUNT:
        count = tl.load(count_ptr)
    else:
        count = L
    new, r, live = _conv_window(x_ptr, x_row, state_ptr, count, cols, col_mask, C, K, K_POW2)
    tl.debug_barrier()
    tl.store(state_ptr + r[:, None] * C + cols[None, :], new, mask=live)


@jit
def _conv_out(x_ptr, x_row, state_ptr, w_ptr, w_row, out_ptr, t, cols, col_mask, L, C, K: tl.constexpr,
              BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr):
    """Output rows ``t`` [BLOCK_L] x channels ``cols`` [BLOCK_C]: conv over cat(state, x), SiLU, stored."""
    acc = tl.zeros((BLOCK_L, BLOCK_C), dtype=tl.float32)
    for k in tl.static_range(K):
        src = (t + k - (K - 1)).to(tl.int64)          # row in x; negative: row src + K - 1 of the state
        from_x = tl.load(x_ptr + src[:, None] * x_row + cols[None, :],
                         mask=((src >= 0) & (src < L))[:, None] & col_mask[None, :], other=0.0)
        from_state = tl.load(state_ptr + (src + K - 1)[:, None] * C + cols[None, :],
                             mask=(src < 0)[:, None] & col_mask[None, :], other=0.0)
        w = tl.load(w_ptr + cols * w_row + k, mask=col_mask, other=0.0).to(tl.float32)
        acc += (from_x.to(tl.float32) + from_state.to(tl.float32)) * w[None, :]
    conv = round_like(acc, out_ptr)                   # the conv's output in the model dtype, then SiLU on it
    out = round_like(conv / (1.0 + tl.exp(-conv)), out_ptr).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t.to(tl.int64)[:, None] * C + cols[None, :], out, mask=(t < L)[:, None] & col_mask[None, :])


@jit
def _conv_kernel(x_ptr, x_row, state_ptr, w_ptr, w_row, out_ptr, count_ptr, L, C, K: tl.constexpr,
                 K_POW2: tl.constexpr, HAS_COUNT: tl.constexpr, UPDATE_STATE: tl.constexpr,
                 BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr):
    """Output rows [pid0 * BLOCK_L, +BLOCK_L) x channels [pid1 * BLOCK_C, +BLOCK_C). With UPDATE_STATE (only when one
    program covers all rows of its channels) it also writes the new state, after all its reads."""
    t = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < C
    _conv_out(x_ptr, x_row, state_ptr, w_ptr, w_row, out_ptr, t, cols, col_mask, L, C, K, BLOCK_L, BLOCK_C)
    if UPDATE_STATE:
        _conv_state_update(x_ptr, x_row, state_ptr, count_ptr, L, cols, col_mask, C, K, K_POW2, HAS_COUNT)


@jit
def _conv_rows_kernel(x_ptr, x_row, state_ptr, w_ptr, w_row, out_ptr, rows_ptr, rows_row, L, C, K: tl.constexpr,
                      K_POW2: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr):
    """Channels [pid * BLOCK_C, +BLOCK_C) of all L rows, and of the state after each row j (rows j - K + 2 .. j of
    cat(state, x)) into ``rows_ptr + j * rows_row``; the state itself is only read."""
    t = tl.arange(0, BLOCK_L)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < C
    _conv_out(x_ptr, x_row, state_ptr, w_ptr, w_row, out_ptr, t, cols, col_mask, L, C, K, BLOCK_L, BLOCK_C)
    for j in range(0, L):
        new, r, live = _conv_window(x_ptr, x_row, state_ptr, j + 1, cols, col_mask, C, K, K_POW2)
        tl.store(rows_ptr + j * rows_row + r[:, None] * C + cols[None, :], new, mask=live)


@jit
def _conv_state_kernel(x_ptr, x_row, state_ptr, count_ptr, L, C, K: tl.constexpr, K_POW2: tl.constexpr,
                       HAS_COUNT: tl.constexpr, BLOCK_C: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    _conv_state_update(x_ptr, x_row, state_ptr, count_ptr, L, cols, cols < C, C, K, K_POW2, HAS_COUNT)


def causal_conv_rows(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The conv of L decode rows, each as a one-row :func:`causal_conv` step after the rows before it: the state
    after row j goes to ``rows[j]`` ([L, K-1, C]), ``state`` is left as it was (a speculative verify keeps every
    row's state and commits one)."""
    out = torch.empty_like(x)
    state = state.clone()
    for row in range(x.shape[0]):
        out[row:row + 1] = causal_conv(x[row:row + 1], state, weight)
        rows[row].copy_(state)
    return out


def _check_conv(op: str, x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[int, int, int]:
    """The Triton conv's layout (see :func:`causal_conv_triton`); returns L, C and K."""
    require_launchable(op, x, state, weight)
    require_rows(op, "x", x, 2)
    require_model_dtype(op, x)
    require_rows(op, "state", state, 2, x.dtype)
    require_rows(op, "weight", weight, 2)
    length, channels = x.shape
    kernel = weight.shape[1]
    require(length >= 1, op, "x needs at least one row")
    require(kernel >= 2 and state.shape == (kernel - 1, channels), op,
            f"state must be [K-1, C] = [{kernel - 1}, {channels}], got {tuple(state.shape)}")
    require(state.is_contiguous(), op, f"state must be contiguous, got strides {state.stride()}")
    require(weight.shape[0] == channels, op, f"weight must be [C, K] with C = {channels}, got {tuple(weight.shape)}")
    return length, channels, kernel


def causal_conv_triton(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                       count: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`causal_conv` without copies: x [L, C] with unit column stride and any row stride (a column slice of a
    fused projection), state [K-1, C] contiguous in x's dtype, weight [C, K] (unit last stride). Returns [L, C]
    contiguous. A piece of at most ``_BLOCK_L`` rows (decode) is one launch; a longer one adds a tiny second launch
    for the state, so no program overwrites state that another still reads."""
    op = "causal_conv_triton"
    length, channels, kernel = _check_conv(op, x, state, weight)
    require_count(op, count, x.device)
    out = torch.empty((length, channels), dtype=x.dtype, device=x.device)
    block_l = min(_BLOCK_L, triton.next_power_of_2(length))
    row_blocks, col_blocks = triton.cdiv(length, block_l), triton.cdiv(channels, _BLOCK_C)
    fused = row_blocks == 1
    count_arg = x if count is None else count      # not read without HAS_COUNT
    shape = dict(K=kernel, K_POW2=triton.next_power_of_2(kernel - 1), HAS_COUNT=count is not None)
    _conv_kernel[(row_blocks, col_blocks)](x, x.stride(0), state, weight, weight.stride(0), out, count_arg, length,
                                           channels, UPDATE_STATE=fused, BLOCK_L=block_l, BLOCK_C=_BLOCK_C,
                                           num_warps=4, **shape)
    if not fused:
        _conv_state_kernel[(col_blocks,)](x, x.stride(0), state, count_arg, length, channels, BLOCK_C=_BLOCK_C,
                                          num_warps=4, **shape)
    return out


def causal_conv_rows_triton(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                            rows: torch.Tensor) -> torch.Tensor:
    """:func:`causal_conv_rows` in one launch (at most ``_BLOCK_L`` rows); x, state and weight as in
    :func:`causal_conv_triton`; ``rows`` [L, K-1, C] in the state's dtype, each row laid out as the state (any row
    stride: a speculative step's row states)."""
    op = "causal_conv_rows_triton"
    length, channels, kernel = _check_conv(op, x, state, weight)
    require(length <= _BLOCK_L, op, f"at most {_BLOCK_L} rows, got {length}")
    require(rows.shape == (length, *state.shape) and rows.dtype == state.dtype
            and rows.stride()[1:] == state.stride(), op,
            f"rows must be [L, K-1, C] = {(length, *state.shape)} of {state.dtype} with the state's layout per row, "
            f"got {tuple(rows.shape)} {rows.dtype} strides {rows.stride()}")
    out = torch.empty((length, channels), dtype=x.dtype, device=x.device)
    _conv_rows_kernel[(triton.cdiv(channels, _BLOCK_C),)](
        x, x.stride(0), state, weight, weight.stride(0), out, rows, rows.stride(0), length, channels, K=kernel,
        K_POW2=triton.next_power_of_2(kernel - 1), BLOCK_L=triton.next_power_of_2(length), BLOCK_C=_BLOCK_C,
        num_warps=4)
    return out
