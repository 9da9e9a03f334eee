"""Causal GQA attention over the position-major KV cache: reference implementations, a flash-decoding Triton kernel
that also applies the output gate (:func:`attention_decode_triton`, the contract of :func:`attention_decode_reference`)
and a prefill entry point that keeps K/V unrepeated (:func:`attention_prefill`, the contract of
:func:`attention_causal`)."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.backends.cuda import SDPAParams, can_use_flash_attention
from torch.nn.attention.bias import causal_lower_right

from ._layout import require, require_launchable, require_model_dtype, require_rows
from ._rounding import round_like
from ._triton import INTERPRETED, ROW_ORDERED_DOT, jit, row_ordered_dot, tl, triton


def attention_masked(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention of a few queries at ``positions`` over a position-major KV prefix (decode, small pieces).

    q: [L, H, D]; keys/values: [T, Hkv, D] where T is a bucket >= last position + 1; entries past each query's
    position are masked, so stale bytes beyond the live position never matter and one captured graph serves every
    position in the bucket. The query heads sharing a KV head are folded into the query length. Scores in the model
    dtype, softmax in fp32 (as HF's eager attention). Returns [L, H, D].
    """
    length, heads, dim = q.shape
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    q = q.view(length, kv_heads, groups, dim).permute(1, 2, 0, 3).reshape(kv_heads, groups * length, dim)
    scores = torch.bmm(q, keys.permute(1, 2, 0)) * dim ** -0.5                # [Hkv, G*L, T]
    span = torch.arange(keys.shape[0], device=q.device)
    visible = span[None, :] <= positions.repeat(groups)[:, None]
    probs = scores.float().masked_fill(~visible, float("-inf")).softmax(-1).to(values.dtype)
    out = torch.bmm(probs, values.transpose(0, 1))                             # [Hkv, G*L, D]
    return out.view(kv_heads, groups, length, dim).permute(2, 0, 1, 3).reshape(length, heads, dim)


def output_gate(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Qwen3.5's attention output gate, ``out * sigmoid(gate)`` in the model dtype (as transformers computes it)."""
    return out * torch.sigmoid(gate)


def attention_decode_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                               gate: torch.Tensor) -> torch.Tensor:
    """Decode attention as the model uses it: :func:`attention_masked` through :func:`output_gate`; gate [L, H, D]."""
    return output_gate(attention_masked(q, keys, values, positions), gate)


def attention_causal(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention of a prefill chunk whose L queries are the last L of exactly T = len(keys) positions.

    The causal structure is passed to SDPA as a lower-right bias (never materialised), so a flash kernel runs.
    """
    length, heads, _ = q.shape
    groups = heads // keys.shape[1]
    keys, values = (x.repeat_interleave(groups, dim=1).transpose(0, 1)[None] for x in (keys, values))
    bias = causal_lower_right(length, keys.shape[2])
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=bias)
    return out[0].transpose(0, 1)


def _flash_takes_gqa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether SDPA's flash kernel runs these [1, heads, length, D] tensors with fewer KV heads than query heads.
    (Its memory-efficient kernel has no GQA: without flash, grouped SDPA would fall back to the math kernel.)"""
    return q.is_cuda and can_use_flash_attention(SDPAParams(q, keys, values, None, 0.0, False, True))


def attention_prefill(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """:func:`attention_causal` without repeated K/V where SDPA's flash kernel takes grouped heads (CUDA, fp16/bf16):
    the lower-right causal bias then dispatches to the flash kernel with the KV heads as they are (strided row views
    of the cache are fine: only the last dimension needs unit stride). Elsewhere it is :func:`attention_causal`."""
    length, heads, _ = q.shape
    qh, kh, vh = (x.transpose(0, 1)[None] for x in (q, keys, values))
    grouped = heads != keys.shape[1]
    if grouped and not _flash_takes_gqa(qh, kh, vh):
        return attention_causal(q, keys, values)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(length, keys.shape[0]),
                                         enable_gqa=grouped)
    return out[0].transpose(0, 1)


@jit
def _dot(a, b, FP32: tl.constexpr):
    """a @ b accumulated in fp32; with FP32 the operands are taken in fp32 at full precision (Triton's default for
    fp32 is TF32). FP32 is set for fp32 inputs, and under Triton's interpreter, whose tl.dot multiplies bf16
    operands as their raw uint16 bits (triton 3.9.0); there the product is summed over K in order instead
    (ROW_ORDERED_DOT). (One return: see quant_gemv._accumulate.)"""
    if ROW_ORDERED_DOT:
        out = row_ordered_dot(a, b)
    elif FP32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@jit
def _attention_split_kernel(q_ptr, q_row, q_head, k_ptr, k_row, k_head, v_ptr, v_row, v_head, pos_ptr,
                            acc_ptr, max_ptr, sum_ptr, length, span, heads, dim, splits, scale,
                            GROUPS: tl.constexpr, ROWS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, FP32_DOT: tl.constexpr):
    """One program per (block of ROWS query rows, KV head, split of SPLIT keys): the ROWS x GROUPS query heads that
    share the KV head are the BLOCK_M rows of one tile, so each K/V block is read once for all of them. Online
    softmax in fp32 over the split's keys up to the block's last position; stores the unnormalised partial output,
    its running max and sum. Keys past a row's position are masked; a split past every row's position reads nothing.
    """
    kv_head, split = tl.program_id(1), tl.program_id(2)
    m = tl.arange(0, BLOCK_M)
    rows = tl.program_id(0) * ROWS + m // GROUPS
    row_heads = kv_head * GROUPS + m % GROUPS
    live = (m // GROUPS < ROWS) & (rows < length)
    pos = tl.load(pos_ptr + rows, mask=live, other=-1).to(tl.int32)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < dim
    q = tl.load(q_ptr + rows[:, None] * q_row + row_heads[:, None] * q_head + dims[None, :],
                mask=live[:, None] & dim_mask[None, :], other=0.0)
    run_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    start = split * SPLIT
    end = tl.minimum(tl.minimum(start + SPLIT, span), tl.max(pos, axis=0) + 1)
    for block in range(start, end, BLOCK_N):
        cols = block + tl.arange(0, BLOCK_N)
        kv_mask = (cols < end)[:, None] & dim_mask[None, :]
        kb = tl.load(k_ptr + cols[:, None] * k_row + kv_head * k_head + dims[None, :], mask=kv_mask, other=0.0)
        scores = _dot(q, tl.trans(kb), FP32_DOT) * scale
        scores = tl.where(cols[None, :] <= pos[:, None], scores, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(scores, axis=1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row with no visible key yet: keep zeros
        p = tl.exp(scores - shift[:, None])
        rescale = tl.exp(run_max - shift)
        run_sum = run_sum * rescale + tl.sum(p, axis=1)
        vb = tl.load(v_ptr + cols[:, None] * v_row + kv_head * v_head + dims[None, :], mask=kv_mask, other=0.0)
        acc = acc * rescale[:, None] + _dot(p.to(vb.dtype), vb, FP32_DOT)
        run_max = new_max
    slot = (rows * heads + row_heads) * splits + split
    keep = live & (start <= pos)
    tl.store(max_ptr + slot, run_max, mask=keep)
    tl.store(sum_ptr + slot, run_sum, mask=keep)
    tl.store(acc_ptr + slot[:, None] * dim + dims[None, :], acc, mask=keep[:, None] & dim_mask[None, :])


@jit
def _attention_combine_kernel(acc_ptr, max_ptr, sum_ptr, pos_ptr, gate_ptr, gate_row, gate_head, out_ptr, heads, dim,
                              splits, SPLIT: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr,
                              BLOCK_D: tl.constexpr):
    """One program per (query row, head, BLOCK_D of the head's dims): merges the partials of the splits that hold
    keys <= the row's position, CHUNK_S splits per load (the loads of a chunk are independent, so a short bucket is
    one round trip to memory), then applies the output gate with :func:`output_gate`'s roundings (the attention
    output, the sigmoid and the product each rounded to the model dtype)."""
    row, head = tl.program_id(0), tl.program_id(1)
    live_splits = tl.minimum(tl.load(pos_ptr + row).to(tl.int32) // SPLIT + 1, splits)
    base = (row * heads + head) * splits
    s = tl.arange(0, BLOCK_S)
    maxes = tl.load(max_ptr + base + s, mask=s < live_splits, other=float("-inf"))
    top = tl.max(maxes, axis=0)
    total = tl.sum(tl.exp(maxes - top) * tl.load(sum_ptr + base + s, mask=s < live_splits, other=0.0), axis=0)
    dims = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    dim_mask = dims < dim
    acc = tl.zeros([BLOCK_D], tl.float32)
    for first in range(0, live_splits, CHUNK_S):
        chunk = first + tl.arange(0, CHUNK_S)
        in_chunk = chunk < live_splits
        weights = tl.exp(tl.load(max_ptr + base + chunk, mask=in_chunk, other=float("-inf")) - top)
        partial = tl.load(acc_ptr + (base + chunk)[:, None] * dim + dims[None, :],
                          mask=in_chunk[:, None] & dim_mask[None, :], other=0.0)
        acc += tl.sum(weights[:, None] * partial, axis=0)
    out = round_like(acc / total, out_ptr)
    gate = tl.load(gate_ptr + row * gate_row + head * gate_head + dims, mask=dim_mask, other=0.0).to(tl.float32)
    out = round_like(out * round_like(tl.sigmoid(gate), out_ptr), out_ptr)
    tl.store(out_ptr + (row * heads + head) * dim + dims, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


TARGET_PROGRAMS = 256  # split programs a one-row launch aims at when the bucket is long (an H200 has 132 SMs)
PIECE_TARGET_PROGRAMS = 512  # and a launch of several rows (see launch_config)
TILE_ELEMENTS_PER_WARP = 4096  # fewer warps would hold more than 128 fp32 accumulators a thread: spills
COMBINE_CHUNK = 32     # splits the combine loads at once
COMBINE_DIMS = 64      # head dims per combine program: a one-token step has only heads programs otherwise (8 on
                       # the 0.8B), each loading every split's whole partial ([32, 64] fp32: 16 registers a thread)


class AttentionLaunch(NamedTuple):
    """How the split kernel is launched: query rows x heads per tile (BLOCK_M), keys per block (BLOCK_N), the split
    programs aimed at, and warps."""
    block_m: int
    block_n: int
    target_programs: int
    num_warps: int


def launch_config(length: int, groups: int, dim: int) -> AttentionLaunch:
    """One query row's GROUPS heads in a tile of >= 16 rows (tl.dot's least), aiming at TARGET_PROGRAMS split
    programs; several rows packed into up to 64 rows, aiming at PIECE_TARGET_PROGRAMS; 64 keys a block (32 past head
    dim 128); the fewest warps that hold the tile (at least 4, :data:`TILE_ELEMENTS_PER_WARP`). On an H100
    (h100_91cdd6e/attention_sweep_qwen3.5-0.8b.json, 24 rows at 16k) this took the 0.8B's capsule-suffix piece from
    58.1 us (32-row tiles, 8 warps, 256 programs) to 32.1, the fastest of 88 launches; 4 warps beat 8 on every tile
    up to 64 x 256. ``bench/time_attention.py --sweep`` times the alternatives on a GPU."""
    block_d = triton.next_power_of_2(dim)
    block_m, target = max(16, triton.next_power_of_2(groups)), TARGET_PROGRAMS
    if length * groups > block_m:
        block_m, target = min(64, triton.next_power_of_2(length * groups)), PIECE_TARGET_PROGRAMS
    return AttentionLaunch(block_m, 64 if block_d <= 128 else 32, target,
                           max(4, block_m * block_d // TILE_ELEMENTS_PER_WARP))


def _decode_plan(length: int, kv_heads: int, groups: int, span: int, dim: int, launch: AttentionLaunch) -> dict:
    """Static tile sizes for a launch (they depend on shapes only, so one captured graph serves every position)."""
    rows = max(1, launch.block_m // groups)
    row_blocks = triton.cdiv(length, rows)
    wanted = triton.cdiv(launch.target_programs, row_blocks * kv_heads)
    split = max(launch.block_n, triton.next_power_of_2(triton.cdiv(span, wanted)))
    return dict(rows=rows, row_blocks=row_blocks, block_m=launch.block_m, block_n=launch.block_n,
                block_d=triton.next_power_of_2(dim), split=split, splits=triton.cdiv(span, split),
                warps=launch.num_warps)


def attention_decode_triton(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                            gate: torch.Tensor, launch: AttentionLaunch | None = None) -> torch.Tensor:
    """:func:`attention_decode_reference` as flash decoding: the bucket's keys are cut into splits, one program per
    (rows, KV head, split), and a second kernel merges the splits' partial softmaxes and applies the output gate.
    Splits past a row's position cost one position load, so the work follows the live position, not the bucket.
    q, gate: [L, H, D]; keys/values: [T, Hkv, D] (row views of the cache: any row and head strides, unit last
    stride); positions: [L] int64 on the device, each < T. Scores and softmax in fp32. Returns [L, H, D] contiguous
    in q's dtype. ``launch`` replaces :func:`launch_config`'s (a sweep)."""
    op = "attention_decode_triton"
    require_launchable(op, q, keys, values, positions, gate)
    for name, t in (("q", q), ("keys", keys), ("values", values), ("gate", gate)):
        require_rows(op, name, t, 3, q.dtype)
    require_model_dtype(op, q)
    require_rows(op, "positions", positions, 1, torch.int64)
    length, heads, dim = q.shape
    span, kv_heads = keys.shape[:2]
    require(values.shape == keys.shape and keys.shape[2] == dim and heads % kv_heads == 0
            and positions.shape[0] == length and gate.shape == q.shape, op,
            f"q {tuple(q.shape)}, keys {tuple(keys.shape)}, values {tuple(values.shape)}, positions "
            f"{tuple(positions.shape)}, gate {tuple(gate.shape)}: need keys/values [T, Hkv, D] with Hkv dividing H, "
            f"L positions and a gate shaped as q")
    require(dim >= 16, op, f"head dim must be >= 16 (tl.dot), got {dim}")
    groups = heads // kv_heads
    launch = launch or launch_config(length, groups, dim)
    require(launch.block_m >= max(16, groups) and launch.block_n >= 16, op,
            f"{launch}: a tile needs >= 16 rows holding one row's {groups} heads, and >= 16 keys")
    plan = _decode_plan(length, kv_heads, groups, span, dim, launch)
    splits = plan["splits"]
    acc = torch.empty(length, heads, splits, dim, dtype=torch.float32, device=q.device)
    maxes = torch.empty(length, heads, splits, dtype=torch.float32, device=q.device)
    sums = torch.empty(length, heads, splits, dtype=torch.float32, device=q.device)
    _attention_split_kernel[(plan["row_blocks"], kv_heads, splits)](
        q, q.stride(0), q.stride(1), keys, keys.stride(0), keys.stride(1), values, values.stride(0), values.stride(1),
        positions, acc, maxes, sums, length, span, heads, dim, splits, dim ** -0.5, GROUPS=groups, ROWS=plan["rows"],
        SPLIT=plan["split"], BLOCK_M=plan["block_m"], BLOCK_N=plan["block_n"], BLOCK_D=plan["block_d"],
        FP32_DOT=q.dtype == torch.float32 or INTERPRETED, num_warps=plan["warps"],
        num_stages=2)
    out = torch.empty(length, heads, dim, dtype=q.dtype, device=q.device)
    block_s, block_dims = triton.next_power_of_2(splits), min(plan["block_d"], COMBINE_DIMS)
    _attention_combine_kernel[(length, heads, triton.cdiv(dim, block_dims))](
        acc, maxes, sums, positions, gate, gate.stride(0), gate.stride(1), out, heads, dim, splits,
        SPLIT=plan["split"], BLOCK_S=block_s, CHUNK_S=min(block_s, COMBINE_CHUNK), BLOCK_D=block_dims, num_warps=2)
    return out
