"""The fused Triton kernels of norms, activations, conv and RoPE against their pure-PyTorch references.

Without CUDA they run through Triton's interpreter on CPU tensors (test/conftest.py sets TRITON_INTERPRET=1), on small
row counts; the ``gpu`` tests repeat them at realistic sizes on CUDA and capture them in a CUDA graph. Inputs are random per case (seeded by the case's name), shaped like the presets' layers and laid out as
the model lays them (column slices of fused projections, a layer slice of the arena KV). Outputs the wrappers allocate
are poisoned with NaN, so an element a kernel fails to write fails the comparison.
"""
from __future__ import annotations

import dataclasses
import os
import types
import zlib

import pytest
import torch

from flashrt_ros.runtime.config import PRESETS
from flashrt_ros.runtime.kernels import _triton
from flashrt_ros.runtime.kernels._layout import LayoutError
from flashrt_ros.runtime.kernels.activations import silu_mul, silu_mul_triton
from flashrt_ros.runtime.kernels.conv import causal_conv, causal_conv_rows, causal_conv_rows_triton, causal_conv_triton
from flashrt_ros.runtime.kernels.norms import (add_rms_norm, add_rms_norm_triton, gated_rms_norm,
                                                gated_rms_norm_triton, rms_norm, rms_norm_triton)
from flashrt_ros.runtime.kernels.rope import qk_norm_rope_kv_write, qk_norm_rope_kv_write_triton
from kernel_checks import assert_same_bytes

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.skipif(_triton.triton is None or not (CUDA or os.environ.get("TRITON_INTERPRET") == "1"),
                                reason="needs Triton on CUDA or Triton's interpreter (TRITON_INTERPRET=1)")

# (||out - ref|| / ||ref||, max |out - ref| / max |ref|) bounds per dtype: the kernels round where the references do,
# so they differ only where an fp32 statistic or exp/rsqrt rounds differently and a cast then lands one step apart.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 2 ** -6), torch.float16: (2e-3, 2 ** -9)}
DTYPES = [torch.float32, torch.bfloat16]
# The presets' layer layouts, in both dtypes (the largest in bf16 only, to keep the interpreter run short).
PRESET_CASES = [("tiny", torch.float32), ("tiny", torch.bfloat16), ("qwen3.5-0.8b", torch.float32),
                ("qwen3.5-0.8b", torch.bfloat16), ("qwen3.6-27b", torch.bfloat16)]
EPS = 1e-6


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(||out - ref|| / ||ref||, max |out - ref| / max |ref|)."""
    diff, ref = out.double() - ref.double(), ref.double()
    return float(diff.norm() / ref.norm().clamp_min(1e-30)), float(diff.abs().max() / ref.abs().max().clamp_min(1e-30))


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """out matches ref in shape and dtype, is finite (nothing left unwritten) and is within the dtype's tolerance."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all(), "non-finite output: an element was not written"
    rel_tol, max_tol = TOLERANCE[out.dtype]
    rel, max_err = errors(out, ref)
    assert rel <= rel_tol and max_err <= max_tol, f"errors {rel:.3g} (norm), {max_err:.3g} (max) over {rel_tol}, {max_tol}"


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    """Every floating tensor allocated with torch.empty / empty_like during a test starts as NaN."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))


def test_outputs_are_poisoned():
    assert torch.isnan(torch.empty(3, 4, dtype=torch.bfloat16)).all()
    assert torch.isnan(torch.empty_like(torch.zeros(5))).all()


@dataclasses.dataclass
class Draw:
    """Seeded random inputs for one case, on the test device."""
    seed: int
    device: str = DEVICE

    def __post_init__(self):
        self.g = torch.Generator().manual_seed(self.seed)

    def int(self, low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=self.g))

    def randn(self, *shape, dtype=torch.float32, std: float = 1.0) -> torch.Tensor:
        return (std * torch.randn(*shape, generator=self.g)).to(device=self.device, dtype=dtype)

    def scale(self, dim: int) -> torch.Tensor:
        return 1.0 + self.randn(dim, std=0.2)

    def columns(self, rows: int, cols: int, dtype) -> torch.Tensor:
        """A [rows, cols] column slice of a wider tensor (unit column stride, row stride > cols), as a fused
        projection's output is sliced."""
        extra = self.int(1, 24)
        start = self.int(0, extra)
        return self.randn(rows, cols + extra, dtype=dtype)[:, start:start + cols]

    def count(self, length: int, kind: str) -> torch.Tensor | None:
        """None, a 0-d count of all rows, or one of fewer rows (a padded bucket)."""
        if kind == "none":
            return None
        value = length if kind == "all" else self.int(1, max(1, length - 1))
        return torch.tensor(value, dtype=torch.int64, device=self.device)


@pytest.fixture
def draw(request) -> Draw:
    return Draw(zlib.crc32(request.node.name.encode()))


def real_rows(length: int, count: torch.Tensor | None) -> int:
    return length if count is None else int(count)


# ---- the checks, shared by the interpreter tests (small L) and the GPU tests (realistic L) ------------------------

def check_rms_norm(draw: Draw, length: int, dim: int, dtype) -> None:
    x, scale = draw.columns(length, dim, dtype), draw.scale(dim)
    assert_close(rms_norm_triton(x, scale, EPS), rms_norm(x, scale, EPS))


def check_add_rms_norm(draw: Draw, length: int, dim: int, dtype) -> None:
    x, residual, scale = draw.columns(length, dim, dtype), draw.columns(length, dim, dtype), draw.scale(dim)
    normed, summed = add_rms_norm_triton(x, residual, scale, EPS)
    ref_normed, ref_summed = add_rms_norm(x, residual, scale, EPS)
    assert torch.equal(summed, ref_summed), "the residual sum rounds exactly as PyTorch's residual + x"
    assert_close(normed, ref_normed)


def check_gated_rms_norm(draw: Draw, length: int, heads: int, dim: int, dtype) -> None:
    x = draw.randn(length, heads, dim, dtype=dtype)
    gate = draw.columns(length, heads * dim, dtype).view(length, heads, dim)     # row stride != H * D
    weight = draw.scale(dim).to(dtype)
    assert_close(gated_rms_norm_triton(x, gate, weight, EPS), gated_rms_norm(x, gate, weight, EPS))


def check_silu_mul(draw: Draw, length: int, inter: int, dtype) -> None:
    gate_up = draw.columns(length, 2 * inter, dtype)
    assert_close(silu_mul_triton(gate_up), silu_mul(gate_up))


def conv_inputs(draw: Draw, length: int, channels: int, dtype, kernel: int = 4):
    x = draw.columns(length, channels, dtype)
    state = draw.randn(kernel - 1, channels, dtype=dtype)
    weight = draw.randn(channels, kernel, dtype=dtype, std=0.5)
    return x, state, weight


def check_causal_conv(draw: Draw, length: int, channels: int, dtype, count_kind: str, kernel: int = 4) -> None:
    x, state, weight = conv_inputs(draw, length, channels, dtype, kernel)
    count = draw.count(length, count_kind)
    ref_state, fused_state = state.clone(), state.clone()
    ref = causal_conv(x, ref_state, weight, count)
    out = causal_conv_triton(x, fused_state, weight, count)
    n = real_rows(length, count)
    assert out.shape == ref.shape and out.is_contiguous()
    assert_close(out[:n], ref[:n])
    assert torch.equal(fused_state, ref_state), "the new state is a copy of inputs: exact"
    assert torch.equal(ref_state, torch.cat([state, x[:n]])[-(state.shape[0]):])


def check_causal_conv_rows(draw: Draw, live: int, channels: int, dtype, kernel: int = 4) -> None:
    """The rows conv (a speculative verify) against ``live`` one-row steps, byte for byte, for the Triton kernel
    (against one-row launches of the decode kernel) and the reference (against one-row reference steps): every
    row's output and the state after it, the state only read, the row states strided in a larger buffer (as in
    ``RowStates``) whose other bytes survive."""
    x, state, weight = conv_inputs(draw, live, channels, dtype, kernel)
    before = state.clone()
    for conv, rows_conv in ((causal_conv_triton, causal_conv_rows_triton), (causal_conv, causal_conv_rows)):
        buffer = draw.randn(live, state.numel() + 30, dtype=dtype)
        original = buffer.clone()
        rows = buffer[:, 10:10 + state.numel()].unflatten(1, state.shape)
        out = rows_conv(x, state, weight, rows)
        assert torch.equal(state, before), "the state is only read"
        assert torch.equal(buffer[:, :10], original[:, :10]) and torch.equal(buffer[:, 10 + state.numel():],
                                                                             original[:, 10 + state.numel():])
        stepped = state.clone()
        for row in range(live):
            assert_same_bytes(f"{rows_conv.__name__} row {row} of {live}: output", out[row:row + 1],
                              conv(x[row:row + 1], stepped, weight))
            assert_same_bytes(f"{rows_conv.__name__} row {row} of {live}: state after it", rows[row], stepped)


def attention_inputs(draw: Draw, length: int, cfg, dtype, context: int, layers: int = 2):
    """q, k, v as views of one fused projection output, and an arena-like KV [T, layers, 2, Hkv, D]."""
    heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    fused = draw.columns(length, heads * 2 * dim + 2 * kv_heads * dim, dtype)
    q = fused[:, :heads * 2 * dim].view(length, heads, 2 * dim)[..., :dim]
    k = fused[:, heads * 2 * dim:heads * 2 * dim + kv_heads * dim].view(length, kv_heads, dim)
    v = fused[:, heads * 2 * dim + kv_heads * dim:].view(length, kv_heads, dim)
    cos, sin = draw.randn(length, cfg.rotary_dim, dtype=dtype), draw.randn(length, cfg.rotary_dim, dtype=dtype)
    arena = draw.randn(context, layers, 2, kv_heads, dim, dtype=dtype)
    positions = torch.randperm(context, generator=draw.g)[:length].to(draw.device)
    return q, k, v, draw.scale(dim), draw.scale(dim), cos, sin, arena, positions


def check_qk_norm_rope_kv_write(draw: Draw, length: int, cfg, dtype, count_kind: str, context: int) -> None:
    q, k, v, q_scale, k_scale, cos, sin, arena, positions = attention_inputs(draw, length, cfg, dtype, context)
    count = draw.count(length, count_kind)
    layer = draw.int(0, arena.shape[1] - 1)
    ref_arena, fused_arena = arena.clone(), arena.clone()
    ref = qk_norm_rope_kv_write(q, k, v, q_scale, k_scale, EPS, cos, sin, ref_arena[:, layer], positions, count)
    out = qk_norm_rope_kv_write_triton(q, k, v, q_scale, k_scale, EPS, cos, sin, fused_arena[:, layer], positions,
                                       count)
    assert out.is_contiguous()
    assert_close(out, ref)
    written = positions[:real_rows(length, count)]
    untouched = torch.ones(arena.shape[0], dtype=torch.bool, device=arena.device)
    untouched[written] = False
    assert torch.equal(fused_arena[untouched], arena[untouched]), "rows not written (padding, others) unchanged"
    assert torch.equal(fused_arena[:, 1 - layer], arena[:, 1 - layer]), "other layers unchanged"
    assert torch.equal(fused_arena[written, layer, 1], ref_arena[written, layer, 1]), "values are copies: exact"
    assert_close(fused_arena[written, layer, 0], ref_arena[written, layer, 0])


# ---- interpreter-sized cases ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset,dtype", PRESET_CASES)
def test_rms_norm_and_add_rms_norm(draw, preset, dtype):
    dim = PRESETS[preset].hidden_size
    check_rms_norm(draw, draw.int(1, 8), dim, dtype)
    check_add_rms_norm(draw, draw.int(1, 8), dim, dtype)


@pytest.mark.parametrize("preset,dtype", PRESET_CASES)
def test_gated_rms_norm(draw, preset, dtype):
    cfg = PRESETS[preset]
    check_gated_rms_norm(draw, draw.int(1, 4), cfg.linear_num_value_heads, cfg.linear_value_head_dim, dtype)


@pytest.mark.parametrize("preset,dtype", PRESET_CASES)
def test_silu_mul(draw, preset, dtype):
    check_silu_mul(draw, draw.int(1, 4), PRESETS[preset].intermediate_size, dtype)


@pytest.mark.parametrize("count_kind", ["none", "all", "fewer"])
@pytest.mark.parametrize("preset,dtype", PRESET_CASES)
def test_causal_conv_decode_and_small_pieces(draw, preset, dtype, count_kind):
    """Decode (one row, no count) and bucketed small pieces (count of all rows, of fewer rows): one launch each."""
    length = 1 if count_kind == "none" else draw.int(2, 8)
    check_causal_conv(draw, length, PRESETS[preset].conv_dim, dtype, count_kind)


@pytest.mark.parametrize("live", [1, 2, 5])
@pytest.mark.parametrize("preset,dtype", PRESET_CASES[:4])
def test_causal_conv_rows_equal_one_row_steps(draw, preset, dtype, live):
    check_causal_conv_rows(draw, live, PRESETS[preset].conv_dim, dtype)


def test_causal_conv_rows_refuses_rows_not_laid_out_as_the_state(draw):
    x, state, weight = conv_inputs(draw, 3, 40, torch.float32)
    for rows in (torch.zeros(2, *state.shape), torch.zeros(3, *state.shape, dtype=torch.float64),
                 torch.zeros(3, state.shape[1], state.shape[0]).transpose(1, 2)):
        with pytest.raises(LayoutError, match="rows must be"):
            causal_conv_rows_triton(x, state, weight, rows.to(DEVICE))
    with pytest.raises(LayoutError, match="at most"):
        causal_conv_rows_triton(*conv_inputs(draw, 40, 8, torch.float32), torch.zeros(40, 3, 8, device=DEVICE))


@pytest.mark.parametrize("count", [1, 2, 3, 37, 70])
def test_causal_conv_long_piece_state_from_old_state_and_inputs(draw, count):
    """A piece longer than one program's rows (two launches), with counts below, at and past K-1."""
    x, state, weight = conv_inputs(draw, 70, 200, torch.float32)
    ref_state, fused_state = state.clone(), state.clone()
    count = torch.tensor(count, device=DEVICE)
    ref = causal_conv(x, ref_state, weight, count)
    out = causal_conv_triton(x, fused_state, weight, count)
    assert_close(out[:int(count)], ref[:int(count)])
    assert torch.equal(fused_state, ref_state)


@pytest.mark.parametrize("count_kind", ["none", "all", "fewer"])
@pytest.mark.parametrize("preset,dtype", PRESET_CASES)
def test_qk_norm_rope_kv_write(draw, preset, dtype, count_kind):
    check_qk_norm_rope_kv_write(draw, draw.int(1, 4), PRESETS[preset], dtype, count_kind, context=16)


@pytest.mark.parametrize("seed", range(12))
def test_random_shapes(seed):
    """Odd sizes (features not a power of two, channels not a multiple of the block, rotary dim = head dim) and all
    three model dtypes."""
    draw = Draw(1000 + seed)
    dtype = [torch.float32, torch.bfloat16, torch.float16][seed % 3]
    length = draw.int(1, 9)
    check_add_rms_norm(draw, length, draw.int(1, 300), dtype)
    check_gated_rms_norm(draw, length, draw.int(1, 5), draw.int(1, 40), dtype)
    check_silu_mul(draw, length, draw.int(1, 300), dtype)
    check_causal_conv(draw, length, draw.int(1, 300), dtype, ["none", "all", "fewer"][seed % 3], draw.int(2, 5))
    dim, kv_heads = 2 * draw.int(1, 40), draw.int(1, 3)
    cfg = types.SimpleNamespace(head_dim=dim, rotary_dim=2 * draw.int(1, dim // 2), num_key_value_heads=kv_heads,
                                num_attention_heads=kv_heads * draw.int(1, 3))
    check_qk_norm_rope_kv_write(draw, length, cfg, dtype, ["fewer", "none", "all"][seed % 3], context=12)


# ---- padding with count: byte-identical to the unpadded run --------------------------------------------------------

@pytest.mark.parametrize("conv", [causal_conv, causal_conv_triton])
def test_conv_with_count_equals_unpadded_run(draw, conv):
    length = 8
    x, state, weight = conv_inputs(draw, length, 64, torch.bfloat16)
    for n in (1, 2, 5, 8):
        padded, unpadded = state.clone(), state.clone()
        out_padded = conv(x, padded, weight, torch.tensor(n, device=DEVICE))
        out_unpadded = conv(x[:n], unpadded, weight)
        assert torch.equal(padded, unpadded)
        assert torch.equal(out_padded[:n], out_unpadded)


@pytest.mark.parametrize("conv", [causal_conv, causal_conv_triton])
def test_conv_in_padded_pieces_equals_one_pass(draw, conv):
    x, state, weight = conv_inputs(draw, 23, 48, torch.float32)
    whole_state, pieces_state = state.clone(), state.clone()
    whole = causal_conv(x, whole_state, weight)
    bucket, outs = 8, []
    for start in range(0, 23, 5):          # pieces of 5 rows (3 at the end), each padded to a bucket of 8
        piece = x[start:start + 5]
        padded = torch.cat([piece, draw.randn(bucket - piece.shape[0], x.shape[1])])
        outs.append(conv(padded, pieces_state, weight, torch.tensor(piece.shape[0], device=DEVICE))[:piece.shape[0]])
    assert torch.equal(pieces_state, whole_state)
    torch.testing.assert_close(torch.cat(outs), whole, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("write", [qk_norm_rope_kv_write, qk_norm_rope_kv_write_triton])
def test_kv_write_with_count_equals_unpadded_run(draw, write):
    length = 6
    q, k, v, q_scale, k_scale, cos, sin, arena, positions = attention_inputs(draw, length, PRESETS["tiny"],
                                                                             torch.bfloat16, context=12)
    for n in (1, 3, 6):
        padded, unpadded = arena.clone(), arena.clone()
        out_padded = write(q, k, v, q_scale, k_scale, EPS, cos, sin, padded[:, 0], positions,
                           torch.tensor(n, device=DEVICE))
        out_unpadded = write(q[:n], k[:n], v[:n], q_scale, k_scale, EPS, cos[:n], sin[:n], unpadded[:, 0],
                             positions[:n])
        assert torch.equal(padded, unpadded)
        assert torch.equal(out_padded[:n], out_unpadded)


# ---- layouts a kernel does not support are refused, changing nothing ----------------------------------------------

def test_unsupported_layouts_are_refused_and_change_nothing(draw):
    x = draw.randn(4, 32)
    scale = draw.scale(32)
    bad_rms = [(x.t(), scale), (x.double(), scale), (x, scale.bfloat16()), (x, scale[:16]), (x[None], scale)]
    for args in bad_rms:
        with pytest.raises(LayoutError, match="rms_norm_triton"):
            rms_norm_triton(*args, EPS)
    with pytest.raises(LayoutError, match="residual"):
        add_rms_norm_triton(x, x[:2], scale, EPS)
    heads = x.view(4, 2, 16)
    with pytest.raises(LayoutError, match="weight must be torch.float32"):
        gated_rms_norm_triton(heads, heads, scale[:16].bfloat16(), EPS)
    with pytest.raises(LayoutError, match="gate must have unit stride"):
        gated_rms_norm_triton(heads, draw.randn(4, 2, 32)[..., ::2], scale[:16], EPS)
    with pytest.raises(LayoutError, match="even"):
        silu_mul_triton(x[:, :31])
    cx, state, weight = conv_inputs(draw, 4, 32, torch.float32)
    before = state.clone()
    bad_conv = [dict(x=cx.t()), dict(state=draw.randn(3, 40)[:, :32]), dict(state=state[:2]),
                dict(state=state.bfloat16()), dict(weight=weight[:16]), dict(count=torch.tensor(2.0)),
                dict(count=torch.tensor([2])), dict(count=2)]
    for change in bad_conv:
        args = dict(x=cx, state=state, weight=weight, count=None) | change
        with pytest.raises(LayoutError, match="causal_conv_triton"):
            causal_conv_triton(**args)
    assert torch.equal(state, before)
    q, k, v, q_scale, k_scale, cos, sin, arena, positions = attention_inputs(draw, 3, PRESETS["tiny"],
                                                                             torch.float32, context=8)
    before = arena.clone()
    good = dict(q=q, k=k, v=v, q_scale=q_scale, k_scale=k_scale, eps=EPS, cos=cos, sin=sin, kv_cache=arena[:, 0],
                positions=positions, count=None)
    bad_rope = [dict(q=q.transpose(1, 2)), dict(k=k[:, :1]), dict(v=v.bfloat16()), dict(q_scale=q_scale[:8]),
                dict(cos=cos[:, :3], sin=sin[:, :3]), dict(cos=cos[:2]), dict(kv_cache=arena[:, 0, :1]),
                dict(kv_cache=arena[:, 0].transpose(2, 3)), dict(positions=positions.int()),
                dict(positions=positions[:2]), dict(count=torch.tensor(1, dtype=torch.int32))]
    for change in bad_rope:
        with pytest.raises(LayoutError, match="qk_norm_rope_kv_write_triton"):
            qk_norm_rope_kv_write_triton(**(good | change))
    assert torch.equal(arena, before)


# ---- the GPU: realistic sizes, exact bf16 roundings, graph capture -------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("length", [1, 16, 4096])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("preset", ["qwen3.5-0.8b", "qwen3.6-27b"])
@pytest.mark.parametrize("op", ["rms", "gated", "silu", "conv", "rope"])
def test_gpu_realistic_sizes(draw, op, preset, dtype, length):
    cfg = PRESETS[preset]
    if op == "rms":
        check_rms_norm(draw, length, cfg.hidden_size, dtype)
        check_add_rms_norm(draw, length, cfg.hidden_size, dtype)
    elif op == "gated":
        check_gated_rms_norm(draw, length, cfg.linear_num_value_heads, cfg.linear_value_head_dim, dtype)
    elif op == "silu":
        check_silu_mul(draw, length, cfg.intermediate_size, dtype)
    elif op == "conv":
        for count_kind in ("none", "fewer"):
            check_causal_conv(draw, length, cfg.conv_dim, dtype, count_kind)
        for live in (2, 5):          # a speculative verify's rows, compiled: the decode kernel's bytes row by row
            check_causal_conv_rows(draw, live, cfg.conv_dim, dtype)
    else:
        for count_kind in ("none", "fewer"):
            check_qk_norm_rope_kv_write(draw, length, cfg, dtype, count_kind, context=max(2 * length, 64))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("fused", [False, True])
def test_gpu_graph_replay_equals_eager(fused):
    """Every op (reference and Triton), with a device count, captured in one CUDA graph: replay == eager bytes."""
    draw = Draw(7)
    cfg, length, dtype = PRESETS["qwen3.5-0.8b"], 16, torch.bfloat16
    x = draw.columns(length, cfg.hidden_size, dtype)
    scale = draw.scale(cfg.hidden_size)
    core = draw.randn(length, cfg.linear_num_value_heads, cfg.linear_value_head_dim, dtype=dtype)
    gate = draw.columns(length, cfg.linear_value_dim, dtype).view_as(core)
    weight = draw.scale(cfg.linear_value_head_dim).to(dtype)
    gate_up = draw.columns(length, 2 * cfg.intermediate_size, dtype)
    cx, state, conv_weight = conv_inputs(draw, length, cfg.conv_dim, dtype)
    q, k, v, q_scale, k_scale, cos, sin, arena, positions = attention_inputs(draw, length, cfg, dtype, context=64)
    count = torch.tensor(11, device="cuda")
    pick = (lambda ref, tri: tri) if fused else (lambda ref, tri: ref)
    start_state, start_arena = state.clone(), arena.clone()

    def step():
        return [pick(rms_norm, rms_norm_triton)(x, scale, EPS),
                *pick(add_rms_norm, add_rms_norm_triton)(x, x, scale, EPS),
                pick(gated_rms_norm, gated_rms_norm_triton)(core, gate, weight, EPS),
                pick(silu_mul, silu_mul_triton)(gate_up),
                pick(causal_conv, causal_conv_triton)(cx, state, conv_weight, count),
                pick(qk_norm_rope_kv_write, qk_norm_rope_kv_write_triton)(q, k, v, q_scale, k_scale, EPS, cos, sin,
                                                                           arena[:, 0], positions, count)]

    eager = [t.clone() for t in step()]
    eager_state, eager_arena = state.clone(), arena.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()                                   # warm-up (compiles) outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    state.copy_(start_state)
    arena.copy_(start_arena)
    graph.replay()
    torch.cuda.synchronize()
    names = ["rms_norm", "add_rms_norm (normed)", "add_rms_norm (summed)", "gated_rms_norm", "silu_mul", "causal_conv",
             "qk_norm_rope_kv_write"]
    for name, got, want in zip(names, captured, eager, strict=True):
        assert_same_bytes(f"{name}: graph replay vs eager", got, want)
    assert_same_bytes("conv state: graph replay vs eager", state, eager_state)
    assert_same_bytes("KV arena: graph replay vs eager", arena, eager_arena)
