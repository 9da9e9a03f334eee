"""The gated delta rule (Gated DeltaNet's recurrence): reference kernels, recurrent and chunked, plus fla-core, and
the whole Gated DeltaNet core (gates, q/k l2-norm, recurrence) as :func:`gated_delta_rule_reference` and its fused
Triton kernel :func:`gated_delta_rule_triton` (same signature and contract)."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ._layout import require, require_count, require_launchable, require_model_dtype, require_rows
from ._rounding import round_like
from ._triton import INTERPRETED, jit, tl, triton
from .norms import l2norm

try:  # optional production kernels (pure Python + Triton); parity-tested against the reference below
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as _fla_chunk
except Exception:  # noqa: BLE001 - any import failure just means "not available"
    _fla_chunk = None


def fla_available() -> bool:
    return _fla_chunk is not None and torch.cuda.is_available()


def _expand_heads(q: torch.Tensor, k: torch.Tensor, num_v_heads: int):
    groups = num_v_heads // q.shape[1]
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=1), k.repeat_interleave(groups, dim=1)
    return q, k


def _delta_rule_inputs(q, k, v, g, beta):
    """fp32 inputs with one key head per value head, l2-normalised q/k and q scaled by dk^-1/2."""
    q, k = _expand_heads(q, k, v.shape[1])
    q = l2norm(q.float()) * q.shape[-1] ** -0.5
    return q, l2norm(k.float()), v.float(), g.float(), beta.float()


def delta_rule_recurrent(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """Gated delta rule, one token at a time (the decode kernel; also the ground truth for the chunked one).

    q, k: [L, Hk, dk]; v: [L, Hv, dv]; g (log decay), beta: [L, Hv]; state: [Hv, dk, dv] fp32, updated in place.
    q and k are l2-normalised here and q is scaled by dk^-1/2. Returns [L, Hv, dv] in v's dtype.
    """
    out_dtype = v.dtype
    q, k, v, g, beta = _delta_rule_inputs(q, k, v, g, beta)
    s = state.clone()
    outs = []
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        predicted = torch.einsum("hk,hkv->hv", k[t], s)
        delta = (v[t] - predicted) * beta[t][:, None]
        s = s + k[t][:, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", q[t], s))
    state.copy_(s)
    return torch.stack(outs).to(out_dtype)


CHUNK = 64  # the chunked kernel's fold width (fla-core's too)


def delta_rule_chunked(q, k, v, g, beta, state: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """Gated delta rule over chunks (the prefill kernel): same contract as :func:`delta_rule_recurrent`.

    Within a chunk the sequential updates are folded into one triangular solve (the WY / UT form); across chunks the
    fp32 state is carried. Zero padding of the last chunk (k = v = 0, beta = 0, g = 0) leaves the state unchanged.
    The chunk is fixed, never shrunk to a short input, so a short piece folds as the same rows followed by zero
    padding (see :func:`gated_delta_rule_reference` for byte identity).
    """
    out_dtype = v.dtype
    length = q.shape[0]
    q, k, v, g, beta = _delta_rule_inputs(q, k, v, g, beta)
    pad = (-length) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    heads = v.shape[1]
    # [H, N, C, d] layout: heads, chunks, position in chunk, features
    q, k, v = (x.reshape(-1, chunk, heads, x.shape[-1]).permute(2, 0, 1, 3) for x in (q, k, v))
    g, beta = (x.reshape(-1, chunk, heads).permute(2, 0, 1) for x in (g, beta))
    decay = g.cumsum(-1)                                                     # log decay from chunk start
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    pair = (decay[..., :, None] - decay[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * pair                         # unit lower-triangular after solve
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * pair
    q_decayed = q * decay.exp()[..., None]
    k_to_end = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]
    s = state.clone()
    outs = []
    for i in range(q.shape[1]):
        v_new = u[:, i] - w[:, i] @ s
        outs.append(q_decayed[:, i] @ s + intra[:, i] @ v_new)
        s = s * chunk_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ v_new
    state.copy_(s)
    out = torch.stack(outs, dim=1).reshape(heads, -1, v.shape[-1])[:, :length]
    return out.transpose(0, 1).to(out_dtype)


def delta_rule_fla(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """fla-core's chunked kernel with the same contract (CUDA only). fla-core maps value head h to key head
    h // (Hv // Hk) itself (its "grouped value attention"), so q and k go in unrepeated."""
    out, final = _fla_chunk(q[None], k[None], v[None], g=g[None].float(), beta=beta[None],
                            initial_state=state[None], output_final_state=True, use_qk_l2norm_in_kernel=True)
    state.copy_(final[0])
    return out[0]


def delta_rule_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                     dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet's gates from the raw projections a, b [L, Hv]: the log decay
    g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b) (taken in b's dtype), both returned in fp32."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, b.sigmoid().float()


def gated_delta_rule_reference(q, k, v, a, b, A_log, dt_bias, state: torch.Tensor,
                               count: torch.Tensor | None = None) -> torch.Tensor:
    """The Gated DeltaNet core of a piece of L tokens: gates, q/k l2-norm and the recurrence, state updated in place.

    q, k: [L, Hk, dk]; v: [L, Hv, dv] (value head h reads key head h // (Hv // Hk)); a, b: [L, Hv] raw projections;
    A_log, dt_bias: [Hv]; state: [Hv, dk, dv] fp32. ``count`` (None, or a 0-d int64 device tensor, 1 <= count <= L)
    marks rows >= count as the padding of a fixed-size bucket: they are zeroed (g = beta = 0, q = k = v = 0), which
    leaves the state as if they were absent, and their output rows are zero. Returns [L, Hv, dv] in v's dtype.

    One token runs the recurrent kernel. More run the chunked one on the inputs zero-padded to a multiple of
    :data:`CHUNK` *before* any arithmetic: every elementwise op then sees the same shape for n real rows alone as
    for n rows in a bucket (CPU kernels round differently in their vector body and scalar tail), so a padded piece
    with count = n computes the bytes of the same n rows unpadded (n >= 2; buckets of the same padded size).
    """
    length = q.shape[0]
    if length == 1:
        return delta_rule_recurrent(q, k, v, *delta_rule_gates(a, b, A_log, dt_bias), state)
    pad = (-length) % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
    a, b = (F.pad(x, (0, 0, 0, pad)) for x in (a, b))
    real = torch.arange(length + pad, device=q.device) < (length if count is None else count)
    g, beta = (x.masked_fill(~real[:, None], 0.0) for x in delta_rule_gates(a, b, A_log, dt_bias))
    q, k, v = (torch.where(real[:, None, None], x, 0.0) for x in (q, k, v))
    return delta_rule_chunked(q, k, v, g, beta, state, CHUNK)[:length]


@jit
def _log1p(y):
    """log(1 + y) accurate for small y (Goldberg's correction; tl has no log1p that runs in the interpreter)."""
    u = 1.0 + y
    exact = u == 1.0
    return tl.where(exact, y, tl.log(u) * (y / tl.where(exact, 1.0, u - 1.0)))


@jit
def _factors(qt, kt, at, bt, neg_a, dt_bias, b_ptr, scale, eps, AXIS: tl.constexpr):
    """What a row needs besides the state, from its fp32 q, k, a and b (or a tile's rows: q and k summed along
    AXIS): the decay exp(-exp(A_log) softplus(a + dt_bias)), beta = sigmoid(b) rounded to b's dtype (the
    reference's), and the l2-norm scales of q (times dk^-1/2) and of k."""
    x = at + dt_bias
    softplus = tl.where(x > 20.0, x, tl.maximum(x, 0.0) + _log1p(tl.exp(-tl.abs(x))))  # torch's threshold
    return (tl.exp(neg_a * softplus), round_like(tl.sigmoid(bt), b_ptr),
            tl.rsqrt(tl.sum(qt * qt, axis=AXIS) + eps) * scale, tl.rsqrt(tl.sum(kt * kt, axis=AXIS) + eps))


@jit
def _factors_ahead(q_ptr, q_row, q_head, k_ptr, k_row, k_head, a_ptr, a_row, a_head, b_ptr, b_row, b_head, f_ptr,
                   f_stride, real, head, key_head, keys, key_mask, neg_a, dt_bias, scale, eps, ROWS: tl.constexpr):
    """:func:`_factors` of every real row and its q.k (unscaled), ROWS rows a tile, stored as decay, beta, q scale,
    k scale and q.k at ``f_ptr + i * f_stride + row`` (i = 0..4). The tile's shape is fixed, so a row's sums take the
    same order whatever the piece's length."""
    tile = tl.arange(0, ROWS)
    for first in range(0, real, ROWS):
        rows = first + tile
        real_rows = rows < real
        mask = real_rows[:, None] & key_mask[None, :]
        qt = tl.load(q_ptr + rows[:, None] * q_row + key_head * q_head + keys[None, :], mask=mask, other=0.0)
        kt = tl.load(k_ptr + rows[:, None] * k_row + key_head * k_head + keys[None, :], mask=mask, other=0.0)
        at = tl.load(a_ptr + rows * a_row + head * a_head, mask=real_rows, other=0.0).to(tl.float32)
        bt = tl.load(b_ptr + rows * b_row + head * b_head, mask=real_rows, other=0.0).to(tl.float32)
        qt, kt = qt.to(tl.float32), kt.to(tl.float32)
        decay, beta, q_scale, k_scale = _factors(qt, kt, at, bt, neg_a, dt_bias, b_ptr, scale, eps, 1)
        tl.store(f_ptr + rows, decay, mask=real_rows)
        tl.store(f_ptr + f_stride + rows, beta, mask=real_rows)
        tl.store(f_ptr + 2 * f_stride + rows, q_scale, mask=real_rows)
        tl.store(f_ptr + 3 * f_stride + rows, k_scale, mask=real_rows)
        tl.store(f_ptr + 4 * f_stride + rows, tl.sum(qt * kt, axis=1), mask=real_rows)


@jit
def _row_inputs(q_ptr, q_row, q_head, k_ptr, k_row, k_head, v_ptr, v_row, v_head, a_ptr, a_row, a_head,
                b_ptr, b_row, b_head, f_ptr, f_stride, t, head, key_head, keys, cols, key_mask, col_mask,
                AHEAD: tl.constexpr):
    """Row t's q, k [dk], v [BLOCK_V] and five scalars, in fp32: with AHEAD its stored factors (decay, beta, q scale,
    k scale, q.k), else a, b and a three times (unused)."""
    qt = tl.load(q_ptr + t * q_row + key_head * q_head + keys, mask=key_mask, other=0.0).to(tl.float32)
    kt = tl.load(k_ptr + t * k_row + key_head * k_head + keys, mask=key_mask, other=0.0).to(tl.float32)
    vt = tl.load(v_ptr + t * v_row + head * v_head + cols, mask=col_mask, other=0.0).to(tl.float32)
    if AHEAD:
        x0 = tl.load(f_ptr + t)
        x1 = tl.load(f_ptr + f_stride + t)
        x2 = tl.load(f_ptr + 2 * f_stride + t)
        x3 = tl.load(f_ptr + 3 * f_stride + t)
        x4 = tl.load(f_ptr + 4 * f_stride + t)
    else:
        x0 = tl.load(a_ptr + t * a_row + head * a_head).to(tl.float32)
        x1 = tl.load(b_ptr + t * b_row + head * b_head).to(tl.float32)
        x2, x3, x4 = x0, x0, x0
    return qt, kt, vt, x0, x1, x2, x3, x4


@jit
def _gated_delta_rule_kernel(q_ptr, q_row, q_head, k_ptr, k_row, k_head, v_ptr, v_row, v_head,
                             a_ptr, a_row, a_head, b_ptr, b_row, b_head, a_log_ptr, dt_bias_ptr,
                             s_ptr, s_head, s_key, out_ptr, out_row, count_ptr, rows_ptr, rows_row, ahead_ptr,
                             ahead_rows, length, dk, dv, scale, eps, GROUPS: tl.constexpr,
                             HAS_COUNT: tl.constexpr, STORE_ROWS: tl.constexpr, JOINT: tl.constexpr,
                             AHEAD: tl.constexpr, AHEAD_ROWS: tl.constexpr, AHEAD_FACTORS: tl.constexpr,
                             BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """One program per (value head, block of BLOCK_V value columns): the [dk, BLOCK_V] fp32 state block stays in
    registers over all real rows (read once, written once); padding rows only get zero outputs. With STORE_ROWS the
    state after row t goes to ``rows_ptr + t * rows_row`` (laid out as the state) instead, and the state is only
    read. With AHEAD the rows' factors (gates and norms: nothing that waits on the state) are computed for all rows
    before the serial loop, into the program's [AHEAD_FACTORS, ahead_rows] slice of ``ahead_ptr``, and the loop only
    loads them."""
    head = tl.program_id(0)
    key_head = head // GROUPS
    keys = tl.arange(0, BLOCK_K)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    key_mask, col_mask = keys < dk, cols < dv
    s_offsets = head * s_head + keys[:, None] * s_key + cols[None, :]
    s_ptrs = s_ptr + s_offsets
    s_mask = key_mask[:, None] & col_mask[None, :]
    s = tl.load(s_ptrs, mask=s_mask, other=0.0)
    neg_a = -tl.exp(tl.load(a_log_ptr + head).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    out_ptrs = out_ptr + head * dv + cols
    real = length
    if HAS_COUNT:
        real = tl.minimum(tl.load(count_ptr).to(tl.int32), length)
    # Padding rows' outputs are zeros, stored before the serial loop: stored after it, ptxas (sm_90, triton 3.6 and
    # 3.9) serialised the loop's reduction trees of a launch with a device count, 6 us of a 24-row piece's 13
    # (bench/delta_rule_sass.py's shfl_adjacent; bench/results/h100_0414adb/zero_loop_order.txt).
    for t in range(real, length):
        tl.store(out_ptrs + t * out_row, tl.zeros([BLOCK_V], out_ptr.dtype.element_ty), mask=col_mask)
    f_ptr = ahead_ptr + (head * tl.num_programs(1) + tl.program_id(1)) * AHEAD_FACTORS * ahead_rows
    if AHEAD:
        _factors_ahead(q_ptr, q_row, q_head, k_ptr, k_row, k_head, a_ptr, a_row, a_head, b_ptr, b_row, b_head, f_ptr,
                       ahead_rows, real, head, key_head, keys, key_mask, neg_a, dt_bias, scale, eps, AHEAD_ROWS)
        tl.debug_barrier()                     # the loop's threads read factors that other threads stored
    # Row t + 1's inputs are loaded while row t computes (they do not depend on the state), so the serial chain per
    # row is the state's arithmetic alone. The l2-norms scale the reductions' results instead of q and k first: the
    # norms and the reductions over the state then run side by side. JOINT: both reductions read the state before
    # the row's update, as one reduction over q and k side by side (one pass across the warps, where two would each
    # wait at a barrier): with decay d, k' = k * k_scale and delta = (v - d k'.S) beta, the output q'.(d S + k' delta)
    # is d q'.S + (q'.k') delta. It doubles the product's registers, so only small state blocks take it (see
    # SMALL_STATE_BLOCK). With AHEAD (a piece's launch: one warp, where no sum waits at a barrier) the two sums are
    # separate and q.k is one of the factors: a row's serial chain is then one sum deep.
    qn, kn, vn, xn0, xn1, xn2, xn3, xn4 = _row_inputs(
        q_ptr, q_row, q_head, k_ptr, k_row, k_head, v_ptr, v_row, v_head, a_ptr, a_row, a_head, b_ptr, b_row, b_head,
        f_ptr, ahead_rows, 0, head, key_head, keys, cols, key_mask, col_mask, AHEAD)
    for t in range(0, real):
        qt, kt, vt, x0, x1, x2, x3, x4 = qn, kn, vn, xn0, xn1, xn2, xn3, xn4
        qn, kn, vn, xn0, xn1, xn2, xn3, xn4 = _row_inputs(     # past the last row: row 0 again, unused
            q_ptr, q_row, q_head, k_ptr, k_row, k_head, v_ptr, v_row, v_head, a_ptr, a_row, a_head, b_ptr, b_row,
            b_head, f_ptr, ahead_rows, (t + 1) % real, head, key_head, keys, cols, key_mask, col_mask, AHEAD)
        if AHEAD:
            decay, beta, q_scale, k_scale, qk = x0, x1, x2, x3, x4
        else:
            decay, beta, q_scale, k_scale = _factors(qt, kt, x0, x1, neg_a, dt_bias, b_ptr, scale, eps, 0)
            qk = tl.sum(qt * kt, axis=0)
        if JOINT:
            if AHEAD:       # a piece's one warp: two sums side by side need no barrier either
                qs = tl.sum(qt[:, None] * s, axis=0)
                ks = tl.sum(kt[:, None] * s, axis=0)
            else:
                qs, ks = tl.split(tl.sum(tl.join(qt, kt)[:, None, :] * s[:, :, None], axis=0))
            delta = (vt - decay * ks * k_scale) * beta
            s = s * decay + (kt * k_scale)[:, None] * delta[None, :]
            out = (decay * qs + qk * k_scale * delta) * q_scale
        else:
            s = s * decay
            delta = (vt - tl.sum(kt[:, None] * s, axis=0) * k_scale) * beta
            s = s + (kt * k_scale)[:, None] * delta[None, :]
            out = tl.sum(qt[:, None] * s, axis=0) * q_scale
        tl.store(out_ptrs + t * out_row, round_like(out, out_ptr).to(out_ptr.dtype.element_ty), mask=col_mask)
        if STORE_ROWS:
            tl.store(rows_ptr + t * rows_row + s_offsets, s, mask=s_mask)
    if not STORE_ROWS:
        tl.store(s_ptrs, s, mask=s_mask)


# State elements per program up to which 4 warps hold the block and the joint reduction's product without spilling
# (at dk 128). On an H100 (bench/time_delta_rule.py, h100_8fe1adb/delta_rule_ab.txt) the joint reduction took the
# 0.8B's 128 x 16 blocks from 1.17 to 0.99 us a row of a 24-row piece; on the 27B's 128 x 32 blocks (8 warps) it went
# from 2.09 to 2.54 us, so those keep the two reductions.
SMALL_STATE_BLOCK = 2048


class DeltaRuleConfig(NamedTuple):
    """How the recurrent kernel is launched: value columns per program, warps, whether a row's two reductions
    over the state run as one (JOINT in the kernel), and whether the rows' factors are computed before the serial
    loop (AHEAD)."""
    block_v: int
    num_warps: int
    joint: bool
    ahead: bool = False


AHEAD_ROWS = 8      # rows of one tile of the factors computed ahead (_factors_ahead)
AHEAD_FACTORS = 5   # of each row: decay, beta, q scale, k scale, q.k


# A piece's launch (PIECE_AHEAD): PIECE_BLOCK_V value columns and one warp a program, the rows' factors ahead of the
# serial loop, the joint form. A piece's rows are serial, so the row's latency is what counts: within one warp a
# reduction needs no barrier, narrow blocks give the many programs that keep the SMs busy, and with the factors ahead
# a row's chain is one sum deep with no MUFU in it (bench/delta_rule_sass.py). On an H100 one warp took the 0.8B's
# 24-row launch from 23.9 us (the decode launch, 16 columns, 4 warps, joint) to 16.6, the 27B's from 49.9 (32, 8 warps,
# two) to 24.3 (h100_d9b7208/delta_rule_sweep_*.json); the factors ahead took the 0.8B's to 13.1, the fastest of the
# 137 swept (h100_462ccf5-dirty/). At one row one warp is slower (3.95 against 2.91 us on the 0.8B): decode keeps the
# rule below.
PIECE_BLOCK_V = 4
PIECE_AHEAD = DeltaRuleConfig(PIECE_BLOCK_V, 1, True, ahead=True)


def launch_config(v_heads: int, dk: int, dv: int, piece: bool = False,
                  interpreted: bool = INTERPRETED) -> DeltaRuleConfig:
    """One row (decode, and each row of a verify's rows kernel): the value block is the widest of 64/32/16 that
    still gives >= 128 programs (an H200 has 132 SMs; parallelism comes only from heads x column blocks); small state
    blocks take 4 warps and the joint reduction, larger ones 8 warps and two reductions (SMALL_STATE_BLOCK). A piece
    of several rows (``piece``): :data:`PIECE_AHEAD`; under Triton's interpreter, which runs the programs one after
    another in Python, the decode block, one warp and two sums with the factors in the loop instead (a quarter of
    the programs on the tiny model's 16 columns, and no pass over the rows before the loop). The interpreter sums a
    column as numpy does, whatever the block and the warps, so its bytes are the same either way.
    ``bench/time_delta_rule.py --sweep`` times the alternatives on a GPU."""
    block_v = min(16, triton.next_power_of_2(dv))
    for block in (64, 32):
        if v_heads * triton.cdiv(dv, block) >= 128:
            block_v = min(block, triton.next_power_of_2(dv))
            break
    if piece:
        if interpreted:
            return DeltaRuleConfig(block_v, 1, False)
        return PIECE_AHEAD._replace(block_v=min(PIECE_BLOCK_V, triton.next_power_of_2(dv)))
    small = triton.next_power_of_2(dk) * block_v <= SMALL_STATE_BLOCK
    return DeltaRuleConfig(block_v, 4 if small else 8, small)


def gated_delta_rule_rows(q, k, v, a, b, A_log, dt_bias, state: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """L decode rows, each as a one-token :func:`gated_delta_rule_reference` step after the rows before it: the
    state after row j goes to ``rows[j]`` ([L, Hv, dk, dv]), ``state`` is left as it was (a speculative verify keeps
    every row's state and commits one)."""
    out = torch.empty_like(v)
    state = state.clone()
    for row in range(q.shape[0]):
        one = slice(row, row + 1)
        out[one] = gated_delta_rule_reference(q[one], k[one], v[one], a[one], b[one], A_log, dt_bias, state)
        rows[row].copy_(state)
    return out


def gated_delta_rule_triton(q, k, v, a, b, A_log, dt_bias, state: torch.Tensor, count: torch.Tensor | None = None,
                            config: DeltaRuleConfig | None = None) -> torch.Tensor:
    """:func:`gated_delta_rule_reference` in one launch: a recurrence over the L rows (meant for L <= 64: decode and
    short pieces; long pieces belong to the chunked kernels). Same contract; q, k, v, a, b may be strided views
    (unit last stride); the state [Hv, dk, dv] fp32 needs unit last stride. ``count`` is read on the device;
    ``config`` replaces :func:`launch_config`'s (a sweep). Compiled, a padded piece gives its rows' bytes for
    inputs of one layout: Triton specializes strides and addresses divisible by 16 and lays out the factors'
    tiles (their sums' order) by them. A step's q, k, v, a and b are views of buffers whose layout the model sets,
    the same for every piece length and count."""
    return _gated_delta_rule_launch("gated_delta_rule_triton", q, k, v, a, b, A_log, dt_bias, state, count, None,
                                    config)


def gated_delta_rule_rows_triton(q, k, v, a, b, A_log, dt_bias, state: torch.Tensor,
                                 rows: torch.Tensor) -> torch.Tensor:
    """:func:`gated_delta_rule_rows` in one launch: the recurrence of :func:`gated_delta_rule_triton`, storing the
    state after each row in ``rows`` [L, Hv, dk, dv] fp32 (each row laid out as the state, any row stride)."""
    op = "gated_delta_rule_rows_triton"
    require(rows.dim() == 4 and rows.shape[0] == q.shape[0] and rows.shape[1:] == state.shape
            and rows.dtype == torch.float32 and rows.stride()[1:] == state.stride(), op,
            f"rows must be [L, *state.shape] = {(q.shape[0], *state.shape)} fp32 with the state's layout per row, "
            f"got {tuple(rows.shape)} {rows.dtype} strides {rows.stride()}")
    return _gated_delta_rule_launch(op, q, k, v, a, b, A_log, dt_bias, state, None, rows, None)


def _gated_delta_rule_launch(op, q, k, v, a, b, A_log, dt_bias, state, count, rows, config):
    require_launchable(op, q, k, v, a, b, A_log, dt_bias, state)
    for name, t, ndim in (("q", q, 3), ("k", k, 3), ("v", v, 3), ("a", a, 2), ("b", b, 2)):
        require_rows(op, name, t, ndim)
    require_rows(op, "state", state, 3, torch.float32)
    require_model_dtype(op, v)
    require_count(op, count, q.device)
    length, k_heads, dk = q.shape
    v_heads, dv = v.shape[1:]
    require(k.shape == q.shape and v.shape[0] == length and v_heads % k_heads == 0, op,
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must match and v {tuple(v.shape)} must have a multiple of "
            "their heads and their length")
    require(a.shape == b.shape == (length, v_heads) and A_log.shape == dt_bias.shape == (v_heads,), op,
            f"a, b must be [L, Hv] = {(length, v_heads)} and A_log, dt_bias [Hv]")
    require(state.shape == (v_heads, dk, dv), op, f"state must be {(v_heads, dk, dv)}, got {tuple(state.shape)}")
    out = torch.empty(length, v_heads, dv, dtype=v.dtype, device=v.device)
    config = config or launch_config(v_heads, dk, dv, piece=length > 1 and rows is None)
    grid = (v_heads, triton.cdiv(dv, config.block_v))
    ahead_rows = triton.cdiv(length, AHEAD_ROWS) * AHEAD_ROWS if config.ahead else 0
    ahead = (torch.empty(grid[0] * grid[1] * AHEAD_FACTORS * ahead_rows, dtype=torch.float32, device=v.device)
             if ahead_rows else state)
    _gated_delta_rule_kernel[grid](
        q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
        a, a.stride(0), a.stride(1), b, b.stride(0), b.stride(1), A_log, dt_bias,
        state, state.stride(0), state.stride(1), out, out.stride(0), out if count is None else count,
        state if rows is None else rows, 0 if rows is None else rows.stride(0), ahead, ahead_rows, length, dk, dv,
        dk ** -0.5, 1e-6, GROUPS=v_heads // k_heads, HAS_COUNT=count is not None, STORE_ROWS=rows is not None,
        JOINT=config.joint, AHEAD=config.ahead, AHEAD_ROWS=AHEAD_ROWS, AHEAD_FACTORS=AHEAD_FACTORS,
        BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=config.block_v, num_warps=config.num_warps)
    return out
