"""Reference kernels in plain PyTorch (CPU and CUDA), plus optional fla-core kernels on CUDA.

Every function writes its recurrent outputs into caller-owned buffers (``copy_``), never rebinding them, so the
same code runs eagerly on the CPU and inside captured CUDA graphs over the arena.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

try:  # optional production kernels (pure Python + Triton); parity-tested against the reference below
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as _fla_chunk
except Exception:  # noqa: BLE001 - any import failure just means "not available"
    _fla_chunk = None


def fla_available() -> bool:
    return _fla_chunk is not None and torch.cuda.is_available()


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's zero-centred RMSNorm: normalise in fp32, multiply by ``scale`` = (1 + w) in fp32."""
    return F.rms_norm(x.float(), scale.shape, scale, eps).type_as(x)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (plain weight) followed by a SiLU gate, as at the output of a Gated DeltaNet layer."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = (weight * xf.to(dtype)) * F.silu(gate.float())
    return out.to(dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU over ``x`` [L, C] continuing from ``state`` [K-1, C] (time-major).

    The state is updated in place to the last K-1 inputs, so a stream conv'd in pieces equals one conv over all of it.
    """
    window = torch.cat([state, x.to(state.dtype)], dim=0)               # [K-1+L, C]
    out = F.conv1d(window.t().unsqueeze(0), weight.unsqueeze(1), groups=weight.shape[0])
    state.copy_(window[window.shape[0] - state.shape[0]:])
    return F.silu(out[0].t()).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` features of x [L, H, D] (non-interleaved halves); the rest pass through."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)


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


def delta_rule_chunked(q, k, v, g, beta, state: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """Gated delta rule over chunks (the prefill kernel): same contract as :func:`delta_rule_recurrent`.

    Within a chunk the sequential updates are folded into one triangular solve (the WY / UT form); across chunks the
    fp32 state is carried. Zero padding of the last chunk (k = v = 0, beta = 0, g = 0) leaves the state unchanged.
    """
    out_dtype = v.dtype
    length = q.shape[0]
    chunk = min(chunk, max(1, length))
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
    """fla-core's chunked kernel with the same contract (CUDA only)."""
    q, k = _expand_heads(q, k, v.shape[1])
    out, final = _fla_chunk(q[None], k[None], v[None], g=g[None].float(), beta=beta[None],
                            initial_state=state[None], output_final_state=True, use_qk_l2norm_in_kernel=True)
    state.copy_(final[0])
    return out[0]


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
