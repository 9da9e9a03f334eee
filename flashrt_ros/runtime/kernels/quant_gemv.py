"""Weight-only quantized linear layers, ``y = x @ dequant(W).T``, in two weight formats.

``W`` has ``N`` output rows of ``K`` inputs each:

* **fp8**: ``q`` [N, K] float8_e4m3fn, ``scale`` [N, K // group] fp32, ``w = q * scale`` (``group = K``: one scale per
  output channel; 128: per block).
* **nvfp4**: ``q`` [N, K // 2] uint8 holding two E2M1 codes per byte (low nibble = even ``k``, as compressed-tensors
  packs them), ``scale`` [N, K // 16] float8_e4m3fn, ``row_scale`` [N] fp32, ``w = e2m1(q) * scale * row_scale``.
  ``row_scale`` is 1 / the compressed-tensors global scale of the tensor each row came from, so rows of tensors
  with different global scales can be concatenated into one fused projection.

``*_reference``: dequantise in PyTorch, then ``F.linear`` (the CPU path and the oracle).
``*_triton``: one fused kernel that streams the quantized bytes, dequantises in registers and multiplies, for up to
:data:`GEMV_MAX_ROWS` rows of ``x`` (decode, and prefill pieces up to 256 tokens): the weights are never expanded in
memory, and each block of 64 rows reads them once. Its K-reduction order is fixed by the launch shape, so results
are deterministic. Longer pieces are compute-bound: :func:`dequantize_triton` writes the weights in ``x``'s dtype in
one pass and cuBLAS multiplies.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import INTERPRETED, jit, tl, triton

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)   # magnitudes of codes 0-7; bit 3 is the sign
NVFP4_GROUP = 16
GEMV_MAX_ROWS = 256                 # fused up to here (Thor's 256-token prefill pieces); GEMM beyond
_MAX_BLOCK_L = 64                   # rows per program; more rows run as more programs
_BLOCK_N = 32
_BLOCK_K = 256


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[N, K // 2] uint8 -> [N, K] fp32 E2M1 values (low nibble first)."""
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1).long()
    magnitude = torch.tensor(E2M1_VALUES, device=packed.device)[codes & 7]
    return torch.where(codes >= 8, -magnitude, magnitude)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K] weights of the fp8 format."""
    return q.float() * scale.repeat_interleave(q.shape[1] // scale.shape[1], dim=1)


def dequantize_nvfp4(q: torch.Tensor, scale: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K] weights of the nvfp4 format."""
    block = scale.float().repeat_interleave(NVFP4_GROUP, dim=1)
    return unpack_e2m1(q) * block * row_scale[:, None]


def fp8_linear_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return F.linear(x, dequantize_fp8(q, scale).to(x.dtype))


def nvfp4_linear_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                           row_scale: torch.Tensor) -> torch.Tensor:
    return F.linear(x, dequantize_nvfp4(q, scale, row_scale).to(x.dtype))


@jit
def _e2m1_over_2_14(code):
    """E2M1 code (int32, 0-15) -> its value / 2^14, by bit placement alone: the sign to fp16's sign bit and the
    three magnitude bits (e1 e0 m) to fp16's lowest exponent bits and top mantissa bit. That maps subnormal and
    normal codes alike (0.5 -> 2^-15, 6 -> 1.5 * 2^-12); the 2^14 is folded into the block scale."""
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@jit
def _accumulate(acc, x, w, ONE_ROW: tl.constexpr, IEEE: tl.constexpr):
    """acc += x @ w.T. One row (decode): fp32 FMAs into a [BLOCK_N, k] accumulator that is summed once after the
    loop, so no tensor-core padding. Several rows: tl.dot on w rounded to x's dtype; fp32 inputs multiply in full
    precision, never TF32. Triton's interpreter multiplies bf16 operands of tl.dot as raw bit patterns, so there
    (IEEE is set) both go through fp32.

    One return after an if/elif/else on the constexprs: Triton <= 3.6 still type-checks the statements after a
    ``return`` inside a constexpr ``if`` (as dead code), and ``acc + tl.dot(...)`` does not type-check at ONE_ROW's
    shapes ("CompilationError ... incompatible dimensions")."""
    if ONE_ROW:
        acc = acc + w * x.to(tl.float32)
    elif IEEE:
        acc = acc + tl.dot(x.to(tl.float32), tl.trans(w.to(x.dtype).to(tl.float32)), input_precision="ieee")
    else:
        acc = acc + tl.dot(x, tl.trans(w.to(x.dtype)))
    return acc


@jit
def _quant_gemv_kernel(x_ptr, q_ptr, s_ptr, r_ptr, out_ptr, L, N, K, stride_x, k_split,
                       NVFP4: tl.constexpr, GROUP: tl.constexpr, PER_CHANNEL: tl.constexpr, IEEE: tl.constexpr,
                       ONE_ROW: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       TILE_K: tl.constexpr):
    """One [BLOCK_L, BLOCK_N] output tile over one K slice: out[split, l, n]. Program axes: row block of W, split-K
    index, block of x's rows (each block re-reads its weights: fine up to GEMV_MAX_ROWS, where the GEMM path starts).

    ONE_ROW (BLOCK_L 1) is decode, with elementwise FMAs; otherwise rows are padded to BLOCK_L >= 16 for tl.dot.
    TILE_K: weight columns per step (BLOCK_K bytes of fp8, BLOCK_K / 2 bytes of packed nvfp4)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tokens = tl.program_id(2) * BLOCK_L + tl.arange(0, BLOCK_L)
    row_ok = rows < N
    token_ok = tokens < L
    wide_rows = rows.to(tl.int64)
    if ONE_ROW:
        acc = tl.zeros((BLOCK_N, TILE_K), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_L, BLOCK_N), dtype=tl.float32)
    # fp8 loads take no `other`: their masked lanes are undefined (maybe NaN) until zeroed with tl.where.
    k_begin = tl.program_id(1) * k_split
    for k0 in range(k_begin, k_begin + k_split, BLOCK_K):
        if NVFP4:
            byte_index = k0 // 2 + tl.arange(0, TILE_K)               # byte j holds k = 2j (low) and 2j + 1 (high)
            w_mask = row_ok[:, None] & (byte_index < K // 2)[None, :]
            packed = tl.load(q_ptr + wide_rows[:, None] * (K // 2) + byte_index[None, :], mask=w_mask, other=0)
            packed = packed.to(tl.int32)
            # One E4M3 scale per 8 bytes: load the [BLOCK_N, TILE_K / 8] scales once, then widen them in registers
            # (a per-byte gather would issue 8x the loads of the weights themselves).
            group = k0 // 16 + tl.arange(0, TILE_K // 8)
            s_mask = row_ok[:, None] & (group < K // 16)[None, :]
            scale = tl.load(s_ptr + wide_rows[:, None] * (K // 16) + group[None, :], mask=s_mask)
            scale = tl.where(s_mask, scale.to(tl.float32) * 16384.0, 0.0)
            scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_N, TILE_K // 8, 8)), (BLOCK_N, TILE_K))
            x_mask = token_ok[:, None] & (byte_index < K // 2)[None, :]
            x_even = tl.load(x_ptr + tokens[:, None] * stride_x + 2 * byte_index[None, :], mask=x_mask, other=0)
            x_odd = tl.load(x_ptr + tokens[:, None] * stride_x + 2 * byte_index[None, :] + 1, mask=x_mask, other=0)
            acc = _accumulate(acc, x_even, _e2m1_over_2_14(packed & 15) * scale, ONE_ROW, IEEE)
            acc = _accumulate(acc, x_odd, _e2m1_over_2_14(packed >> 4) * scale, ONE_ROW, IEEE)
        else:
            k = k0 + tl.arange(0, BLOCK_K)
            w_mask = row_ok[:, None] & (k < K)[None, :]
            w = tl.where(w_mask, tl.load(q_ptr + wide_rows[:, None] * K + k[None, :], mask=w_mask).to(tl.float32),
                         0.0)
            if not PER_CHANNEL:                                       # per-channel scales apply after the loop
                w = w * tl.load(s_ptr + wide_rows[:, None] * (K // GROUP) + (k // GROUP)[None, :], mask=w_mask,
                                other=0)
            xk = tl.load(x_ptr + tokens[:, None] * stride_x + k[None, :], mask=token_ok[:, None] & (k < K)[None, :],
                         other=0)
            acc = _accumulate(acc, xk, w, ONE_ROW, IEEE)
    if ONE_ROW:
        result = tl.sum(acc, axis=1)[None, :]
    else:
        result = acc
    if NVFP4:
        result = result * tl.load(r_ptr + rows, mask=row_ok, other=0)[None, :]
    elif PER_CHANNEL:
        result = result * tl.load(s_ptr + rows, mask=row_ok, other=0)[None, :]
    out = out_ptr + tl.program_id(1) * L * N + tokens[:, None] * N + rows[None, :]
    tl.store(out, result.to(out_ptr.dtype.element_ty), mask=token_ok[:, None] & row_ok[None, :])


def _splits(device: torch.device, n_blocks: int, k_blocks: int) -> int:
    """Split K until there are ~4 programs per SM (a 1024-row GEMV has only 32 row blocks), never below one block."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, min(k_blocks, -(-4 * sms // n_blocks)))


def _launch(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, row_scale: torch.Tensor | None,
            n: int, k: int, group: int) -> torch.Tensor:
    if triton is None:
        raise RuntimeError("Triton is not available")
    rows = x.shape[0]
    if not 0 < rows <= GEMV_MAX_ROWS:
        raise ValueError(f"the fused GEMV takes 1..{GEMV_MAX_ROWS} rows, got {rows}")
    x = x.contiguous()
    block_l = 1 if rows == 1 else min(_MAX_BLOCK_L, max(16, triton.next_power_of_2(rows)))
    n_blocks, k_blocks, l_blocks = triton.cdiv(n, _BLOCK_N), triton.cdiv(k, _BLOCK_K), triton.cdiv(rows, block_l)
    splits = _splits(x.device, n_blocks * l_blocks, k_blocks)
    k_split = triton.cdiv(k_blocks, splits) * _BLOCK_K
    splits = triton.cdiv(k, k_split)
    out = torch.empty((splits, rows, n), device=x.device, dtype=x.dtype if splits == 1 else torch.float32)
    nvfp4 = row_scale is not None
    _quant_gemv_kernel[(n_blocks, splits, l_blocks)](
        x, q, scale, row_scale if nvfp4 else scale, out, rows, n, k, x.stride(0), k_split,
        NVFP4=nvfp4, GROUP=group, PER_CHANNEL=not nvfp4 and group == k, IEEE=x.dtype == torch.float32 or INTERPRETED,
        ONE_ROW=rows == 1, BLOCK_L=block_l, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K, TILE_K=_BLOCK_K // 2 if nvfp4 else _BLOCK_K, num_warps=4)
    return out[0] if splits == 1 else out.sum(0).to(x.dtype)   # fixed-order reduction: deterministic


def fp8_linear_triton(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    return _launch(x, q, scale, None, n, k, k // scale.shape[1])


def nvfp4_linear_triton(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                        row_scale: torch.Tensor) -> torch.Tensor:
    n, k = q.shape[0], 2 * q.shape[1]
    return _launch(x, q, scale, row_scale, n, k, NVFP4_GROUP)


@jit
def _dequant_kernel(q_ptr, s_ptr, r_ptr, out_ptr, N, K, NVFP4: tl.constexpr, GROUP: tl.constexpr,
                    BLOCK_N: tl.constexpr, TILE_K: tl.constexpr):
    """out [N, K] (the dtype of out) = dequant(W) for one [BLOCK_N, TILE_K] tile of stored columns."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * TILE_K + tl.arange(0, TILE_K)        # bytes of nvfp4, values of fp8
    wide_rows = rows.to(tl.int64)
    if NVFP4:
        mask = (rows < N)[:, None] & (cols < K // 2)[None, :]
        packed = tl.load(q_ptr + wide_rows[:, None] * (K // 2) + cols[None, :], mask=mask, other=0).to(tl.int32)
        scale = tl.load(s_ptr + wide_rows[:, None] * (K // 16) + (cols // 8)[None, :], mask=mask)
        scale = tl.where(mask, scale.to(tl.float32) * 16384.0, 0.0)
        row_scale = tl.load(r_ptr + rows, mask=rows < N, other=0)[:, None]
        out = out_ptr + wide_rows[:, None] * K + 2 * cols[None, :]
        ty = out_ptr.dtype.element_ty
        # (e2m1 * block scale) is exact; then the row scale: the reference's order, so fp32 results are bit-equal.
        tl.store(out, (_e2m1_over_2_14(packed & 15) * scale * row_scale).to(ty), mask=mask)
        tl.store(out + 1, (_e2m1_over_2_14(packed >> 4) * scale * row_scale).to(ty), mask=mask)
    else:
        mask = (rows < N)[:, None] & (cols < K)[None, :]
        w = tl.where(mask, tl.load(q_ptr + wide_rows[:, None] * K + cols[None, :], mask=mask).to(tl.float32), 0.0)
        w = w * tl.load(s_ptr + wide_rows[:, None] * (K // GROUP) + (cols // GROUP)[None, :], mask=mask, other=0)
        tl.store(out_ptr + wide_rows[:, None] * K + cols[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_triton(q: torch.Tensor, scale: torch.Tensor, row_scale: torch.Tensor | None,
                      dtype: torch.dtype) -> torch.Tensor:
    """The [N, K] weights in ``dtype``, in one pass over the stored bytes (the prefill path for long pieces)."""
    nvfp4 = row_scale is not None
    n, k = q.shape[0], q.shape[1] * (2 if nvfp4 else 1)
    out = torch.empty((n, k), device=q.device, dtype=dtype)
    tile_k = _BLOCK_K // 2 if nvfp4 else _BLOCK_K
    _dequant_kernel[(triton.cdiv(n, _BLOCK_N), triton.cdiv(q.shape[1], tile_k))](
        q, scale, row_scale if nvfp4 else scale, out, n, k, NVFP4=nvfp4,
        GROUP=NVFP4_GROUP if nvfp4 else k // scale.shape[1], BLOCK_N=_BLOCK_N, TILE_K=tile_k, num_warps=4)
    return out
