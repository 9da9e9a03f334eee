"""Normalisations: reference implementations (plain PyTorch) and their fused Triton kernels (``*_triton``, same
signature and contract).

The Triton kernels mimic the references' rounding sequence (fp32 statistics, rounding to the model dtype at the same
points, to nearest even also in Triton's interpreter), so they differ from the references only by the fp32 rounding of
the statistics and of exp/rsqrt.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._layout import num_warps_for, require, require_launchable, require_model_dtype, require_rows
from ._rounding import round_like
from ._triton import jit, tl, triton


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's zero-centred RMSNorm: normalise in fp32, multiply by ``scale`` = (1 + w) in fp32."""
    return F.rms_norm(x.float(), scale.shape, scale, eps).type_as(x)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, scale: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x): the residual add (rounded to the model dtype) and the next norm."""
    summed = residual + x
    return rms_norm(summed, scale, eps), summed


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (plain weight) followed by a SiLU gate, as at the output of a Gated DeltaNet layer."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = (weight * xf.to(dtype)) * F.silu(gate.float())
    return out.to(dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


@jit
def _rms_norm_kernel(x_ptr, x_row, res_ptr, res_row, scale_ptr, out_ptr, sum_ptr, D, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr):
    """One row per program: optionally summed = residual + x (rounded, stored), then out = rms_norm(summed)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * x_row + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(res_ptr + row * res_row + cols, mask=mask, other=0.0)
        x = round_like(residual.to(tl.float32) + x.to(tl.float32), sum_ptr).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * D + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
    scale = tl.load(scale_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * D + cols, round_like(xf * rstd * scale, out_ptr).to(out_ptr.dtype.element_ty), mask=mask)


def _check_rms_inputs(op: str, x: torch.Tensor, scale: torch.Tensor) -> None:
    require_launchable(op, x, scale)
    require_rows(op, "x", x, 2)
    require_model_dtype(op, x)
    require_rows(op, "scale", scale, 1, torch.float32)
    require(scale.shape[0] == x.shape[1], op, f"scale has {scale.shape[0]} features, x has {x.shape[1]}")


def _launch_rms_norm(x, residual, scale, eps, out, summed) -> None:
    block = triton.next_power_of_2(x.shape[1])
    res = x if residual is None else residual
    _rms_norm_kernel[(x.shape[0],)](x, x.stride(0), res, res.stride(0), scale, out, out if summed is None else summed,
                                    x.shape[1], eps, HAS_RESIDUAL=residual is not None, BLOCK_D=block,
                                    num_warps=num_warps_for(block))


def rms_norm_triton(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rms_norm` in one launch. x: [L, D], unit column stride, any row stride. Returns [L, D] contiguous."""
    _check_rms_inputs("rms_norm_triton", x, scale)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_rms_norm(x, None, scale, eps, out, None)
    return out


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, scale: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`add_rms_norm` in one launch writing both outputs ([L, D] contiguous each)."""
    op = "add_rms_norm_triton"
    _check_rms_inputs(op, x, scale)
    require_launchable(op, x, residual)
    require_rows(op, "residual", residual, 2, x.dtype)
    require(residual.shape == x.shape, op, f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty_like(out)
    _launch_rms_norm(x, residual, scale, eps, out, summed)
    return out, summed


@jit
def _gated_rms_norm_kernel(x_ptr, x_row, x_head, g_ptr, g_row, g_head, w_ptr, out_ptr, H, D, eps,
                           BLOCK_D: tl.constexpr):
    """One (row, head) per program, in the reference's rounding order."""
    pid = tl.program_id(0).to(tl.int64)
    row, head = pid // H, pid % H
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * x_row + head * x_head + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(g_ptr + row * g_row + head * g_head + cols, mask=mask, other=0.0).to(tl.float32)
    weight = tl.load(w_ptr + cols, mask=mask, other=0.0)
    normed = round_like(x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps), out_ptr)
    weighted = round_like(weight.to(tl.float32) * normed, out_ptr)
    silu = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + pid * D + cols, round_like(weighted * silu, out_ptr).to(out_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm_triton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`gated_rms_norm` in one launch. x, gate: [L, H, D] with unit last stride (any row and head strides, e.g.
    ``gate`` a column slice of a fused projection); weight: [D] in x's dtype. Returns [L, H, D] contiguous."""
    op = "gated_rms_norm_triton"
    require_launchable(op, x, gate, weight)
    require_rows(op, "x", x, 3)
    require_model_dtype(op, x)
    require_rows(op, "gate", gate, 3, x.dtype)
    require_rows(op, "weight", weight, 1, x.dtype)
    require(gate.shape == x.shape, op, f"gate shape {tuple(gate.shape)} != x shape {tuple(x.shape)}")
    require(weight.shape[0] == x.shape[2], op, f"weight has {weight.shape[0]} features, x has {x.shape[2]}")
    length, heads, dim = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(dim)
    _gated_rms_norm_kernel[(length * heads,)](x, x.stride(0), x.stride(1), gate, gate.stride(0), gate.stride(1),
                                              weight, out, heads, dim, eps, BLOCK_D=block,
                                              num_warps=num_warps_for(block))
    return out
