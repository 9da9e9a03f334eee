"""Weight-only quantization: the encoders, the quantized weight and linear module, and :func:`targets`, which names
the projections a format quantizes (``weights.load`` builds them straight into :class:`QuantLinear`).

Formats (``weights_format``): ``dense`` (weights stay in the engine's dtype), ``fp8`` (E4M3, one fp32 scale per output
channel, or per block of inputs when read from a block-scaled checkpoint) and ``nvfp4`` (E2M1 values packed two per
byte, an E4M3 scale per 16 values and an fp32 global scale, as compressed-tensors' ``nvfp4-pack-quantized`` writes
them). Activations stay in the engine's dtype (W8A16 / W4A16). Rounding is to nearest, ties to even, as in
compressed-tensors. The layout of the tensors is described in :mod:`.kernels.quant_gemv`.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import math

import torch
import torch.nn.functional as F
from torch import nn

from .errors import ErrorCode, FlashRTError
from .kernels import quant_gemv as kq
from .vision.config import VISUAL

FORMATS = ("dense", "fp8", "nvfp4")
FP8_MAX = 448.0                      # largest finite float8_e4m3fn
E2M1_MAX = 6.0
LM_HEAD = "lm_head"                  # the name patterns use for the output projection, tied to the embedding or not
_ROWS_PER_SLICE = 4096               # quantize in row slices: bounded temporaries for a 248k-row LM head
# E2M1 rounding: a value between codes i and i + 1 rounds up when it exceeds the midpoint, and at the midpoint
# itself only when i + 1 is the even code (ties to even); midpoints of 0|0.5, 1|1.5, 2|3, 4|6 tie down.
_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(kq.E2M1_VALUES, kq.E2M1_VALUES[1:]))


@dataclasses.dataclass
class QuantizedWeight:
    """One weight matrix [N, K] in ``fmt``; ``row_scale`` only for nvfp4 (see :mod:`.kernels.quant_gemv`)."""
    fmt: str
    q: torch.Tensor
    scale: torch.Tensor
    row_scale: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1] * (2 if self.fmt == "nvfp4" else 1)

    def dequantize(self) -> torch.Tensor:
        if self.fmt == "fp8":
            return kq.dequantize_fp8(self.q, self.scale)
        return kq.dequantize_nvfp4(self.q, self.scale, self.row_scale)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"q": self.q, "scale": self.scale}
        if self.row_scale is not None:
            out["row_scale"] = self.row_scale
        return out

    @property
    def group(self) -> int:
        """Inputs per scale (fp8: K for one scale per output channel; nvfp4: always 16)."""
        return self.shape[1] // self.scale.shape[1]

    @staticmethod
    def empty(fmt: str, n: int, k: int, group: int, device: torch.device) -> "QuantizedWeight":
        """Uninitialised storage of an [N, K] weight in ``fmt`` (fp8 with one scale per ``group`` inputs)."""
        if fmt == "fp8":
            return QuantizedWeight(fmt, torch.empty(n, k, dtype=torch.float8_e4m3fn, device=device),
                                   torch.empty(n, k // group, device=device))
        return QuantizedWeight(fmt, torch.empty(n, k // 2, dtype=torch.uint8, device=device),
                               torch.empty(n, k // kq.NVFP4_GROUP, dtype=torch.float8_e4m3fn, device=device),
                               torch.empty(n, device=device))

    def rows(self, start: int, stop: int) -> "QuantizedWeight":
        """Rows ``start:stop`` (views: writing them writes this weight)."""
        return QuantizedWeight(self.fmt, self.q[start:stop], self.scale[start:stop],
                               None if self.row_scale is None else self.row_scale[start:stop])

    def copy_(self, src: "QuantizedWeight") -> None:
        """Write ``src`` (same format and shape) into this weight; fp8 scales are repeated when ``src`` has coarser
        groups (exact: each of its scales covers whole groups of ours)."""
        self.q.copy_(src.q)
        self.scale.copy_(src.scale.repeat_interleave(src.group // self.group, dim=1))
        if self.row_scale is not None:
            self.row_scale.copy_(src.row_scale)


def fp8_block_group(cols: int, k: int) -> int:
    """Inputs per scale of ours that tile blocks ``cols`` wide over K inputs, the partial last block too."""
    return math.gcd(cols, k)


def fp8_from_blocks(q: torch.Tensor, blocks: torch.Tensor, rows: int, cols: int) -> QuantizedWeight:
    """fp8 codes [N, K] with one scale per ``rows`` x ``cols`` block (edge blocks partial), exactly: each block's
    scale repeated over its rows and over the groups (:func:`fp8_block_group`) that tile its inputs."""
    n, k = q.shape
    group = fp8_block_group(cols, k)
    scale = blocks.float().repeat_interleave(rows, dim=0)[:n].repeat_interleave(cols // group, dim=1)[:, :k // group]
    return QuantizedWeight("fp8", q, scale.contiguous())


def _row_slices(w: torch.Tensor):
    for start in range(0, w.shape[0], _ROWS_PER_SLICE):
        yield w[start:start + _ROWS_PER_SLICE].float()


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code (0-15, bit 3 = sign) of fp32 values already scaled into [-6, 6] (ties to even)."""
    magnitude = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for i, mid in enumerate(_MIDPOINTS):
        code += (magnitude >= mid) if (i + 1) % 2 == 0 else (magnitude > mid)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes -> [N, K // 2] bytes, even k in the low nibble."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def quantize_fp8(w: torch.Tensor) -> QuantizedWeight:
    """E4M3 with one fp32 scale per output channel (amax / 448); an all-zero row gets scale 1."""
    qs, scales = [], []
    for rows in _row_slices(w):
        scale = rows.abs().amax(dim=1, keepdim=True) / FP8_MAX
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        qs.append((rows / scale).to(torch.float8_e4m3fn))
        scales.append(scale)
    return QuantizedWeight("fp8", torch.cat(qs), torch.cat(scales))


def nvfp4_global_scale(w: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' global scale: 448 * 6 / amax, so the largest block scale is the largest E4M3 value."""
    amax = w.abs().amax().float()
    return (FP8_MAX * E2M1_MAX / amax if amax > 0 else torch.ones((), device=w.device)).reshape(1)


def quantize_nvfp4(w: torch.Tensor, global_scale: torch.Tensor | None = None) -> QuantizedWeight:
    """NVFP4: block scale = E4M3(block amax / 6 * global scale); value = E2M1(w * global scale / block scale)."""
    n, k = w.shape
    if k % kq.NVFP4_GROUP:
        raise FlashRTError(ErrorCode.LOAD_FAILED, f"nvfp4 needs K divisible by {kq.NVFP4_GROUP}, got {k}")
    gs = nvfp4_global_scale(w) if global_scale is None else global_scale.float().reshape(1)
    packed, scales = [], []
    for rows in _row_slices(w):
        blocks = rows.reshape(rows.shape[0], -1, kq.NVFP4_GROUP)
        scale = (blocks.abs().amax(dim=-1) / E2M1_MAX * gs).to(torch.float8_e4m3fn)
        divisor = scale.float()[..., None] / gs
        scaled = torch.where(divisor > 0, blocks / divisor, torch.zeros_like(blocks)).clamp(-E2M1_MAX, E2M1_MAX)
        packed.append(pack_e2m1(e2m1_codes(scaled.reshape(rows.shape))))
        scales.append(scale)
    row_scale = (1.0 / gs).expand(n).contiguous()
    return QuantizedWeight("nvfp4", torch.cat(packed), torch.cat(scales), row_scale)


QUANTIZERS = {"fp8": quantize_fp8, "nvfp4": quantize_nvfp4}
_LINEAR = {"fp8": (kq.fp8_linear_reference, kq.fp8_linear_triton),          # (reference, fused), by format
           "nvfp4": (kq.nvfp4_linear_reference, kq.nvfp4_linear_triton)}


def weight_bytes(fmt: str, n: int, k: int, dense_element_size: int) -> int:
    """Bytes a format stores (and a GEMV reads) for an [N, K] weight; the one formula the bench projections use."""
    if fmt == "fp8":
        return n * k + 4 * n
    if fmt == "nvfp4":
        return n * k // 2 + n * k // kq.NVFP4_GROUP + 4 * n
    return n * k * dense_element_size


# ---- the module and the model walk ---------------------------------------------------------------------------------
class QuantLinear(nn.Module):
    """``y = x @ dequant(W).T`` for a bias-free projection. With ``use_triton``, up to
    :func:`~.kernels.quant_gemv.fused_max_rows` rows (decode and short pieces) use the fused GEMV and longer pieces
    a one-pass Triton dequantise + GEMM; without (the CPU), PyTorch dequantises and multiplies."""

    def __init__(self, weight: QuantizedWeight, use_triton: bool):
        super().__init__()
        self.fmt = weight.fmt
        self.out_features, self.in_features = weight.shape
        self.use_triton = use_triton
        self.kind = kq.weight_kind(self.fmt == "nvfp4", self.in_features // weight.scale.shape[1], self.in_features)
        for name, tensor in weight.tensors().items():   # parameters, so the weights digest covers their bytes
            setattr(self, name, nn.Parameter(tensor, requires_grad=False))

    def weight(self, out_features: int | None = None) -> QuantizedWeight:
        """The stored weight, or its first ``out_features`` output rows (views: every tensor is row-major)."""
        row_scale = getattr(self, "row_scale", None)
        rows = slice(out_features)
        return QuantizedWeight(self.fmt, self.q[rows], self.scale[rows], None if row_scale is None else row_scale[rows])

    def forward(self, x: torch.Tensor, out_features: int | None = None) -> torch.Tensor:
        """``x @ W.T``, or of W's first ``out_features`` rows only."""
        flat, weight = x.reshape(-1, self.in_features), self.weight(out_features)
        reference, fused = _LINEAR[self.fmt]
        if not self.use_triton:
            out = reference(flat, *weight.tensors().values())
        elif flat.shape[0] <= kq.fused_max_rows(self.kind, flat.device):
            out = fused(flat, *weight.tensors().values())
        else:
            out = F.linear(flat, kq.dequantize_triton(weight.q, weight.scale, weight.row_scale, x.dtype))
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def extra_repr(self) -> str:
        return f"{self.fmt}, in_features={self.in_features}, out_features={self.out_features}"


def parse_patterns(text: str) -> tuple[str, ...]:
    """``"*.linear_attn.*, lm_head"`` -> the exclude patterns (how the node parameter and the CLI spell them)."""
    return tuple(p.strip() for p in text.split(",") if p.strip())


def is_excluded(name: str, exclude: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in exclude)


def targets(model: nn.Module, fmt: str, exclude: tuple[str, ...] = ()) -> list[str]:
    """The (fused) projections ``fmt`` stores quantized: every bias-free ``nn.Linear`` of the text model and the LM head
    (``lm_head``, tied to the embedding or not) not matched by an ``exclude`` pattern (``fnmatch``, e.g.
    ``*.linear_attn.*``); never the vision tower (Qwen's FP8 releases keep it in bf16).
    The LM head is built as ``model.quantized_head`` (read by ``Qwen35.logits``); the embedding stays dense."""
    if fmt not in FORMATS:
        raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"weights_format must be one of {FORMATS}, got {fmt!r}")
    if fmt == "dense":
        return []
    names = [name for name, module in model.named_modules()
             if isinstance(module, nn.Linear) and module.bias is None and name != LM_HEAD
             and not name.startswith(VISUAL) and not is_excluded(name, exclude)]
    return names + ([] if is_excluded(LM_HEAD, exclude) else [LM_HEAD])


def identity(fmt: str, use_triton: bool) -> str:
    """What the fingerprint records of the format, e.g. ``nvfp4/triton``."""
    return fmt if fmt == "dense" else f"{fmt}/{'triton' if use_triton else 'reference'}"
