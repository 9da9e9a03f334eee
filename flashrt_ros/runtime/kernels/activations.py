"""The MLP's gated activation over a fused gate/up projection: reference (plain PyTorch) and Triton kernel."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._layout import require, require_launchable, require_model_dtype, require_rows
from ._rounding import round_like
from ._triton import jit, tl, triton

_BLOCK = 1024


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [L, 2I] (first I columns gate, last I up), rounded as PyTorch does: F.silu in the
    model dtype, then the product in the model dtype. Returns [L, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@jit
def _silu_mul_kernel(gu_ptr, gu_row, out_ptr, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gu_ptr + row * gu_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * gu_row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    silu = round_like(gate / (1.0 + tl.exp(-gate)), out_ptr)
    tl.store(out_ptr + row * inter + cols, round_like(silu * up, out_ptr).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """:func:`silu_mul` in one launch. gate_up: [L, 2I], unit column stride, any row stride. Returns [L, I]
    contiguous."""
    op = "silu_mul_triton"
    require_launchable(op, gate_up)
    require_rows(op, "gate_up", gate_up, 2)
    require_model_dtype(op, gate_up)
    require(gate_up.shape[1] % 2 == 0, op, f"gate_up needs an even number of columns, got {gate_up.shape[1]}")
    length, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((length, inter), dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul_kernel[(length, triton.cdiv(inter, _BLOCK))](gate_up, gate_up.stride(0), out, inter, BLOCK=_BLOCK,
                                                           num_warps=4)
    return out
