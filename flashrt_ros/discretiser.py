"""Uniform binning between continuous values and token ids (the VLA action/observation vocabulary).

``[low, high]`` is cut into ``bins`` equal-width bins; bin ``i`` is token id ``token_offset + i``.
``encode`` maps each value to the bin that contains it; values outside ``[low, high]`` (and ``high``
itself) are **clipped** into the first / last bin, so any float gives a valid token. ``decode`` maps a
token back to its bin's centre, so ``decode(encode(v))`` is within half a bin width of ``clip(v)``.

``horizon`` x ``dims`` is the size of one action chunk (row-major: ``horizon`` steps of ``dims``
values each); :meth:`Discretiser.action_values` turns a request's generated tokens into that chunk.
"""
import math
from dataclasses import dataclass

from flashrt_ros.runtime import ErrorCode, FlashRTError


@dataclass(frozen=True)
class Discretiser:
    low: float = -1.0
    high: float = 1.0
    bins: int = 256
    token_offset: int = 0
    dims: int = 1
    horizon: int = 1

    def __post_init__(self):
        if not (math.isfinite(self.low) and math.isfinite(self.high) and self.low < self.high):
            raise ValueError(f"discretiser needs finite low < high, got low={self.low} high={self.high}")
        for name in ("bins", "dims", "horizon"):
            if getattr(self, name) < 1:
                raise ValueError(f"discretiser.{name} must be >= 1, got {getattr(self, name)}")
        if self.token_offset < 0:
            raise ValueError(f"discretiser.token_offset must be >= 0, got {self.token_offset}")

    @property
    def action_size(self) -> int:
        """Number of values in one action chunk (``horizon * dims``)."""
        return self.horizon * self.dims

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValueError unless every bin's token id is below ``vocab_size``."""
        if self.token_offset + self.bins > vocab_size:
            raise ValueError(
                f"discretiser tokens [{self.token_offset}, {self.token_offset + self.bins}) "
                f"do not fit in the vocabulary of {vocab_size} tokens")

    def is_action_token(self, token_id: int) -> bool:
        return self.token_offset <= token_id < self.token_offset + self.bins

    def encode(self, values) -> list[int]:
        """Token ids for ``values`` (clipped into range; NaN is refused with INVALID_ARGUMENT)."""
        width = (self.high - self.low) / self.bins
        ids = []
        for v in values:
            if math.isnan(v):
                raise FlashRTError(ErrorCode.INVALID_ARGUMENT, "observation values contain NaN")
            index = int((v - self.low) // width) if math.isfinite(v) else (0 if v < 0 else self.bins - 1)
            ids.append(self.token_offset + min(max(index, 0), self.bins - 1))
        return ids

    def decode(self, token_ids) -> list[float]:
        """Bin centres for action token ids (each must satisfy :meth:`is_action_token`)."""
        width = (self.high - self.low) / self.bins
        out = []
        for t in token_ids:
            if not self.is_action_token(t):
                raise ValueError(f"token {t} is not a discretiser token")
            out.append(self.low + (t - self.token_offset + 0.5) * width)
        return out

    def action_values(self, generated_ids) -> tuple[list[int], list[float]] | None:
        """The action chunk in a request's generated tokens, or None if it is not complete.

        Rule: the action is the first ``horizon * dims`` generated tokens that are discretiser
        tokens, in order; other tokens (text, EOS) are skipped. Fewer than that -> no action.
        """
        ids = [t for t in generated_ids if self.is_action_token(t)][: self.action_size]
        if len(ids) < self.action_size:
            return None
        return ids, self.decode(ids)
