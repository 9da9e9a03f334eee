"""Token sampling inside the step: temperature / top-k / top-p with a counter-based RNG in the arena (the greedy pick
is a kernel: ``kernels.pick``).

Sampling settings live in small static device tensors (not part of the state: they belong to the request), so one
captured graph serves every setting. The random draw is Gumbel-max over the filtered, sorted logits, keyed by the
arena's (seed, counter); a restored capsule therefore replays the same draws.
"""
from __future__ import annotations

import dataclasses

import torch

from . import rng
from .arena import RNG_COUNTER, RNG_SEED
from .errors import ErrorCode, FlashRTError


# The smallest temperature that sampling accepts (0 means greedy). Logits are divided by it: below this, fp32 logits
# of ordinary size overflow to inf, and inf - inf makes the softmax NaN (a draw that is neither greedy nor a sample).
MIN_TEMPERATURE = 1e-3
MAX_TEMPERATURE = 100.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How a request's tokens are drawn. Checked when made (INVALID_ARGUMENT), so one that exists is valid: it is
    built once where a request enters (a Generate goal, the node's parameters, the CLI) and passed on unchecked.
    Fields by name only: their order differs between this class, the messages and the parameters."""
    temperature: float = 0.0     # 0 = greedy
    top_k: int = 0               # 0 = off
    top_p: float = 1.0           # 1 = off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def __post_init__(self):
        if not (self.temperature == 0.0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE):
            raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"temperature must be 0 (greedy) or in "
                                                           f"[{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if self.top_k < 0:
            raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"top_p must be in (0, 1], got {self.top_p}")


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device):
        self.temperature = torch.ones((), device=device)
        self.top_k = torch.full((), vocab_size, dtype=torch.int64, device=device)
        self.top_p = torch.ones((), device=device)
        self.ranks = torch.arange(vocab_size, device=device)

    def configure(self, params: SamplingParams) -> None:
        """Write the request's settings into the static tensors (no reallocation: graphs keep their addresses)."""
        self.temperature.fill_(params.temperature if not params.greedy else 1.0)
        self.top_k.fill_(params.top_k if params.top_k > 0 else self.ranks.numel())
        self.top_p.fill_(params.top_p)

    def sample(self, logits: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        """Draw one token (shape [1]) and advance the arena's RNG counter."""
        ordered, order = (logits / self.temperature).sort(descending=True)
        probs = ordered.softmax(-1)
        keep = (self.ranks < self.top_k) & ((probs.cumsum(-1) - probs) < self.top_p) | (self.ranks == 0)
        noise = rng.uniform(meta[RNG_SEED], meta[RNG_COUNTER], self.ranks)
        gumbel = -torch.log(-torch.log(noise))
        choice = torch.where(keep, ordered + gumbel, torch.full_like(ordered, float("-inf"))).argmax(-1, keepdim=True)
        meta[RNG_COUNTER] += 1
        return order[choice]
