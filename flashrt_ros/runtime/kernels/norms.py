"""Normalisations: reference implementations (plain PyTorch)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


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
