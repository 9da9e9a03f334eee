"""INTERIM references for the new fused-op contracts (replaced by the per-module ones being written)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .delta_rule import _fla_chunk, delta_rule_chunked, delta_rule_fla, delta_rule_recurrent
from .norms import rms_norm
from .rope import apply_rope


def add_rms_norm(x, residual, scale, eps):
    summed = residual + x
    return rms_norm(summed, scale, eps), summed


def silu_mul(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _last_real(length, count, device):
    index = torch.arange(length, device=device)
    return index if count is None else torch.minimum(index, count - 1)


def causal_conv(x, state, weight, count=None):
    k1 = state.shape[0]
    window = torch.cat([state, x.to(state.dtype)], dim=0)
    out = F.conv1d(window.t().unsqueeze(0), weight.unsqueeze(1), groups=weight.shape[0])
    end = x.shape[0] if count is None else count
    idx = torch.arange(k1, device=x.device) + end
    state.copy_(window.index_select(0, idx))
    return F.silu(out[0].t()).to(x.dtype)


def qk_norm_rope_kv_write(q, k, v, q_scale, k_scale, eps, cos, sin, kv_cache, positions, count=None):
    q = apply_rope(rms_norm(q, q_scale, eps), cos, sin)
    k = apply_rope(rms_norm(k, k_scale, eps), cos, sin)
    rows = _last_real(q.shape[0], count, q.device)
    at = positions.index_select(0, rows)
    kv_cache[:, 0].index_copy_(0, at, k.index_select(0, rows))
    kv_cache[:, 1].index_copy_(0, at, v.index_select(0, rows))
    return q


def _gates(a, b, A_log, dt_bias, count):
    beta = b.sigmoid().float()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, beta


def gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, count=None):
    """Recurrent over the rows; rows >= count keep the state bit for bit (torch.where, not arithmetic: -0.0 + 0.0
    would flip a sign bit)."""
    from .delta_rule import _delta_rule_inputs
    g, beta = _gates(a, b, A_log, dt_bias, count)
    out_dtype = v.dtype
    q, k, v, g, beta = _delta_rule_inputs(q, k, v, g, beta)
    real = torch.ones(q.shape[0], dtype=torch.bool, device=q.device) if count is None else \
        torch.arange(q.shape[0], device=q.device) < count
    s = state.clone()
    outs = []
    for t in range(q.shape[0]):
        decayed = s * g[t].exp()[:, None, None]
        delta = (v[t] - torch.einsum("hk,hkv->hv", k[t], decayed)) * beta[t][:, None]
        s = torch.where(real[t], decayed + k[t][:, :, None] * delta[:, None, :], s)
        outs.append(torch.einsum("hk,hkv->hv", q[t], s))
    state.copy_(s)
    return torch.stack(outs).to(out_dtype)


def delta_rule_long(q, k, v, a, b, A_log, dt_bias, state, count=None):
    g, beta = _gates(a, b, A_log, dt_bias, count)
    return delta_rule_chunked(q, k, v, g, beta, state)


def delta_rule_fla_gated(q, k, v, a, b, A_log, dt_bias, state, count=None):
    g, beta = _gates(a, b, A_log, dt_bias, count)
    return delta_rule_fla(q, k, v, g, beta, state)
