"""Weight-only quantization: the encoders, the quantized linear module, reading compressed-tensors checkpoints, and
:func:`quantize_model`, which swaps a loaded (and fused) model's ``nn.Linear`` modules for :class:`QuantLinear`.

Formats (``weights_format``): ``dense`` (weights stay in the engine's dtype), ``fp8`` (E4M3, one fp32 scale per output
channel, or per 128-wide block when read from a block-scaled checkpoint) and ``nvfp4`` (E2M1 values packed two per
byte, an E4M3 scale per 16 values and an fp32 global scale, as compressed-tensors' ``nvfp4-pack-quantized`` writes
them). Activations stay in the engine's dtype (W8A16 / W4A16). Rounding is to nearest, ties to even, as in
compressed-tensors. The layout of the tensors is described in :mod:`.kernels.quant_gemv`.
"""
from __future__ import annotations

import dataclasses
import fnmatch

import torch
import torch.nn.functional as F
from torch import nn

from .errors import ErrorCode, FlashRTError
from .kernels import quant_gemv as kq

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

    @staticmethod
    def cat(pieces: list["QuantizedWeight"]) -> "QuantizedWeight":
        """Row-wise concatenation (a fused projection from separately quantized tensors)."""
        fmt = pieces[0].fmt
        if any(p.fmt != fmt for p in pieces) or len({p.scale.shape[1] for p in pieces}) != 1:
            raise FlashRTError(ErrorCode.LOAD_FAILED, "fused projection from tensors of different quantization")
        rows = None if fmt == "fp8" else torch.cat([p.row_scale for p in pieces])
        return QuantizedWeight(fmt, torch.cat([p.q for p in pieces]), torch.cat([p.scale for p in pieces]), rows)


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


# ---- compressed-tensors checkpoints ------------------------------------------------------------------------------
# Tensor names as compressed-tensors writes them, per quantized module `<name>`:
#   nvfp4-pack-quantized: <name>.weight_packed (uint8 [N, K/2]), <name>.weight_scale (float8_e4m3fn [N, K/16]),
#                         <name>.weight_global_scale (fp32 [1]); dequant = e2m1 * weight_scale / weight_global_scale
#   float-quantized (FP8): <name>.weight (float8_e4m3fn [N, K]), <name>.weight_scale (fp32 [N, 1] per channel,
#                         [1] per tensor, or [ceil(N/B), ceil(K/B)] per block); dequant = weight * weight_scale
CHECKPOINT_SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale", "weight_zero_point",
                       "input_global_scale", "input_scale")


def is_quantized_checkpoint_tensor(name: str, tensor: torch.Tensor) -> bool:
    suffix = name.rsplit(".", 1)[-1]
    return suffix in CHECKPOINT_SUFFIXES or (suffix == "weight" and tensor.dtype == torch.float8_e4m3fn)


def from_checkpoint(module: str, parts: dict[str, torch.Tensor]) -> QuantizedWeight:
    """A :class:`QuantizedWeight` from one module's compressed-tensors tensors (keys: the suffixes above).

    Activation scales (``input_*``, W4A4/W8A8 checkpoints) are ignored: activations stay in the engine's dtype."""
    def bad(why: str) -> FlashRTError:
        return FlashRTError(ErrorCode.LOAD_FAILED, f"quantized tensor {module!r}: {why}")
    if "weight_zero_point" in parts and bool(parts["weight_zero_point"].any()):
        raise bad("asymmetric quantization (nonzero weight_zero_point) is not supported")
    scale = parts.get("weight_scale")
    if scale is None:
        raise bad("no weight_scale")
    if "weight_packed" in parts:
        packed, gs = parts["weight_packed"], parts.get("weight_global_scale")
        if gs is None or packed.dtype != torch.uint8 or scale.dtype != torch.float8_e4m3fn:
            raise bad("nvfp4 needs uint8 weight_packed, float8_e4m3fn weight_scale and weight_global_scale")
        n, k = packed.shape[0], 2 * packed.shape[1]
        if tuple(scale.shape) != (n, k // kq.NVFP4_GROUP):
            raise bad(f"weight_scale has shape {tuple(scale.shape)}, expected {(n, k // kq.NVFP4_GROUP)}")
        row_scale = (1.0 / gs.float().reshape(1)).expand(n).contiguous()
        return QuantizedWeight("nvfp4", packed.contiguous(), scale.contiguous(), row_scale)
    weight = parts.get("weight")
    if weight is None or weight.dtype != torch.float8_e4m3fn:
        raise bad("neither weight_packed (nvfp4) nor a float8_e4m3fn weight (fp8)")
    return QuantizedWeight("fp8", weight.contiguous(), _fp8_scale_per_row(scale.float(), *weight.shape, bad))


def _fp8_scale_per_row(scale: torch.Tensor, n: int, k: int, bad) -> torch.Tensor:
    """Per-tensor, per-channel or per-block scales as [N, K // group] (block scales repeated over their rows)."""
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(n, 1).contiguous()
    if tuple(scale.shape) in ((n,), (n, 1)):
        return scale.reshape(n, 1).contiguous()
    if scale.dim() == 2 and k % scale.shape[1] == 0:
        block = k // scale.shape[1]                      # square blocks (compressed-tensors' block_structure)
        if block % kq.RUN:
            raise bad(f"fp8 block scales must span a multiple of {kq.RUN} columns, got blocks of {block}")
        if -(-n // block) == scale.shape[0]:
            return scale.repeat_interleave(block, dim=0)[:n].contiguous()
    raise bad(f"unsupported fp8 weight_scale shape {tuple(scale.shape)} for a weight of {(n, k)}")


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

    def weight(self) -> QuantizedWeight:
        return QuantizedWeight(self.fmt, self.q, self.scale, getattr(self, "row_scale", None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat, weight = x.reshape(-1, self.in_features), self.weight()
        reference, fused = _LINEAR[self.fmt]
        if not self.use_triton:
            out = reference(flat, *weight.tensors().values())
        elif flat.shape[0] <= kq.fused_max_rows(self.kind, flat.device):
            out = fused(flat, *weight.tensors().values())
        else:
            out = F.linear(flat, kq.dequantize_triton(weight.q, weight.scale, weight.row_scale, x.dtype))
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.fmt}, in_features={self.in_features}, out_features={self.out_features}"


def parse_patterns(text: str) -> tuple[str, ...]:
    """``"*.linear_attn.*, lm_head"`` -> the exclude patterns (how the node parameter and the CLI spell them)."""
    return tuple(p.strip() for p in text.split(",") if p.strip())


def is_excluded(name: str, exclude: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in exclude)


def _from_checkpoint_pieces(name: str, dense: torch.Tensor,
                            checkpoint: dict[str, QuantizedWeight]) -> QuantizedWeight | None:
    """The checkpoint's quantized tensors that this (possibly fused) projection was loaded from, concatenated.

    A fused projection's rows are its source tensors one after another; the sources are the checkpoint modules under
    the same parent whose dequantised values tile ``dense`` (the loader filled ``dense`` with exactly those values),
    so this holds whatever names and order the fusion uses. None when no checkpoint tensor under the parent fits."""
    if name in checkpoint:
        return checkpoint.pop(name)
    parent = name.rpartition(".")[0]
    candidates = [n for n in checkpoint if n.rpartition(".")[0] == parent and checkpoint[n].shape[1] == dense.shape[1]]
    pieces, row = [], 0
    while row < dense.shape[0] and candidates:
        match = next((n for n in candidates if checkpoint[n].shape[0] <= dense.shape[0] - row and torch.equal(
            checkpoint[n].dequantize().to(dense.dtype), dense[row:row + checkpoint[n].shape[0]])), None)
        if match is None:
            break
        candidates.remove(match)
        pieces.append(match)
        row += checkpoint[match].shape[0]
    if row != dense.shape[0] or not pieces:
        return None
    return QuantizedWeight.cat([checkpoint.pop(n) for n in pieces])


def quantize_model(model: nn.Module, fmt: str, exclude: tuple[str, ...] = (), use_triton: bool = False) -> str:
    """Replace every bias-free ``nn.Linear`` (and the LM head, named ``lm_head``) not matched by an ``exclude``
    pattern (``fnmatch``, e.g. ``*.linear_attn.*``) with a :class:`QuantLinear` in ``fmt``; run after loading and
    fusing. Weights that ``weights.load_model`` read from a quantized checkpoint (``model.quantized_checkpoint``:
    module name -> weight) keep their stored bytes when ``fmt`` is theirs; everything else is quantized here from
    the dense weights. Returns the identity the fingerprint records, e.g. ``nvfp4/triton``."""
    if fmt not in FORMATS:
        raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"weights_format must be one of {FORMATS}, got {fmt!r}")
    checkpoint = model.__dict__.pop("quantized_checkpoint", {})
    if fmt == "dense":
        return fmt
    stored = {n: w for n, w in checkpoint.items() if w.fmt == fmt}

    def quantized(name: str, dense: torch.Tensor) -> QuantLinear:
        weight = _from_checkpoint_pieces(name, dense, stored) or QUANTIZERS[fmt](dense)
        return QuantLinear(weight, use_triton)

    with torch.no_grad():
        targets = [name for name, module in model.named_modules()
                   if isinstance(module, nn.Linear) and module.bias is None and name != LM_HEAD
                   and not is_excluded(name, exclude)]
        for name in targets:   # one dense weight at a time is replaced (and freed)
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name), attr, quantized(name, model.get_submodule(name).weight))
        if not is_excluded(LM_HEAD, exclude):
            # Read by Qwen35.logits(). The embedding stays dense for lookups; an untied dense head is dropped.
            model.quantized_head = quantized(LM_HEAD, model.output_weight())
            if hasattr(model, LM_HEAD):
                del model.lm_head
    return f"{fmt}/{'triton' if use_triton else 'reference'}"
