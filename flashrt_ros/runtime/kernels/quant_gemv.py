"""Weight-only quantized linear layers, ``y = x @ dequant(W).T``, in two weight formats.

``W`` has ``N`` output rows of ``K`` inputs each:

* **fp8**: ``q`` [N, K] float8_e4m3fn, ``scale`` [N, K // group] fp32, ``w = q * scale`` (``group = K``: one scale per
  output channel; 128: per block).
* **nvfp4**: ``q`` [N, K // 2] uint8 holding two E2M1 codes per byte (low nibble = even ``k``, as compressed-tensors
  packs them), ``scale`` [N, K // 16] float8_e4m3fn, ``row_scale`` [N] fp32, ``w = e2m1(q) * scale * row_scale``.
  ``row_scale`` is 1 / the compressed-tensors global scale of the tensor each row came from, so rows of tensors
  with different global scales can be concatenated into one fused projection.

``*_reference``: dequantise in PyTorch, then ``F.linear`` (the CPU path and the oracle).
``*_triton``: one fused kernel that streams the quantized bytes, dequantises in registers and multiplies, for up to
:data:`GEMV_MAX_ROWS` rows of ``x``: the weights are never expanded in memory. Decode (one row) is bound by
instruction issue, not by bytes, so its steps are written for few instructions per weight (counted in sm_90 SASS
by ``bench/gemv_sass.py``):
nvfp4 codes are read as 32-bit words and decoded two at a time (:func:`_e2m1_pairs_over_2_14`), fp8 bytes are loaded
as uint8 (no masking selects), and runs of 16 products are summed in registers before their scale is applied.
Several rows use ``tl.dot``, and each block of up to 64 rows re-reads the weights, so
:class:`~..quant.QuantLinear` sends only pieces of up to :func:`fused_max_rows` rows here; longer pieces are
compute-bound: :func:`dequantize_triton` writes the weights in ``x``'s dtype in one pass and cuBLAS multiplies.

Launch configurations (tile sizes, warps, pipeline stages, split-K count) come from the fixed table in
:mod:`.quant_gemv_configs`, keyed by device name, weight kind, ``N``, ``K`` and rows bucket, written by
``bench/tune_quant_gemv.py`` from a sweep on that device; unseen shapes and devices get :func:`default_config`.
The configuration fixes the K-reduction order (split-K partials are summed in slice order by whichever slice
finishes last, :func:`_sum_slices_when_last`: timing picks who sums, never the order), so it must be a
deterministic function of shape and device: never ``triton.autotune``, whose timing-dependent choice would let a
capsule persisted on disk continue differently after a restart.
"""
from __future__ import annotations

import functools
import hashlib
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import quant_gemv_configs
from ._rounding import round_like
from ._triton import INTERPRETED, ROW_ORDERED_DOT, jit, row_ordered_dot, tl, triton

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)   # magnitudes of codes 0-7; bit 3 is the sign
NVFP4_GROUP = 16
RUN = 16                            # decode sums runs of this many products before scaling; groups are multiples
GEMV_MAX_ROWS = 256                 # the most rows the fused kernel takes (QuantLinear sends fewer: fused_max_rows)
ROW_BUCKETS = (1, 16, 32, 64)       # rows per program (BLOCK_L); the table's rows key; more rows: more programs
WEIGHT_KINDS = ("fp8", "fp8-block", "nvfp4")   # the table's weight key: fp8 per channel, fp8 block-scaled, nvfp4
DENSE = "dense"                     # the table's weight key of the dense GEMV (:mod:`.dense_gemv`)
DENSE_ROWS = 16                     # its one rows bucket: 1..16 rows share one configuration, so one reduction order
_DEQUANT_BLOCK_N, _DEQUANT_BLOCK_K = 32, 256


class GemvConfig(NamedTuple):
    """One launch configuration. ``block_k``: weight values per step (bytes of fp8, twice the bytes of nvfp4);
    ``splits``: K slices (0: enough for ~4 programs per SM, from the device's SM count)."""
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    splits: int = 0


def rows_bucket(rows: int, kind: str = "") -> int:
    if kind == DENSE:
        return DENSE_ROWS
    return next((b for b in ROW_BUCKETS if b >= rows), ROW_BUCKETS[-1])


def weight_kind(nvfp4: bool, group: int, k: int) -> str:
    return "nvfp4" if nvfp4 else "fp8" if group == k else "fp8-block"


def default_config(kind: str, n: int, k: int, bucket: int) -> GemvConfig:
    """The heuristic for shapes and devices the table does not list (decode: a tile with few instructions per
    weight in sm_90's SASS for both formats, ``bench/gemv_sass.py``; dense: a tensor-core tile of all rows)."""
    if kind == DENSE:
        return GemvConfig(32, 128, 4, 3)
    return GemvConfig(32, 512, 4, 1) if bucket == 1 else GemvConfig(32, 256, 4, 3)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def gemv_config(kind: str, n: int, k: int, rows: int, device: torch.device) -> GemvConfig:
    """The table's configuration for this launch, else :func:`default_config`: a function of shape and device only."""
    bucket = rows_bucket(rows, kind)
    entry = quant_gemv_configs.TABLE.get(device_name(device), {}).get("configs", {}).get((kind, n, k, bucket))
    return GemvConfig(*entry) if entry else default_config(kind, n, k, bucket)


def fused_max_rows(kind: str, device: torch.device) -> int:
    """Up to this many rows QuantLinear takes the fused GEMV; beyond, dequantise + cuBLAS (from the sweep)."""
    limits = quant_gemv_configs.TABLE.get(device_name(device), {}).get("fused_max_rows", {})
    return limits.get(kind, quant_gemv_configs.DEFAULT_FUSED_MAX_ROWS)


def table_digest(device: torch.device) -> str:
    """What the table fixes for this device (its entry and the default threshold), for the engine's fingerprint: a
    capsule continues token-identically only under the reduction orders it was taken with."""
    entry = quant_gemv_configs.TABLE.get(device_name(device), {})
    text = repr((sorted(entry.get("configs", {}).items()), sorted(entry.get("fused_max_rows", {}).items()),
                 quant_gemv_configs.DEFAULT_FUSED_MAX_ROWS))
    return hashlib.sha256(text.encode()).hexdigest()


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[N, K // 2] uint8 -> [N, K] fp32 E2M1 values (low nibble first)."""
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1).long()
    magnitude = torch.tensor(E2M1_VALUES, device=packed.device)[codes & 7]
    return torch.where(codes >= 8, -magnitude, magnitude)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K] weights of the fp8 format."""
    return q.float() * scale.repeat_interleave(q.shape[1] // scale.shape[1], dim=1)


def dequantize_nvfp4(q: torch.Tensor, scale: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K] weights of the nvfp4 format."""
    block = scale.float().repeat_interleave(NVFP4_GROUP, dim=1)
    return unpack_e2m1(q) * block * row_scale[:, None]


def fp8_linear_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return F.linear(x, dequantize_fp8(q, scale).to(x.dtype))


def nvfp4_linear_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                           row_scale: torch.Tensor) -> torch.Tensor:
    return F.linear(x, dequantize_nvfp4(q, scale, row_scale).to(x.dtype))


@jit
def _e2m1_over_2_14(code):
    """E2M1 code (int32, 0-15) -> its value / 2^14, by bit placement alone: the sign to fp16's sign bit and the
    three magnitude bits (e1 e0 m) to fp16's lowest exponent bits and top mantissa bit. That maps subnormal and
    normal codes alike (0.5 -> 2^-15, 6 -> 1.5 * 2^-12); the 2^14 is folded into the block scale."""
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@jit
def _e2m1_pairs_over_2_14(words, ASM: tl.constexpr):
    """Each uint32 word of eight E2M1 codes (nibble n: k = 8j + n) -> four uint32 of two fp16 halves, the codes'
    values / 2^14, for k = (0, 2), (4, 6), (1, 3), (5, 7). The bit placement of :func:`_e2m1_over_2_14`: first every
    code becomes a byte ``s000eem0`` (fp16's high byte: sign at bit 15, magnitude at bits 9-11), the even nibbles'
    in one word and the odd ones' in another (seven integer operations), then each pair of bytes moves into the high
    bytes of two halves, the low bytes zero (one ``prmt`` each): 11 operations for 8 values (the decode loop is
    bound by instruction issue, not by bytes)."""
    even = ((words << 1) & 0x0E0E0E0E) | ((words << 4) & 0x80808080)     # byte b: nibble 2b
    odd = ((words >> 3) & 0x0E0E0E0E) | (words & 0x80808080)             # byte b: nibble 2b + 1
    return (_bytes_to_high_halves(even, 0x1404, ASM), _bytes_to_high_halves(even, 0x3424, ASM),
            _bytes_to_high_halves(odd, 0x1404, ASM), _bytes_to_high_halves(odd, 0x3424, ASM))


@jit
def _bytes_to_high_halves(lanes, SELECTOR: tl.constexpr, ASM: tl.constexpr):
    """Bytes 0 and 1 (SELECTOR 0x1404) or 2 and 3 (0x3424) of each uint32 -> bytes 1 and 3, the others zero."""
    if ASM:
        out = tl.inline_asm_elementwise(f"prmt.b32 $0, $1, 0, {SELECTOR};", "=r,r", [lanes], dtype=tl.uint32,
                                        is_pure=True, pack=1)
    elif SELECTOR == 0x1404:
        out = ((lanes & 0xFF) << 8) | ((lanes & 0xFF00) << 16)
    else:
        out = ((lanes >> 8) & 0xFF00) | (lanes & 0xFF000000)
    return out


@jit
def _f16_halves_to_f32(lanes, ASM: tl.constexpr):
    """The two fp16 halves of each uint32 as two fp32 tensors. On the GPU one ``cvt`` per half, read straight from
    the 32-bit register: as Triton fp16 tensors, the halves of neighbouring elements would first be repacked in
    pairs (a PRMT per two values). ASM is off in the interpreter, which runs no PTX: there the same operation in
    Triton ops (here and in the other ``ASM`` helpers)."""
    if ASM:
        low, high = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }",
            "=r,=r,r", [lanes], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        low = lanes.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        high = (lanes >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return low, high


@jit
def _f32_to_f16_halves(low, high, ASM: tl.constexpr):
    """Two fp32 tensors rounded to fp16 and packed as the low and high halves of one uint32 (one ``cvt``)."""
    if ASM:
        lanes = tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [low, high], dtype=tl.uint32,
                                          is_pure=True, pack=1)
    else:
        lanes = (low.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
                 | (high.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32) << 16))
    return lanes


@jit
def _fma_f16_halves(a, b, c, ASM: tl.constexpr):
    """a * b + c on the fp16 halves of uint32 lanes, two products per instruction (``fma.rn.f16x2``; subnormals kept).
    The interpreter's version rounds through fp32 first (fp16 products are exact in fp32)."""
    if ASM:
        out = tl.inline_asm_elementwise("fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.uint32,
                                        is_pure=True, pack=1)
    else:
        a_low, a_high = _f16_halves_to_f32(a, False)
        b_low, b_high = _f16_halves_to_f32(b, False)
        c_low, c_high = _f16_halves_to_f32(c, False)
        out = _f32_to_f16_halves(a_low * b_low + c_low, a_high * b_high + c_high, False)
    return out


@jit
def _widen(scale, BLOCK_N: tl.constexpr, COLS: tl.constexpr, GROUP_COLS: tl.constexpr):
    """[BLOCK_N, COLS / GROUP_COLS] scales -> [BLOCK_N, COLS], each repeated over its group, in registers (a
    per-value gather would issue as many loads as the weights themselves)."""
    return tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_N, COLS // GROUP_COLS, GROUP_COLS)), (BLOCK_N, COLS))


@jit
def _dot(acc, x, w, IEEE: tl.constexpr):
    """acc += x @ w.T on w rounded to x's dtype; fp32 inputs multiply in full precision, never TF32. Triton's
    interpreter multiplies bf16 operands of tl.dot as raw bit patterns, so there (IEEE is set) both go through fp32,
    summed over K in order (``_triton.row_ordered_dot``).

    One return after an if/else on the constexpr: Triton <= 3.6 still type-checks the statements after a ``return``
    inside a constexpr ``if`` (as dead code), which fails where the dead branch does not type-check."""
    if ROW_ORDERED_DOT:
        acc = acc + row_ordered_dot(x, tl.trans(w.to(x.dtype)))
    elif IEEE:
        acc = acc + tl.dot(x.to(tl.float32), tl.trans(w.to(x.dtype).to(tl.float32)), input_precision="ieee")
    else:
        acc = acc + tl.dot(x, tl.trans(w.to(x.dtype)))
    return acc


@jit
def _fp8_as_f32(raw):
    """float8_e4m3fn bytes loaded as uint8 (masked lanes read as 0, where an fp8 load would leave them undefined)."""
    return raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@jit
def _x_lanes(x_ptr, word, word_ok, x_mul, X_BF16: tl.constexpr, ASM: tl.constexpr):
    """x * x_mul as fp16 halves of four uint32 for each word j, matching :func:`_e2m1_pairs_over_2_14`'s pairs:
    k = 8j + (0, 2), (4, 6), (1, 3), (5, 7). bf16 x is read as 32-bit pairs (k = 8j + 2m and 8j + 2m + 1 in pair
    4j + m): widening a bf16 half to fp32 is one shift or mask."""
    if X_BF16:
        q0 = tl.load(x_ptr + 4 * word, mask=word_ok, other=0).to(tl.uint32, bitcast=True)
        q1 = tl.load(x_ptr + 4 * word + 1, mask=word_ok, other=0).to(tl.uint32, bitcast=True)
        q2 = tl.load(x_ptr + 4 * word + 2, mask=word_ok, other=0).to(tl.uint32, bitcast=True)
        q3 = tl.load(x_ptr + 4 * word + 3, mask=word_ok, other=0).to(tl.uint32, bitcast=True)
        lows = [(q << 16).to(tl.float32, bitcast=True) * x_mul for q in (q0, q1, q2, q3)]
        highs = [(q & 0xFFFF0000).to(tl.float32, bitcast=True) * x_mul for q in (q0, q1, q2, q3)]
        values = (lows[0], lows[1], lows[2], lows[3], highs[0], highs[1], highs[2], highs[3])  # k = 8j + 0, 2, .. 7
    else:
        values = [tl.load(x_ptr + 8 * word + n, mask=word_ok, other=0) * x_mul for n in (0, 2, 4, 6, 1, 3, 5, 7)]
    return (_f32_to_f16_halves(values[0], values[1], ASM), _f32_to_f16_halves(values[2], values[3], ASM),
            _f32_to_f16_halves(values[4], values[5], ASM), _f32_to_f16_halves(values[6], values[7], ASM))


@jit
def _nvfp4_words(q_ptr, wide_rows, row_ok, k0, k_end, stride_q, BLOCK_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K / 8] uint32 words of codes for k0 .. k0 + BLOCK_K (none past k_end): word j holds
    k = 8j .. 8j + 7, nibble i = k - 8j."""
    word = tl.multiple_of(k0 // 8, BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)     # k0: a multiple of BLOCK_K
    words = tl.load(q_ptr + wide_rows[:, None] * stride_q + word[None, :],
                    mask=row_ok[:, None] & (word < k_end // 8)[None, :], other=0)
    return words.to(tl.uint32, bitcast=True)


@jit
def _x_magnitude_exponent(x_ptr, k_begin, k_end, X_BF16: tl.constexpr, BLOCK_K: tl.constexpr):
    """The fp32 exponent field E of max |x[k_begin:k_end]| (|x| < 2^(E - 126)), at least 14 (see
    :func:`_nvfp4_row_step`). bf16 x is read as 32-bit pairs; the maximum is taken on the magnitudes' bits, which
    order as the values do."""
    biggest = tl.zeros((BLOCK_K // 2,), dtype=tl.uint32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if X_BF16:
            pair = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            raw = tl.load(x_ptr + pair, mask=pair < k_end // 2, other=0).to(tl.uint32, bitcast=True)
            biggest = tl.maximum(biggest, tl.maximum((raw << 16) & 0x7FFFFFFF, raw & 0x7FFF0000))
        else:
            k = k0 + tl.arange(0, BLOCK_K // 2)
            for half in tl.static_range(2):
                raw = tl.load(x_ptr + k + half * (BLOCK_K // 2), mask=k + half * (BLOCK_K // 2) < k_end, other=0)
                biggest = tl.maximum(biggest, raw.to(tl.uint32, bitcast=True) & 0x7FFFFFFF)
    return tl.maximum(tl.max(biggest, axis=0) >> 23, 14)


@jit
def _nvfp4_word_products(sums, words, x_ptr, word, word_ok, x_mul, X_BF16: tl.constexpr, ASM: tl.constexpr):
    """sums (fp16 halves) += the products of one word of codes per group with their x: four fma.rn.f16x2."""
    w02, w46, w13, w57 = _e2m1_pairs_over_2_14(words, ASM)
    x02, x46, x13, x57 = _x_lanes(x_ptr, word, word_ok, x_mul, X_BF16, ASM)
    sums = _fma_f16_halves(w02, x02[None, :], sums, ASM)
    sums = _fma_f16_halves(w46, x46[None, :], sums, ASM)
    sums = _fma_f16_halves(w13, x13[None, :], sums, ASM)
    return _fma_f16_halves(w57, x57[None, :], sums, ASM)


@jit
def _nvfp4_row_step(acc, words, x_ptr, s_ptr, wide_rows, row_ok, k0, K, stride_s, x_mul, X_BF16: tl.constexpr,
                    EVEN_K: tl.constexpr, ASM: tl.constexpr, BLOCK_K: tl.constexpr):
    """Decode's nvfp4 step on the tile's words (:func:`_nvfp4_words`): acc[BLOCK_N, BLOCK_K / 16] += each 16-value
    group's scale times the sum of its products.

    The products are fp16, two per instruction: the codes decode to value / 2^14 (:func:`_e2m1_pairs_over_2_14`)
    and x is scaled by ``x_mul`` = 2^(14 - p) into fp16, where |x| < 2^(p + 1) over the program's K slice, so every
    x fits (|x * x_mul| < 2^15), each product is the value * x / 2^p, and each group's two sums of eight stay below
    2^7. The caller multiplies by 2^p at the end. A group's sums round to fp16 (11 bits), finer than the bf16
    activations themselves and than the reference's bf16 rounding of the dequantised weights."""
    group = tl.multiple_of(k0 // 16, BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
    s_mask = row_ok[:, None] & ((group < K // 16) | EVEN_K)[None, :]
    scale = _fp8_as_f32(tl.load(s_ptr + wide_rows[:, None] * stride_s + group[None, :], mask=s_mask, other=0))
    first, second = tl.split(tl.reshape(words, (words.shape[0], BLOCK_K // 16, 2)))   # a group's two words
    sums = tl.zeros(first.shape, dtype=tl.uint32)
    word_ok = (2 * group + 1 < K // 8) | EVEN_K
    sums = _nvfp4_word_products(sums, first, x_ptr, 2 * group, word_ok, x_mul, X_BF16, ASM)
    sums = _nvfp4_word_products(sums, second, x_ptr, 2 * group + 1, word_ok, x_mul, X_BF16, ASM)
    low, high = _f16_halves_to_f32(sums, ASM)
    return acc + (low + high) * scale


@jit
def _fp8_row_step(acc, x_ptr, q_ptr, s_ptr, wide_rows, row_ok, k0, K, stride_q, stride_s, GROUP: tl.constexpr,
                  PER_CHANNEL: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Decode's fp8 step: acc[BLOCK_N, BLOCK_K / 16] += the sums of each run of 16 products (one thread's 16-byte
    load, summed in registers), times the run's block scale (GROUP is a multiple of 16; per-channel scales apply
    after the loop)."""
    k = tl.multiple_of(k0, BLOCK_K) + tl.arange(0, BLOCK_K)
    k_ok = (k < K) | EVEN_K
    w = _fp8_as_f32(tl.load(q_ptr + wide_rows[:, None] * stride_q + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                            other=0))
    products = w * tl.load(x_ptr + k, mask=k_ok, other=0).to(tl.float32)[None, :]
    runs = tl.sum(tl.reshape(products, (products.shape[0], BLOCK_K // 16, 16)), axis=2)
    if not PER_CHANNEL:
        run = tl.multiple_of(k0 // 16, BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
        s_mask = row_ok[:, None] & ((run < K // 16) | EVEN_K)[None, :]
        runs = runs * tl.load(s_ptr + wide_rows[:, None] * stride_s + (run * 16 // GROUP)[None, :], mask=s_mask,
                              other=0)
    return acc + runs


@jit
def _quant_gemv_kernel(x_ptr, q_ptr, s_ptr, r_ptr, out_ptr, partial_ptr, arrivals_ptr, L, N, K, stride_x, stride_q,
                       stride_s, k_split, SPLIT: tl.constexpr, X_BF16: tl.constexpr, EVEN_K: tl.constexpr,
                       NVFP4: tl.constexpr, GROUP: tl.constexpr, PER_CHANNEL: tl.constexpr, GROUPED: tl.constexpr,
                       IEEE: tl.constexpr, ASM: tl.constexpr, ONE_ROW: tl.constexpr, BLOCK_L: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One [BLOCK_L, BLOCK_N] output tile over one K slice: out[l, n], or with SPLIT its slice's partial, summed
    by :func:`_sum_slices_when_last`. Program axes: row block of W, split-K index, block of x's rows (each block
    re-reads its weights).

    BLOCK_K values per step. fp8 bytes (weights, and nvfp4's
    scales) arrive as uint8. ONE_ROW (decode) with nvfp4: ``q_ptr`` is the weights as int32 words,
    :func:`_nvfp4_row_step`. ONE_ROW with fp8: x loads contiguously once per tile; GROUPED (the tile holds whole
    scale groups: fp8 when its group divides BLOCK_K), each group's x * value products are summed and scaled once
    into a [BLOCK_N, BLOCK_K / GROUP] accumulator, otherwise accumulated elementwise into [BLOCK_N, BLOCK_K]; either
    is summed once after the loop. Several rows: x's rows are padded to BLOCK_L >= 16, the tile is dequantised
    (nvfp4's nibbles interleaved back into k order) and goes through tl.dot."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tokens = tl.program_id(2) * BLOCK_L + tl.arange(0, BLOCK_L)
    row_ok = rows < N
    token_ok = tokens < L
    wide_rows = rows.to(tl.int64)
    if ONE_ROW:
        acc = tl.zeros((BLOCK_N, BLOCK_K // 16), dtype=tl.float32)   # one sum per RUN
    else:
        acc = tl.zeros((BLOCK_L, BLOCK_N), dtype=tl.float32)
    k_begin = tl.program_id(1) * k_split
    k_end = tl.minimum(k_begin + k_split, K)
    if EVEN_K:
        k_end = tl.multiple_of(k_end, BLOCK_K)
    if ONE_ROW and NVFP4:   # the first tile's words are in flight while x's range is found
        words = _nvfp4_words(q_ptr, wide_rows, row_ok, k_begin, k_end, stride_q, BLOCK_K)
        x_exponent = _x_magnitude_exponent(x_ptr, k_begin, k_end, X_BF16, BLOCK_K)
        x_mul = ((268 - x_exponent) << 23).to(tl.float32, bitcast=True)         # 2^(14 - p), p = x_exponent - 127
    for k0 in range(k_begin, k_end, BLOCK_K):
        if ONE_ROW and NVFP4:   # the next tile's words are in flight while this one is decoded
            ahead = _nvfp4_words(q_ptr, wide_rows, row_ok, k0 + BLOCK_K, k_end, stride_q, BLOCK_K)
            acc = _nvfp4_row_step(acc, words, x_ptr, s_ptr, wide_rows, row_ok, k0, K, stride_s, x_mul, X_BF16, EVEN_K,
                                  ASM, BLOCK_K)
            words = ahead
        elif ONE_ROW:
            acc = _fp8_row_step(acc, x_ptr, q_ptr, s_ptr, wide_rows, row_ok, k0, K, stride_q, stride_s, GROUP,
                                PER_CHANNEL, EVEN_K, BLOCK_K)
        else:
            k = k0 + tl.arange(0, BLOCK_K)
            if GROUPED:
                group = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
                s_mask = row_ok[:, None] & (group < K // GROUP)[None, :]
                scale = tl.load(s_ptr + wide_rows[:, None] * stride_s + group[None, :], mask=s_mask, other=0)
                if NVFP4:
                    scale = _fp8_as_f32(scale) * 16384.0
            if NVFP4:
                byte_index = k0 // 2 + tl.arange(0, BLOCK_K // 2)     # byte j holds k = 2j (low) and 2j + 1 (high)
                w_mask = row_ok[:, None] & (byte_index < K // 2)[None, :]
                packed = tl.load(q_ptr + wide_rows[:, None] * stride_q + byte_index[None, :], mask=w_mask, other=0)
                packed = packed.to(tl.int32)
                w = tl.reshape(tl.join(_e2m1_over_2_14(packed & 15), _e2m1_over_2_14(packed >> 4)),
                               (BLOCK_N, BLOCK_K))
            else:
                w_mask = row_ok[:, None] & (k < K)[None, :]
                w = _fp8_as_f32(tl.load(q_ptr + wide_rows[:, None] * stride_q + k[None, :], mask=w_mask, other=0))
                if not PER_CHANNEL and not GROUPED:                   # per-channel scales apply after the loop
                    w = w * tl.load(s_ptr + wide_rows[:, None] * stride_s + (k // GROUP)[None, :],
                                    mask=w_mask, other=0)
            if GROUPED:
                w = w * _widen(scale, BLOCK_N, BLOCK_K, GROUP)
            xk = tl.load(x_ptr + tokens[:, None] * stride_x + k[None, :],
                         mask=token_ok[:, None] & (k < K)[None, :], other=0)
            acc = _dot(acc, xk, w, IEEE)
    if ONE_ROW:
        result = tl.sum(acc, axis=1)[None, :]
    else:
        result = acc
    if ONE_ROW and NVFP4:                                                        # times 2^p
        x_unmul = (x_exponent << 23).to(tl.float32, bitcast=True)
        result = result * (tl.load(r_ptr + rows, mask=row_ok, other=0) * x_unmul)[None, :]
    elif NVFP4:
        result = result * tl.load(r_ptr + rows, mask=row_ok, other=0)[None, :]
    elif PER_CHANNEL:
        result = result * tl.load(s_ptr + rows, mask=row_ok, other=0)[None, :]
    at = tokens[:, None] * N + rows[None, :]
    mask = token_ok[:, None] & row_ok[None, :]
    if SPLIT:
        _sum_slices_when_last(result, out_ptr, out_ptr, partial_ptr, arrivals_ptr, at, mask, L * N, False, ASM)
    else:
        store_tile(result, out_ptr, out_ptr, at, mask, False)


@jit
def _fence(tile, ASM: tl.constexpr):
    """``fence.acq_rel.gpu`` in every thread (the interpreter runs programs one after another and needs none)."""
    if ASM:
        tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.b32 $0, $1;", "=r,r", [tile], dtype=tl.int32,
                                  is_pure=False, pack=1)


@jit
def store_tile(value, out_ptr, res_ptr, at, mask, RESIDUAL: tl.constexpr):
    """fp32 ``value`` rounded to the output's dtype (to nearest even, in the interpreter too) and stored at
    ``out[at]``; with RESIDUAL first ``res[at] +`` it, rounded again: the reference's ``residual + F.linear(...)``."""
    value = round_like(value, out_ptr)
    if RESIDUAL:
        value = round_like(tl.load(res_ptr + at, mask=mask, other=0).to(tl.float32) + value, out_ptr)
    tl.store(out_ptr + at, value.to(out_ptr.dtype.element_ty), mask=mask)


@jit
def _sum_slices_when_last(result, out_ptr, res_ptr, partial_ptr, arrivals_ptr, at, mask, SLICE,
                          RESIDUAL: tl.constexpr, ASM: tl.constexpr):
    """Split K: each program stores its slice's fp32 partial; the last of an output tile's slices to arrive (a
    counter per tile) sums all of them in slice order, so the result does not depend on which one that is, writes
    it in the output's dtype (:func:`store_tile`, with the residual add when RESIDUAL) and resets the counter for
    the next launch. One kernel, where summing the partials with torch would take two more (a reduction and a
    cast) per call.

    Ordering: every thread fences its stores before the CTA barrier, one thread counts the arrival with an
    acquire-release atomic, and the last program fences again before it reads the partials from L2 (``.cg``:
    its L1 may hold lines of an earlier launch)."""
    tile = tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
    tl.store(partial_ptr + tl.program_id(1) * SLICE + at, result, mask=mask)
    _fence(at, ASM)
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(1) - 1:
        _fence(at, ASM)
        total = tl.zeros(result.shape, dtype=tl.float32)
        for s in range(tl.num_programs(1)):
            total += tl.load(partial_ptr + s * SLICE + at, mask=mask, other=0, cache_modifier=".cg")
        store_tile(total, out_ptr, res_ptr, at, mask, RESIDUAL)
        tl.atomic_xchg(arrivals_ptr + tile, 0, sem="relaxed", scope="gpu")


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


ARRIVAL_COUNTERS = 1 << 16         # output tiles a split-K launch may have (the LM head's finest tiling: 15,520)


@functools.cache
def _arrival_tensor(device: torch.device) -> torch.Tensor:
    """The split-K arrival counters of this device, all zero between launches (the last program resets its own).
    Launches on one stream never overlap, so they can share them; made on first use, which is a warm-up run and
    never a CUDA-graph capture (GraphRunner runs every step once before recording it)."""
    return torch.zeros(ARRIVAL_COUNTERS, dtype=torch.int32, device=device)


def _arrival_counters(device: torch.device, tiles: int) -> torch.Tensor:
    if tiles > ARRIVAL_COUNTERS:
        raise ValueError(f"a split-K launch of {tiles} output tiles exceeds the {ARRIVAL_COUNTERS} counters")
    return _arrival_tensor(device)


def _splits(device: torch.device, programs: int, k_blocks: int, splits: int) -> int:
    """``splits`` (0: split K until there are ~4 programs per SM), never more than one per K block."""
    wanted = splits or -(-4 * _sm_count(device) // programs)
    return max(1, min(k_blocks, wanted))


def _launch(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, row_scale: torch.Tensor | None,
            n: int, k: int, group: int, config: GemvConfig | None) -> torch.Tensor:
    if triton is None:
        raise RuntimeError("Triton is not available")
    rows = x.shape[0]
    if not 0 < rows <= GEMV_MAX_ROWS:
        raise ValueError(f"the fused GEMV takes 1..{GEMV_MAX_ROWS} rows, got {rows}")
    x, dtype = x.contiguous(), x.dtype
    nvfp4 = row_scale is not None
    kind = weight_kind(nvfp4, group, k)
    config = config or gemv_config(kind, n, k, rows, x.device)
    block_l, block_k = rows_bucket(rows), config.block_k
    if block_k % RUN:
        raise ValueError(f"tiles hold whole {RUN}-value runs, got block_k {block_k}")
    if group % RUN:
        raise ValueError(f"scale groups span a multiple of {RUN} values, got {group}")
    n_blocks, k_blocks, l_blocks = triton.cdiv(n, config.block_n), triton.cdiv(k, block_k), triton.cdiv(rows, block_l)
    splits = _splits(x.device, n_blocks * l_blocks, k_blocks, config.splits)
    k_split = triton.cdiv(k_blocks, splits) * block_k
    splits = triton.cdiv(k, k_split)
    out = torch.empty((rows, n), device=x.device, dtype=dtype)
    partial = torch.empty((splits, rows, n), device=x.device, dtype=torch.float32) if splits > 1 else out
    arrivals = _arrival_counters(x.device, n_blocks * l_blocks)
    x_bf16 = dtype == torch.bfloat16
    if nvfp4:   # decode reads the packed codes as 32-bit words (K is a multiple of 16), fp8 scales as bytes
        q, scale = (q.view(torch.int32) if rows == 1 else q), scale.view(torch.uint8)
        if rows == 1 and x_bf16:
            x = x.view(torch.int32)                                   # bf16 pairs (see _x_lanes)
    else:
        q = q.view(torch.uint8)
    _quant_gemv_kernel[(n_blocks, splits, l_blocks)](
        x, q, scale, row_scale if nvfp4 else scale, out, partial, arrivals, rows, n, k, x.stride(0), q.stride(0),
        scale.stride(0), k_split, SPLIT=splits > 1, X_BF16=x_bf16, EVEN_K=k % block_k == 0, NVFP4=nvfp4,
        GROUP=group, PER_CHANNEL=kind == "fp8", GROUPED=kind != "fp8" and block_k % group == 0,
        IEEE=dtype == torch.float32 or INTERPRETED, ASM=not INTERPRETED, ONE_ROW=rows == 1, BLOCK_L=block_l,
        BLOCK_N=config.block_n, BLOCK_K=block_k, num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def fp8_linear_triton(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                      config: GemvConfig | None = None) -> torch.Tensor:
    n, k = q.shape
    return _launch(x, q, scale, None, n, k, k // scale.shape[1], config)


def nvfp4_linear_triton(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, row_scale: torch.Tensor,
                        config: GemvConfig | None = None) -> torch.Tensor:
    n, k = q.shape[0], 2 * q.shape[1]
    return _launch(x, q, scale, row_scale, n, k, NVFP4_GROUP, config)


@jit
def _dequant_kernel(q_ptr, s_ptr, r_ptr, out_ptr, N, K, NVFP4: tl.constexpr, GROUP: tl.constexpr,
                    BLOCK_N: tl.constexpr, TILE_K: tl.constexpr):
    """out [N, K] (the dtype of out) = dequant(W) for one [BLOCK_N, TILE_K] tile of stored columns."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * TILE_K + tl.arange(0, TILE_K)        # bytes of nvfp4, values of fp8
    wide_rows = rows.to(tl.int64)
    if NVFP4:
        mask = (rows < N)[:, None] & (cols < K // 2)[None, :]
        packed = tl.load(q_ptr + wide_rows[:, None] * (K // 2) + cols[None, :], mask=mask, other=0).to(tl.int32)
        scale = _fp8_as_f32(tl.load(s_ptr + wide_rows[:, None] * (K // 16) + (cols // 8)[None, :], mask=mask,
                                    other=0)) * 16384.0
        row_scale = tl.load(r_ptr + rows, mask=rows < N, other=0)[:, None]
        # (e2m1 * block scale) is exact; then the row scale: the reference's order, so fp32 results are bit-equal.
        low = _e2m1_over_2_14(packed & 15) * scale * row_scale
        high = _e2m1_over_2_14(packed >> 4) * scale * row_scale
        values = tl.reshape(tl.join(low, high), (BLOCK_N, 2 * TILE_K))           # back in k order: one store
        k = 2 * tl.program_id(1) * TILE_K + tl.arange(0, 2 * TILE_K)
        tl.store(out_ptr + wide_rows[:, None] * K + k[None, :], values.to(out_ptr.dtype.element_ty),
                 mask=(rows < N)[:, None] & (k < K)[None, :])
    else:
        mask = (rows < N)[:, None] & (cols < K)[None, :]
        w = _fp8_as_f32(tl.load(q_ptr + wide_rows[:, None] * K + cols[None, :], mask=mask, other=0))
        w = w * tl.load(s_ptr + wide_rows[:, None] * (K // GROUP) + (cols // GROUP)[None, :], mask=mask, other=0)
        tl.store(out_ptr + wide_rows[:, None] * K + cols[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_triton(q: torch.Tensor, scale: torch.Tensor, row_scale: torch.Tensor | None,
                      dtype: torch.dtype) -> torch.Tensor:
    """The [N, K] weights in ``dtype``, in one pass over the stored bytes (the prefill path for long pieces)."""
    nvfp4 = row_scale is not None
    n, k = q.shape[0], q.shape[1] * (2 if nvfp4 else 1)
    out = torch.empty((n, k), device=q.device, dtype=dtype)
    tile_k = _DEQUANT_BLOCK_K // 2 if nvfp4 else _DEQUANT_BLOCK_K
    codes, scale_bytes = q.view(torch.uint8), (scale.view(torch.uint8) if nvfp4 else scale)   # fp8 as bytes
    _dequant_kernel[(triton.cdiv(n, _DEQUANT_BLOCK_N), triton.cdiv(q.shape[1], tile_k))](
        codes, scale_bytes, row_scale if nvfp4 else scale, out, n, k, NVFP4=nvfp4,
        GROUP=NVFP4_GROUP if nvfp4 else k // scale.shape[1], BLOCK_N=_DEQUANT_BLOCK_N, TILE_K=tile_k, num_warps=4)
    return out
