"""Weight-only quantized linear layers, ``y = x @ dequant(W).T``, in two weight formats.

``W`` has ``N`` output rows of ``K`` inputs each:

* **fp8**: ``q`` [N, K] float8_e4m3fn, ``scale`` [N, K // group] fp32, ``w = q * scale`` (``group = K``: one scale per
  output channel; 128: per block).
* **nvfp4**: ``q`` [N, K // 2] uint8 holding two E2M1 codes per byte (low nibble = even ``k``, as compressed-tensors
  packs them), ``scale`` [N, K // 16] float8_e4m3fn, ``row_scale`` [N] fp32, ``w = e2m1(q) * scale * row_scale``.
  ``row_scale`` is 1 / the compressed-tensors global scale of the tensor each row came from, so rows of tensors
  with different global scales can be concatenated into one fused projection.

``*_reference``: dequantise in PyTorch, then ``F.linear`` (the CPU path, the prefill path, the oracle).
``*_triton``: one fused kernel that streams the quantized bytes, dequantises in registers and multiplies, for up to
:data:`GEMV_MAX_ROWS` rows of ``x`` (decode and small prefill pieces): weight bytes are read once, never expanded
in memory. Its K-reduction order is fixed by the launch shape, so results are deterministic.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ._triton import jit, tl, triton

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)   # magnitudes of codes 0-7; bit 3 is the sign
NVFP4_GROUP = 16
GEMV_MAX_ROWS = 64
_BLOCK_N = 32
_BLOCK_K = 256
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


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
def _e2m1(code):
    """E2M1 code (int32, 0-15) -> fp32 value: subnormal 0 / 0.5, else (1 + m/2) * 2^(e-1)."""
    e = (code >> 1) & 3
    mantissa = (code & 1).to(tl.float32)
    normal = (1.0 + 0.5 * mantissa) * tl.exp2((tl.maximum(e, 1) - 1).to(tl.float32))
    magnitude = tl.where(e == 0, 0.5 * mantissa, normal)
    return tl.where((code & 8) != 0, -magnitude, magnitude)


@jit
def _dot(acc, x, w, IEEE: tl.constexpr):
    """acc += x @ w.T (w dequantised to x's dtype); fp32 inputs multiply in full precision, never TF32. Triton's
    interpreter multiplies bf16 operands as raw bit patterns, so there (IEEE is set) both go through fp32."""
    if IEEE:
        return acc + tl.dot(x.to(tl.float32), tl.trans(w.to(x.dtype).to(tl.float32)), input_precision="ieee")
    return acc + tl.dot(x, tl.trans(w.to(x.dtype)))


@jit
def _quant_gemv_kernel(x_ptr, q_ptr, s_ptr, r_ptr, out_ptr, L, N, K, stride_x, k_split,
                       NVFP4: tl.constexpr, GROUP: tl.constexpr, IEEE: tl.constexpr,
                       BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One [BLOCK_L, BLOCK_N] output tile over one K slice (program axis 1 = split-K index): out[split, l, n]."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tokens = tl.arange(0, BLOCK_L)
    row_ok = rows < N
    token_ok = tokens < L
    wide_rows = rows.to(tl.int64)
    # fp8 loads take no `other`: their masked lanes are undefined (maybe NaN) until zeroed with tl.where.
    acc = tl.zeros((BLOCK_L, BLOCK_N), dtype=tl.float32)
    k_begin = tl.program_id(1) * k_split
    for k0 in range(k_begin, k_begin + k_split, BLOCK_K):
        if NVFP4:
            byte_index = k0 // 2 + tl.arange(0, BLOCK_K // 2)          # byte j holds k = 2j (low) and 2j + 1 (high)
            w_mask = row_ok[:, None] & (byte_index < K // 2)[None, :]
            packed = tl.load(q_ptr + wide_rows[:, None] * (K // 2) + byte_index[None, :], mask=w_mask, other=0)
            scale = tl.load(s_ptr + wide_rows[:, None] * (K // 16) + (byte_index // 8)[None, :], mask=w_mask)
            scale = tl.where(w_mask, scale.to(tl.float32), 0.0)
            packed = packed.to(tl.int32)
            x_mask = token_ok[:, None] & (byte_index < K // 2)[None, :]
            x_even = tl.load(x_ptr + tokens[:, None] * stride_x + 2 * byte_index[None, :], mask=x_mask, other=0)
            x_odd = tl.load(x_ptr + tokens[:, None] * stride_x + 2 * byte_index[None, :] + 1, mask=x_mask, other=0)
            acc = _dot(acc, x_even, _e2m1(packed & 15) * scale, IEEE)
            acc = _dot(acc, x_odd, _e2m1(packed >> 4) * scale, IEEE)
        else:
            k = k0 + tl.arange(0, BLOCK_K)
            w_mask = row_ok[:, None] & (k < K)[None, :]
            w = tl.load(q_ptr + wide_rows[:, None] * K + k[None, :], mask=w_mask).to(tl.float32)
            w = tl.where(w_mask, w, 0.0)
            scale = tl.load(s_ptr + wide_rows[:, None] * (K // GROUP) + (k // GROUP)[None, :], mask=w_mask, other=0)
            xk = tl.load(x_ptr + tokens[:, None] * stride_x + k[None, :], mask=token_ok[:, None] & (k < K)[None, :],
                         other=0)
            acc = _dot(acc, xk, w * scale, IEEE)
    if NVFP4:
        acc = acc * tl.load(r_ptr + rows, mask=row_ok, other=0)[None, :]
    out = out_ptr + tl.program_id(1) * L * N + tokens[:, None] * N + rows[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=token_ok[:, None] & row_ok[None, :])


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
    n_blocks, k_blocks = triton.cdiv(n, _BLOCK_N), triton.cdiv(k, _BLOCK_K)
    splits = _splits(x.device, n_blocks, k_blocks)
    k_split = triton.cdiv(k_blocks, splits) * _BLOCK_K
    splits = triton.cdiv(k, k_split)
    out = torch.empty((splits, rows, n), device=x.device, dtype=x.dtype if splits == 1 else torch.float32)
    nvfp4 = row_scale is not None
    _quant_gemv_kernel[(n_blocks, splits)](
        x, q, scale, row_scale if nvfp4 else scale, out, rows, n, k, x.stride(0), k_split,
        NVFP4=nvfp4, GROUP=group, IEEE=x.dtype == torch.float32 or _INTERPRETED,
        BLOCK_L=max(16, triton.next_power_of_2(rows)), BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K, num_warps=4)
    return out[0] if splits == 1 else out.sum(0).to(x.dtype)   # fixed-order reduction: deterministic


def fp8_linear_triton(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    return _launch(x, q, scale, None, n, k, k // scale.shape[1])


def nvfp4_linear_triton(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                        row_scale: torch.Tensor) -> torch.Tensor:
    n, k = q.shape[0], 2 * q.shape[1]
    return _launch(x, q, scale, row_scale, n, k, NVFP4_GROUP)
