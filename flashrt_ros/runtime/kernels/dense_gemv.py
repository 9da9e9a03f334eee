"""The dense skinny GEMM of decode and speculative verify: ``y = x @ W.T`` for 1..:data:`MAX_ROWS` rows of ``x`` and
a bf16 / fp16 / fp32 weight ``W`` [N, K], reading each weight once for all rows, with the cheap operations around a
projection fused where they would otherwise each cost a launch:

* ``norm``: the input is RMSNorm'd first (``rms_norm(x, norm, eps)``, the projections after a norm); each program
  recomputes its rows' statistics over the whole row (K is the hidden size, so this is a few KiB from L2);
* ``gated``: the input is ``silu_mul`` of a fused gate/up output [L, 2K] (the MLP's down projection);
* ``residual``: the output is ``residual + x @ W.T`` (an output projection and the residual stream).

:func:`dense_linear` is the reference (plain PyTorch: the same composition of the reference kernels);
:func:`dense_linear_triton` one kernel, which rounds where the reference rounds (the normed or gated input and the
product to the model dtype, then the residual sum), so the two differ only by the fp32 summation order.

Rows are padded to :data:`~.quant_gemv.DENSE_ROWS` and multiplied on tensor cores (``tl.dot``): the K-reduction
order of a row depends on neither the row count nor the other rows, so a row of a 5-row verify step is bit-identical
to the same row of a one-row decode step. Launch configurations come from the quantized GEMV's table
(:mod:`.quant_gemv_configs`, weight kind ``dense``, one rows bucket), split-K partials are summed by the last slice to
arrive in slice order, so the result is a function of shape and device only (never ``triton.autotune``: see
:mod:`.quant_gemv`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import quant_gemv as kq
from ._layout import require, require_launchable, require_model_dtype, require_rows
from ._rounding import round_like
from ._triton import INTERPRETED, jit, tl, triton
from .activations import silu_mul
from .norms import rms_norm

MAX_ROWS = 8                        # the most rows the model sends here (decode, verify, the smallest pieces)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0,
                 gated: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``[residual +] F.linear(rms_norm(x, norm, eps) | silu_mul(x) | x, weight)`` in plain PyTorch."""
    if norm is not None:
        x = rms_norm(x, norm, eps)
    if gated:
        x = silu_mul(x)
    y = F.linear(x, weight)
    return y if residual is None else residual + y


@jit
def _padded_rows(x, BLOCK_L: tl.constexpr):
    """The [ROWS, K] tile ``x`` as the dot's [BLOCK_L, K] operand: its rows, then zero rows."""
    if x.shape[0] == BLOCK_L:
        return x
    repeated = tl.reshape(tl.broadcast_to(x[None, :, :], (BLOCK_L // x.shape[0], x.shape[0], x.shape[1])),
                          (BLOCK_L, x.shape[1]))
    return tl.where((tl.arange(0, BLOCK_L) < x.shape[0])[:, None], repeated, tl.zeros_like(repeated))


@jit
def _dense_gemv_kernel(x_ptr, w_ptr, norm_ptr, res_ptr, out_ptr, partial_ptr, arrivals_ptr, L, N, K, stride_x,
                       stride_w, k_split, eps, SPLIT: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr,
                       RESIDUAL: tl.constexpr, IEEE: tl.constexpr, ASM: tl.constexpr, EVEN_K: tl.constexpr,
                       NORM_K: tl.constexpr, ROWS: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """One [BLOCK_L, BLOCK_N] output tile over one K slice (program axes: block of W's rows, split-K index). The
    input tile of each step is formed in registers (normed or gated, rounded to the model dtype) for the ROWS >= L
    rows that can be real only, then padded with zero rows to the BLOCK_L the tensor cores take: the transform is
    elementwise, so a row's values, and the product's reduction order, do not depend on ROWS. (In sm_90 SASS the
    gated step formed on all 16 rows took 1761 instructions a loop iteration, against the plain step's 64: 106 on
    the one row of a decode step. A plain input keeps ROWS = BLOCK_L: its tile then goes to shared memory by
    asynchronous copies, without passing through registers.)"""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tokens = tl.arange(0, BLOCK_L)
    real = tl.arange(0, ROWS)
    row_ok = rows < N
    real_ok = real < L
    wide_rows = rows.to(tl.int64)
    x_rows = x_ptr + real[:, None] * stride_x
    if NORM:    # the rows' 1 / rms over all K (NORM_K), whatever this program's slice: unrolled, every load in flight
        squares = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)     # at once before the product's loop can start
        for k0 in tl.static_range(0, NORM_K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xs = tl.load(x_rows + k[None, :], mask=real_ok[:, None] & (k < K)[None, :], other=0).to(tl.float32)
            squares += xs * xs
        rstd = tl.rsqrt(tl.sum(squares, axis=1) / K + eps)
    acc = tl.zeros((BLOCK_L, BLOCK_N), dtype=tl.float32)
    k_begin = tl.program_id(1) * k_split
    k_end = tl.minimum(k_begin + k_split, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = (k < K) | EVEN_K
        x_mask = real_ok[:, None] & k_ok[None, :]
        xk = tl.load(x_rows + k[None, :], mask=x_mask, other=0)
        if GATED:   # silu_mul's rounding: silu(gate) to the model dtype, then the product
            gate = xk.to(tl.float32)
            up = tl.load(x_rows + K + k[None, :], mask=x_mask, other=0).to(tl.float32)
            silu = round_like(gate / (1.0 + tl.exp(-gate)), out_ptr)
            xk = round_like(silu * up, out_ptr).to(out_ptr.dtype.element_ty)
        if NORM:    # rms_norm's: fp32 x * rstd * scale, rounded to the model dtype
            scale = tl.load(norm_ptr + k, mask=k_ok, other=0)
            xk = round_like(xk.to(tl.float32) * rstd[:, None] * scale[None, :], out_ptr).to(out_ptr.dtype.element_ty)
        w = tl.load(w_ptr + wide_rows[:, None] * stride_w + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0)
        acc = kq._dot(acc, _padded_rows(xk, BLOCK_L), w, IEEE)
    at = tokens[:, None] * N + rows[None, :]
    mask = (tokens < L)[:, None] & row_ok[None, :]
    if SPLIT:
        kq._sum_slices_when_last(acc, out_ptr, res_ptr, partial_ptr, arrivals_ptr, at, mask, L * N, RESIDUAL, ASM)
    else:
        kq.store_tile(acc, out_ptr, res_ptr, at, mask, RESIDUAL)


def dense_linear_triton(x: torch.Tensor, weight: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0,
                        gated: bool = False, residual: torch.Tensor | None = None,
                        config: kq.GemvConfig | None = None) -> torch.Tensor:
    """:func:`dense_linear` in one launch. x: [L, K] ([L, 2K] gated), unit column stride, any row stride, L in
    1..DENSE_ROWS; weight [N, K] in x's dtype; norm [K] fp32; residual [L, N] in x's dtype. Returns [L, N]."""
    op = "dense_linear_triton"
    require_launchable(op, x, weight, *(t for t in (norm, residual) if t is not None))
    require_rows(op, "x", x, 2)
    require_model_dtype(op, x)
    require_rows(op, "weight", weight, 2, x.dtype)
    (rows, width), (n, k) = x.shape, weight.shape
    require(0 < rows <= kq.DENSE_ROWS, op, f"takes 1..{kq.DENSE_ROWS} rows, got {rows}")
    require(not (gated and norm is not None), op, "a gated input is not normed")
    require(width == (2 * k if gated else k), op, f"x has {width} columns for a weight of {k} inputs"
            + (" (gated: twice as many)" if gated else ""))
    if norm is not None:
        require_rows(op, "norm", norm, 1, torch.float32)
        require(norm.shape[0] == k, op, f"norm has {norm.shape[0]} features, the weight {k} inputs")
    if residual is not None:
        require(residual.shape == (rows, n) and residual.dtype == x.dtype, op,
                f"residual must be {(rows, n)} {x.dtype}, got {tuple(residual.shape)} {residual.dtype}")
        residual = residual.contiguous()
    config = config or kq.gemv_config(kq.DENSE, n, k, rows, x.device)
    n_blocks, k_blocks = triton.cdiv(n, config.block_n), triton.cdiv(k, config.block_k)
    splits = kq._splits(x.device, n_blocks, k_blocks, config.splits)
    k_split = triton.cdiv(k_blocks, splits) * config.block_k
    splits = triton.cdiv(k, k_split)
    formed = norm is not None or gated      # an input formed in the kernel: on the rows that can be real only
    out = torch.empty((rows, n), device=x.device, dtype=x.dtype)
    partial = torch.empty((splits, rows, n), device=x.device, dtype=torch.float32) if splits > 1 else out
    _dense_gemv_kernel[(n_blocks, splits)](
        x, weight, norm if norm is not None else out, residual if residual is not None else out, out, partial,
        kq._arrival_counters(x.device, n_blocks), rows, n, k, x.stride(0), weight.stride(0), k_split, eps,
        SPLIT=splits > 1, NORM=norm is not None, GATED=gated, RESIDUAL=residual is not None,
        IEEE=x.dtype == torch.float32 or INTERPRETED, ASM=not INTERPRETED, EVEN_K=k % config.block_k == 0,
        NORM_K=k if norm is not None else 0, ROWS=triton.next_power_of_2(rows) if formed else kq.DENSE_ROWS,
        BLOCK_L=kq.DENSE_ROWS, BLOCK_N=config.block_n, BLOCK_K=config.block_k, num_warps=config.num_warps,
        num_stages=config.num_stages)
    return out
