"""Causal GQA attention over the position-major KV cache: reference implementations."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


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
