"""Rotary position embedding, and the attention input stage it belongs to (q/k RMSNorm + RoPE + the KV write):
reference implementations (plain PyTorch) and the fused Triton kernel."""
from __future__ import annotations

import torch

from ._layout import (num_warps_for, require, require_count, require_launchable, require_model_dtype,
                      require_rows)
from ._rounding import round_like
from ._triton import jit, tl, triton
from .norms import rms_norm


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` features of x [L, H, D] (non-interleaved halves); the rest pass through."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)


def mrope_components(rotary_dim: int, section: tuple[int, int, int]) -> torch.Tensor:
    """Which position component (0 temporal, 1 height, 2 width) rotates each of the ``rotary_dim`` features: HF's
    interleaved M-RoPE (``Qwen3_5TextRotaryEmbedding.recomposition_frequencies``): frequency j follows the height
    when j % 3 == 1 and j < 3 * section[1], the width when j % 3 == 2 and j < 3 * section[2], else time; both halves
    of the rotary part share the frequencies. [rotary_dim] int64 (CPU)."""
    half = torch.arange(rotary_dim // 2)
    component = torch.zeros_like(half)
    for axis in (1, 2):
        component[(half % 3 == axis) & (half < 3 * section[axis])] = axis
    return torch.cat([component, component])


def mrope_rows(table: torch.Tensor, positions: torch.Tensor, components: torch.Tensor) -> torch.Tensor:
    """The cos (or sin) rows of tokens with 3-component rotary positions: ``out[i, j] = table[positions[i,
    components[j]], j]``. table: [T, R] (one row per plain position), positions: [L, 3] int64, components: [R]
    (:func:`mrope_components`). A token whose three components are equal gets exactly ``table[p]``. Plain indexing,
    so it is capturable in a CUDA graph and feeds either attention input stage unchanged."""
    columns = torch.arange(table.shape[1], device=table.device)
    return table[positions[:, components], columns]


def qk_norm_rope_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_scale: torch.Tensor,
                          k_scale: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                          kv_cache: torch.Tensor, positions: torch.Tensor,
                          count: torch.Tensor | None = None) -> torch.Tensor:
    """Attention inputs: returns rope(rms_norm(q)) [L, H, D]; writes kv_cache[positions[i], 0] = rope(rms_norm(k[i]))
    and kv_cache[positions[i], 1] = v[i] for the real rows i < count (all rows when ``count`` is None).

    q: [L, H, D], k, v: [L, Hkv, D]; cos, sin: [L, R] (each query's rows: of its rotary position, which after an
    image differs from its KV row and may have three components, see :func:`mrope_rows`); kv_cache: [T, 2, Hkv, D]
    (one layer of the position-major arena KV); positions: [L] int64, the KV rows. Padding rows (i >= count) write nothing: they are redirected to
    the last real row, which is written twice with the same bytes.
    """
    q_out = apply_rope(rms_norm(q, q_scale, eps), cos, sin)
    k = apply_rope(rms_norm(k, k_scale, eps), cos, sin)
    if count is not None:
        real = torch.minimum(torch.arange(q.shape[0], device=q.device), count - 1)
        positions, k, v = positions[real], k[real], v[real]
    kv_cache[:, 0].index_copy_(0, positions, k)
    kv_cache[:, 1].index_copy_(0, positions, v)
    return q_out


@jit
def _norm_rope_store(src_ptr, scale_ptr, dst_ptr, store_mask, cos, sin, d, partner, d_mask, rot, D, eps):
    """dst[d] = rope(rms_norm(src))[d] for one head, in the references' rounding order: the norm in fp32 cast to the
    model dtype, then x * cos and rotated * sin each rounded, then their sum rounded; features past R pass through."""
    dtype = dst_ptr.dtype.element_ty
    x = tl.load(src_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
    x_partner = tl.load(src_ptr + partner, mask=rot, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    normed = round_like(x * rstd * tl.load(scale_ptr + d, mask=d_mask, other=0.0), dst_ptr)
    normed_partner = round_like(x_partner * rstd * tl.load(scale_ptr + partner, mask=rot, other=0.0), dst_ptr)
    sign = tl.where(partner > d, -1.0, 1.0)            # first half: rotated = -x[d + R/2]; second half: x[d - R/2]
    a = round_like(normed * cos, dst_ptr)
    b = round_like(sign * normed_partner * sin, dst_ptr)
    out = tl.where(rot, round_like(a + b, dst_ptr), normed)
    tl.store(dst_ptr + d, out.to(dtype), mask=store_mask)


@jit
def _qk_norm_rope_kv_kernel(q_ptr, q_row, q_head, k_ptr, k_row, k_head, v_ptr, v_row, v_head, q_scale_ptr,
                            k_scale_ptr, cos_ptr, cos_row, sin_ptr, sin_row, kv_ptr, kv_pos, kv_kind, kv_head,
                            pos_ptr, pos_stride, count_ptr, out_ptr, L, H, D, R, eps, HAS_COUNT: tl.constexpr,
                            BLOCK_D: tl.constexpr):
    """Program (i, h): query head h of row i when h < H, else KV head h - H of row i (norm + rope + KV write)."""
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < D
    rot = d < R
    half = R // 2
    partner = tl.where(d < half, d + half, d - half)
    cos = tl.load(cos_ptr + i * cos_row + d, mask=rot, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + i * sin_row + d, mask=rot, other=0.0).to(tl.float32)
    if h < H:
        _norm_rope_store(q_ptr + i * q_row + h * q_head, q_scale_ptr, out_ptr + (i * H + h) * D, d_mask, cos, sin,
                         d, partner, d_mask, rot, D, eps)
    else:
        j = h - H
        if HAS_COUNT:
            count = tl.load(count_ptr)
        else:
            count = L
        kv_mask = d_mask & (tl.zeros([BLOCK_D], dtype=tl.int64) + i < count)     # real rows only
        dst = kv_ptr + tl.load(pos_ptr + i * pos_stride) * kv_pos + j * kv_head
        _norm_rope_store(k_ptr + i * k_row + j * k_head, k_scale_ptr, dst, kv_mask, cos, sin, d, partner,
                         d_mask, rot, D, eps)
        value = tl.load(v_ptr + i * v_row + j * v_head + d, mask=d_mask, other=0.0)
        tl.store(dst + kv_kind + d, value, mask=kv_mask)


def qk_norm_rope_kv_write_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_scale: torch.Tensor,
                                 k_scale: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                                 kv_cache: torch.Tensor, positions: torch.Tensor,
                                 count: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`qk_norm_rope_kv_write` in one launch. Every tensor needs unit stride in its last dimension; other
    strides are free (q, k, v may be views of one fused projection; kv_cache a layer slice of the arena)."""
    op = "qk_norm_rope_kv_write_triton"
    require_launchable(op, q, k, v, q_scale, k_scale, cos, sin, kv_cache, positions)
    require_rows(op, "q", q, 3)
    require_model_dtype(op, q)
    length, heads, dim = q.shape
    require_rows(op, "k", k, 3, q.dtype)
    require_rows(op, "v", v, 3, q.dtype)
    kv_heads = k.shape[1]
    require(k.shape == v.shape == (length, kv_heads, dim), op,
            f"k and v must be [L, Hkv, D] = [{length}, Hkv, {dim}], got {tuple(k.shape)} and {tuple(v.shape)}")
    for name, scale in (("q_scale", q_scale), ("k_scale", k_scale)):
        require_rows(op, name, scale, 1, torch.float32)
        require(scale.shape[0] == dim, op, f"{name} must have D = {dim} entries, got {scale.shape[0]}")
    for name, table in (("cos", cos), ("sin", sin)):
        require_rows(op, name, table, 2, q.dtype)
    rot = cos.shape[1]
    require(cos.shape == sin.shape and cos.shape[0] == length and rot % 2 == 0 and 0 < rot <= dim, op,
            f"cos and sin must be [L, R] with L = {length} and R even in (0, {dim}], got {tuple(cos.shape)} and "
            f"{tuple(sin.shape)}")
    require_rows(op, "kv_cache", kv_cache, 4, q.dtype)
    require(kv_cache.shape[1:] == (2, kv_heads, dim), op,
            f"kv_cache must be [T, 2, {kv_heads}, {dim}], got {tuple(kv_cache.shape)}")
    require(positions.dim() == 1 and positions.shape[0] == length and positions.dtype == torch.int64, op,
            f"positions must be [L] = [{length}] int64, got {tuple(positions.shape)} {positions.dtype}")
    require_count(op, count, q.device)
    out = torch.empty((length, heads, dim), dtype=q.dtype, device=q.device)
    block = triton.next_power_of_2(dim)
    _qk_norm_rope_kv_kernel[(length, heads + kv_heads)](
        q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1), q_scale, k_scale,
        cos, cos.stride(0), sin, sin.stride(0), kv_cache, kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        positions, positions.stride(0), positions if count is None else count, out, length, heads, dim, rot, eps,
        HAS_COUNT=count is not None, BLOCK_D=block, num_warps=num_warps_for(block))
    return out
