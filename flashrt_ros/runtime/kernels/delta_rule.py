"""The gated delta rule (Gated DeltaNet's recurrence): reference kernels, recurrent and chunked, plus fla-core."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .norms import l2norm

try:  # optional production kernels (pure Python + Triton); parity-tested against the reference below
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as _fla_chunk
except Exception:  # noqa: BLE001 - any import failure just means "not available"
    _fla_chunk = None


def fla_available() -> bool:
    return _fla_chunk is not None and torch.cuda.is_available()


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
