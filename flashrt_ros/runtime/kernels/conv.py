"""The depthwise causal conv of a Gated DeltaNet layer: reference implementation (plain PyTorch)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU over ``x`` [L, C] continuing from ``state`` [K-1, C] (time-major).

    The state is updated in place to the last K-1 inputs, so a stream conv'd in pieces equals one conv over all of it.
    """
    window = torch.cat([state, x.to(state.dtype)], dim=0)               # [K-1+L, C]
    out = F.conv1d(window.t().unsqueeze(0), weight.unsqueeze(1), groups=weight.shape[0])
    state.copy_(window[window.shape[0] - state.shape[0]:])
    return F.silu(out[0].t()).to(x.dtype)
