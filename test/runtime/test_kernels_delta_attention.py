"""The fused Gated DeltaNet core and the attention kernels against their PyTorch references and float64 oracles.

Without CUDA the Triton kernels run through Triton's interpreter (conftest sets TRITON_INTERPRET=1): lengths stay
small there, head layouts are the presets' (tiny, Qwen3.5-0.8B, Qwen3.6-27B). Tests marked gpu run realistic sizes.
Every input is drawn fresh per case from its own seed; ``torch.empty`` hands out NaN so an output or scratch element
a kernel forgets to write (or reads before writing) fails the comparison. Errors are ``|out - want| / |want|``.
"""
import functools
import zlib

import pytest
import torch
import torch.nn.functional as F

from flashrt_ros.runtime.kernels import attention, delta_rule
from kernel_checks import assert_same_bytes, assert_within, rel
from flashrt_ros.runtime.kernels._layout import LayoutError
from flashrt_ros.runtime.kernels._triton import triton

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
needs_triton = pytest.mark.skipif(triton is None, reason="triton is not importable")


def on_gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")(test))


# Relative errors against float64 (measured on the CPU interpreter at the shapes below, worst case: Triton fp32 2.4e-7,
# bf16 3.0e-3, i.e. the output's bf16 rounding; references fp32 2.0e-6 (the chunked solve), bf16 3.9e-3 (attention
# scores in bf16); recurrent state, fp32 in every dtype: Triton 1.1e-7, chunked reference 9.0e-7).
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 6e-3}
REFERENCE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 6e-3}
STATE_TOLERANCE, REFERENCE_STATE_TOLERANCE = 1e-6, 5e-6
GDN_LAYOUTS = {"tiny": (2, 4, 16, 16), "0.8b": (16, 16, 128, 128), "27b": (16, 48, 128, 128)}  # Hk, Hv, dk, dv
ATTENTION_LAYOUTS = {"tiny": (4, 2, 16), "0.8b": (8, 2, 256), "27b": (24, 4, 256)}             # H, Hkv, D


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def seed_of(*case) -> int:
    """A seed per test case, stable across processes (unlike hash())."""
    return zlib.crc32(repr(case).encode())


pytestmark = pytest.mark.usefixtures("poisoned_empty")   # every test: unwritten outputs show up as NaN


# ---- gated delta rule -------------------------------------------------------------------------------------------

class Arena:
    """An fp32 state [Hv, dk, dv] inside a larger buffer whose other bytes must survive every call."""

    def __init__(self, shape, g):
        size = shape[0] * shape[1] * shape[2]
        self.buffer = torch.randn(size + 96, generator=g).to(DEVICE)
        self.state = self.buffer[40:40 + size].view(shape)
        self.original = self.buffer.clone()

    def outside_untouched(self) -> bool:
        inside = torch.zeros_like(self.buffer, dtype=torch.bool)
        inside[40:40 + self.state.numel()] = True
        return torch.equal(self.buffer[~inside], self.original[~inside])


def gdn_inputs(length, layout, dtype, seed):
    """Model-like inputs: q, k, v are column views of one conv output, b and a columns of one fused projection (all
    strided), A_log/dt_bias parameters in the model dtype, a nonzero state in an arena. One gate saturates
    softplus (a + dt_bias > 20) to cover that branch."""
    k_heads, v_heads, dk, dv = layout
    g = gen(seed)
    key_dim = k_heads * dk
    mixed = torch.randn(length, 2 * key_dim + v_heads * dv + 8, generator=g).to(dtype).to(DEVICE)
    q = mixed[:, :key_dim].unflatten(1, (k_heads, dk))
    k = mixed[:, key_dim:2 * key_dim].unflatten(1, (k_heads, dk))
    v = mixed[:, 2 * key_dim:2 * key_dim + v_heads * dv].unflatten(1, (v_heads, dv))
    proj = torch.randn(length, 2 * v_heads + 5, generator=g) * 3.0
    proj[0, v_heads] = 25.0
    proj = proj.to(dtype).to(DEVICE)
    b, a = proj[:, :v_heads], proj[:, v_heads:2 * v_heads]
    A_log = (2.0 * torch.rand(v_heads, generator=g) - 1.0).to(dtype).to(DEVICE)
    dt_bias = torch.randn(v_heads, generator=g).to(dtype).to(DEVICE)
    arena = Arena((v_heads, dk, dv), g)
    return (q, k, v, a, b, A_log, dt_bias), arena


def gdn_float64(q, k, v, a, b, A_log, dt_bias, state):
    """The gated delta rule token by token in float64 (only beta's sigmoid is taken in b's dtype, as specified)."""
    groups = v.shape[1] // q.shape[1]
    q, k = (x.double().repeat_interleave(groups, dim=1) for x in (q, k))
    q = q / (q * q).sum(-1, keepdim=True).add(1e-6).sqrt() * q.shape[-1] ** -0.5
    k = k / (k * k).sum(-1, keepdim=True).add(1e-6).sqrt()
    beta = b.sigmoid().double()
    decay = (-A_log.double().exp() * F.softplus(a.double() + dt_bias.double())).exp()
    s, v, outs = state.double(), v.double(), []
    for t in range(q.shape[0]):
        s = s * decay[t][:, None, None]
        delta = (v[t] - torch.einsum("hk,hkv->hv", k[t], s)) * beta[t][:, None]
        s = s + k[t][:, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", q[t], s))
    return torch.stack(outs), s


# The presets' layouts at decode length (the interpreter runs each of their 128-192 programs in Python); longer
# pieces at the tiny layout and, in the padding tests, at the 27B head ratio.
GDN_CASES = [(name, length) for name in GDN_LAYOUTS for length in ((1, 9, 64) if name == "tiny" else (1,))]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout,length", GDN_CASES, ids=[f"{n}-L{n_}" for n, n_ in GDN_CASES])
def test_gated_delta_rule_triton_matches_reference_and_float64(layout, length, dtype):
    inputs, arena = gdn_inputs(length, GDN_LAYOUTS[layout], dtype, seed=seed_of(layout, length, dtype))
    want, want_state = gdn_float64(*inputs, arena.state)
    ref_state = arena.state.clone()
    ref = delta_rule.gated_delta_rule_reference(*inputs, ref_state)
    out = delta_rule.gated_delta_rule_triton(*inputs, arena.state)
    assert out.shape == inputs[2].shape and out.dtype == dtype and out.is_contiguous()
    assert arena.outside_untouched()
    errors = {"triton": rel(out, want), "reference": rel(ref, want), "state": rel(arena.state, want_state),
              "ref_state": rel(ref_state, want_state), "vs_ref": rel(out, ref)}
    assert errors["triton"] <= TOLERANCE[dtype] and errors["state"] <= STATE_TOLERANCE, errors
    assert errors["reference"] <= REFERENCE_TOLERANCE[dtype], errors
    assert errors["ref_state"] <= REFERENCE_STATE_TOLERANCE, errors


SWEPT_CONFIGS = [delta_rule.DeltaRuleConfig(*c) for c in ((16, 4, True), (16, 4, False), (8, 1, True), (4, 2, False),
                                                          (4, 1, False, True), (16, 4, True, True),
                                                          (4, 1, True, True))]


@needs_triton
@pytest.mark.parametrize("config", SWEPT_CONFIGS,
                         ids=lambda c: f"v{c.block_v}-w{c.num_warps}-joint{int(c.joint)}-ahead{int(c.ahead)}")
def test_gated_delta_rule_triton_matches_float64_under_any_launch_config(config):
    """A launch configuration (value columns per program, warps, one joint reduction or two in turn, the rows'
    factors ahead of the loop or in it) changes only the summation order: each one matches float64 over a multi-row
    piece (what bench/time_delta_rule.py --sweep times)."""
    inputs, arena = gdn_inputs(9, GDN_LAYOUTS["tiny"], torch.float32, seed=seed_of("config", *config))
    want, want_state = gdn_float64(*inputs, arena.state)
    out = delta_rule.gated_delta_rule_triton(*inputs, arena.state, config=config)
    assert rel(out, want) <= TOLERANCE[torch.float32] and rel(arena.state, want_state) <= STATE_TOLERANCE


@needs_triton
@pytest.mark.parametrize("layout, want", [("0.8b", (16, 4, True)), ("27b", (32, 8, False)), ("tiny", (16, 4, True))])
def test_the_launch_rule_gives_small_blocks_the_joint_reduction_and_large_ones_two(layout, want):
    _, v_heads, dk, dv = GDN_LAYOUTS[layout]
    assert tuple(delta_rule.launch_config(v_heads, dk, dv, interpreted=False)) == (*want, False)
    assert tuple(delta_rule.launch_config(v_heads, dk, dv, piece=True, interpreted=False)) == (4, 1, True, True)
    assert tuple(delta_rule.launch_config(v_heads, dk, dv, piece=True, interpreted=True)) == (want[0], 1, False, False)


@needs_triton
@pytest.mark.skipif(CUDA, reason="the interpreter's bytes: compiled, another block is another summation order")
def test_under_the_interpreter_a_pieces_bytes_do_not_depend_on_its_block():
    """Why the interpreter may launch a piece with the decode block: the narrow GPU block gives the same bytes."""
    inputs, arena = gdn_inputs(9, GDN_LAYOUTS["tiny"], torch.bfloat16, seed=seed_of("interpreted block"))
    state = arena.state.clone()
    narrow = delta_rule.gated_delta_rule_triton(*inputs, state, config=delta_rule.DeltaRuleConfig(4, 1, False))
    wide = delta_rule.gated_delta_rule_triton(*inputs, arena.state, config=delta_rule.DeltaRuleConfig(16, 1, False))
    assert_same_bytes("output, 16 columns against 4", wide, narrow)
    assert_same_bytes("state, 16 columns against 4", arena.state, state)


def poison_rows(inputs, count):
    """The same inputs with every row >= count replaced by NaN (the padding of a bucket may hold anything), each
    laid out as before (same strides, aligned storage): an engine's bucket and its rows are views of one buffer."""
    poisoned = []
    for t in inputs:
        if t.dim() >= 2:
            t = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)
            t[count:] = float("nan")
        poisoned.append(t)
    return poisoned


def check_padded_piece(kernel, bucket: int, n: int, layout, seed: int, tolerance: float, state_tolerance: float):
    """``kernel`` on a bucket whose rows >= n are NaN padding (count n) against it on the n rows alone: zero output
    rows for the padding, the state outside the arena untouched, and for n >= 2 the same bytes (state and outputs);
    for n = 1 (a decode step alone, a piece in the bucket) within the tolerances."""
    inputs, arena = gdn_inputs(bucket, layout, torch.bfloat16, seed=seed)
    alone_state = arena.state.clone()
    alone = kernel(*(t[:n] if t.dim() >= 2 else t for t in inputs), alone_state)
    out = kernel(*poison_rows(inputs, n), arena.state, torch.tensor(n, device=DEVICE))
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))
    assert arena.outside_untouched()
    if n == 1:
        assert rel(arena.state, alone_state) <= state_tolerance
        assert rel(out[:1], alone) <= tolerance
    else:
        assert torch.equal(arena.state, alone_state), f"n={n} of {bucket}"
        assert torch.equal(out[:n], alone), f"n={n} of {bucket}"


@needs_triton
@pytest.mark.parametrize("config", [None, delta_rule.PIECE_AHEAD], ids=["own", "ahead"])
@pytest.mark.parametrize("seed", range(4))
def test_gated_delta_rule_padding_rows_leave_the_state_as_if_absent(seed, config):
    """A piece of n >= 2 real rows padded to a bucket: the Triton kernel gives the bytes of the same kernel on the n
    rows (state and outputs), and zero output rows for the padding. One real row in a bucket is launched as a piece,
    one row alone as a decode step (``launch_config``: other blocks and warps, so another summation order): equal
    within rounding only. Also with the factors ahead (``PIECE_AHEAD``), whose tiles of rows have a fixed shape."""
    g = gen(100 + seed)
    layout = GDN_LAYOUTS["tiny"] if seed % 2 else (1, 3, 32, 32)      # the 27B preset's 3 value heads per key head
    bucket = (8, 16, 5, 64)[seed]
    for n in (1, int(torch.randint(2, bucket + 1, (1,), generator=g))):
        check_padded_piece(functools.partial(delta_rule.gated_delta_rule_triton, config=config), bucket, n, layout,
                           200 + seed + n, TOLERANCE[torch.bfloat16], STATE_TOLERANCE)


@pytest.mark.parametrize("bucket", [8, 16, 64])
def test_reference_padded_piece_folds_byte_identically_to_the_unpadded_piece(bucket):
    """A bucket (<= the 64-row chunk) with n >= 2 real rows computes the bytes of the n rows alone. (n = 1 alone is
    a decode step, the recurrent kernel: equal within rounding only.)"""
    g = gen(bucket)
    for n in sorted({1, 2, int(torch.randint(2, bucket + 1, (1,), generator=g)), bucket}):
        check_padded_piece(delta_rule.gated_delta_rule_reference, bucket, n, GDN_LAYOUTS["tiny"], 300 + bucket + n,
                           REFERENCE_TOLERANCE[torch.bfloat16], REFERENCE_STATE_TOLERANCE)


@needs_triton
def test_gated_delta_rule_triton_refuses_bad_layouts_and_leaves_the_state():
    inputs, arena = gdn_inputs(3, GDN_LAYOUTS["tiny"], torch.float32, seed=7)
    q, k, v, a, b, A_log, dt_bias = inputs
    cases = {
        "state must be torch.float32": (inputs, arena.state.to(torch.float16)),
        "unit stride": ((q.transpose(1, 2).contiguous().transpose(1, 2), *inputs[1:]), arena.state),
        "q .* and k": ((q, k[:, :1], *inputs[2:]), arena.state),
        "state must be": (inputs, arena.state[:, :, :8]),
    }
    for message, (args, state) in cases.items():
        with pytest.raises(LayoutError, match=message):
            delta_rule.gated_delta_rule_triton(*args, state)
    with pytest.raises(LayoutError, match="count"):
        delta_rule.gated_delta_rule_triton(*inputs, arena.state, torch.tensor(2, dtype=torch.int32, device=DEVICE))
    assert torch.equal(arena.buffer, arena.original)


def check_rows_kernel_equals_one_row_steps(layout, live, dtype, seed):
    """The rows kernels (a speculative verify) against ``live`` one-token steps: the Triton rows kernel gives every
    row's output and the state after it byte for byte as one-row launches of the decode kernel do, the reference
    rows function as one-token reference steps do (and the two within tolerance); the state is only read, and the
    row states sit strided in a larger buffer (as in ``RowStates``) whose other bytes survive."""
    inputs, arena = gdn_inputs(live, GDN_LAYOUTS[layout], dtype, seed=seed)
    size = arena.state.numel()
    for kernel, rows_kernel in ((delta_rule.gated_delta_rule_triton, delta_rule.gated_delta_rule_rows_triton),
                                (delta_rule.gated_delta_rule_reference, delta_rule.gated_delta_rule_rows)):
        buffer = torch.randn(live, size + 40, generator=gen(seed)).to(DEVICE)
        original = buffer.clone()
        rows = buffer[:, 24:24 + size].unflatten(1, arena.state.shape)
        out = rows_kernel(*inputs, arena.state, rows)
        assert arena.outside_untouched() and torch.equal(arena.buffer, arena.original), "the state is only read"
        assert torch.equal(buffer[:, :24], original[:, :24]) and torch.equal(buffer[:, 24 + size:],
                                                                             original[:, 24 + size:])
        state = arena.state.clone()
        for row in range(live):
            one = kernel(*(t[row:row + 1] if t.dim() >= 2 else t for t in inputs), state)
            name = f"{kernel.__name__} row {row} of {live}"
            assert_same_bytes(f"{name}: output", out[row:row + 1], one)
            assert_same_bytes(f"{name}: state after it", rows[row], state)
        if rows_kernel is delta_rule.gated_delta_rule_rows_triton:
            fast, fast_rows = out, rows.clone()
    assert rel(fast, out) <= TOLERANCE[dtype] and rel(fast_rows, rows) <= STATE_TOLERANCE


@needs_triton
@pytest.mark.parametrize("live", [1, 2, 5])
@pytest.mark.parametrize("layout", ["tiny", "0.8b"])
def test_gated_delta_rule_rows_equal_one_row_steps(layout, live):
    check_rows_kernel_equals_one_row_steps(layout, live, torch.bfloat16, seed_of("rows", layout, live))


@needs_triton
def test_gated_delta_rule_rows_refuses_rows_not_laid_out_as_the_state():
    inputs, arena = gdn_inputs(2, GDN_LAYOUTS["tiny"], torch.float32, seed=9)
    for rows, message in ((torch.zeros(3, *arena.state.shape, device=DEVICE), "rows must be"),
                          (torch.zeros(2, *arena.state.shape, device=DEVICE).transpose(2, 3), "rows must be"),
                          (torch.zeros(2, *arena.state.shape, device=DEVICE, dtype=torch.float64), "rows must be")):
        with pytest.raises(LayoutError, match=message):
            delta_rule.gated_delta_rule_rows_triton(*inputs, arena.state, rows)
    assert torch.equal(arena.buffer, arena.original)


# ---- attention -------------------------------------------------------------------------------------------------

def attention_inputs(length, span, layout, dtype, seed):
    """q and the output gate as the halves of a [L, H, 2D] projection (strided, as the model splits it), keys/values
    as row views of a [T, 2, Hkv, D] cache."""
    heads, kv_heads, dim = layout
    g = gen(seed)
    query_gate = torch.randn(length, heads, 2 * dim, generator=g).to(dtype).to(DEVICE)
    cache = torch.randn(span, 2, kv_heads, dim, generator=g).to(dtype).to(DEVICE)
    return query_gate[..., :dim], query_gate[..., dim:], cache


def attention_float64(q, keys, values, positions, gate=None):
    """Per query row: softmax over keys 0..position in float64, GQA by repeating the KV heads; times sigmoid(gate)
    when a gate is given."""
    groups = q.shape[1] // keys.shape[1]
    keys, values = (x.double().repeat_interleave(groups, dim=1) for x in (keys, values))
    out = []
    for i, p in enumerate(positions.tolist()):
        scores = torch.einsum("hd,thd->ht", q[i].double(), keys[:p + 1]) * q.shape[-1] ** -0.5
        out.append(torch.einsum("ht,thd->hd", scores.softmax(-1), values[:p + 1]))
    out = torch.stack(out)
    return out if gate is None else out * torch.sigmoid(gate.double())


def decode_positions(kind, length, span, g):
    if kind == "consecutive":   # a piece (or one decode token) ending somewhere in the bucket
        start = int(torch.randint(0, span - length + 1, (1,), generator=g))
        return torch.arange(start, start + length)
    return torch.randperm(span, generator=g)[:length]    # arbitrary positions, including very early ones


def span_for(dim):
    """A bucket of several splits (the split is at least one key block: 64 keys for D <= 128, else 32)."""
    return 200 if dim <= 128 else 90


DECODE_CASES = [(name, length, kind) for name in ATTENTION_LAYOUTS for length, kind in
                ((1, "consecutive"), (7, "consecutive"), (5, "arbitrary"))]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout,length,kind", DECODE_CASES, ids=[f"{n}-L{l_}-{k}" for n, l_, k in DECODE_CASES])
def test_attention_decode_triton_matches_reference_and_float64_and_never_reads_stale_keys(layout, length, kind,
                                                                                          dtype):
    seed = seed_of(layout, length, kind, dtype)
    g = gen(seed)
    span = span_for(ATTENTION_LAYOUTS[layout][2])
    q, gate, cache = attention_inputs(length, span, ATTENTION_LAYOUTS[layout], dtype, seed=seed + 1)
    positions = decode_positions(kind, length, span, g).to(DEVICE)
    last = int(positions.max())
    clean = cache.clone()
    clean[last + 1:] = 0.0
    cache[last + 1:] = float("nan")          # stale bytes past every query's position: never read
    want = attention_float64(q, clean[:, 0], clean[:, 1], positions, gate)
    ref = attention.attention_decode_reference(q, clean[:, 0], clean[:, 1], positions, gate)
    out = attention.attention_decode_triton(q, cache[:, 0], cache[:, 1], positions, gate)
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    errors = {"triton": rel(out, want), "reference": rel(ref, want), "vs_ref": rel(out, ref)}
    assert errors["triton"] <= TOLERANCE[dtype], errors
    assert errors["triton"] <= 1.5 * errors["reference"] + 1e-6, errors


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_attention_decode_triton_gates_with_the_references_roundings(dtype):
    """The fused gate rounds as :func:`attention.output_gate` does (attention output, sigmoid and product each in
    the model dtype): against the same kernel with a gate of +20 (sigmoid exactly 1 in fp32, so the ungated output)
    put through ``output_gate``. The sigmoid's exp may differ from torch's by an fp32 ulp, which can move a rounding:
    at most one element in a thousand, by one step; without the intermediate roundings ~10% of elements differ."""
    length, span, layout = 7, span_for(256), ATTENTION_LAYOUTS["0.8b"]
    q, gate, cache = attention_inputs(length, span, layout, dtype, seed=seed_of("gate rounding", dtype))
    positions = decode_positions("consecutive", length, span, gen(3)).to(DEVICE)
    ungated = attention.attention_decode_triton(q, cache[:, 0], cache[:, 1], positions, torch.full_like(gate, 20.0))
    want = attention.output_gate(ungated, gate)
    out = attention.attention_decode_triton(q, cache[:, 0], cache[:, 1], positions, gate)
    differ = out != want
    assert int(differ.sum()) <= out.numel() // 1000, f"{int(differ.sum())} of {out.numel()} elements differ"
    step = torch.finfo(dtype).eps * want.float().abs()
    assert bool(((out.float() - want.float()).abs() <= step + torch.finfo(dtype).tiny).all())


@needs_triton
def test_attention_decode_triton_refuses_bad_layouts():
    q, gate, cache = attention_inputs(2, 64, ATTENTION_LAYOUTS["tiny"], torch.float32, seed=9)
    positions = torch.tensor([3, 4], device=DEVICE)
    keys, values = cache[:, 0], cache[:, 1]
    with pytest.raises(LayoutError, match="positions must be torch.int64"):
        attention.attention_decode_triton(q, keys, values, positions.int(), gate)
    with pytest.raises(LayoutError, match="Hkv dividing H"):
        attention.attention_decode_triton(q[:, :3], keys, values, positions, gate[:, :3])
    with pytest.raises(LayoutError, match="a gate shaped as q"):
        attention.attention_decode_triton(q, keys, values, positions, gate[:1])
    with pytest.raises(LayoutError, match="unit stride"):
        attention.attention_decode_triton(q, keys.transpose(1, 2).contiguous().transpose(1, 2), values, positions,
                                          gate)


PREFILL_CASES = [(name, length, span) for name in ATTENTION_LAYOUTS for length, span in ((9, 9), (6, 21))]


@pytest.mark.parametrize("grouped", [True, False], ids=["sdpa-gqa", "fallback"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout,length,span", PREFILL_CASES, ids=[f"{n}-L{l_}-T{t}" for n, l_, t in PREFILL_CASES])
def test_attention_prefill_matches_float64(layout, length, span, dtype, grouped, monkeypatch):
    """Both paths: SDPA with enable_gqa and the lower-right bias (forced here; on CUDA taken where flash runs it) and
    the repeated-K/V fallback."""
    monkeypatch.setattr(attention, "_flash_takes_gqa", lambda *_: grouped)
    q, _, cache = attention_inputs(length, span, ATTENTION_LAYOUTS[layout], dtype, seed=length * span)
    want = attention_float64(q, cache[:, 0], cache[:, 1], torch.arange(span - length, span))
    out = attention.attention_prefill(q, cache[:, 0], cache[:, 1])
    assert out.shape == q.shape and out.dtype == dtype
    assert rel(out, want) <= REFERENCE_TOLERANCE[dtype]
    assert torch.equal(out, attention.attention_causal(q, cache[:, 0], cache[:, 1])) or grouped


# ---- GPU: realistic sizes (run on the device machine) -------------------------------------------------------------

@on_gpu
@pytest.mark.parametrize("layout", ["0.8b", "27b"])
@pytest.mark.parametrize("length", [1, 16, 24, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_gated_delta_rule_presets_and_graph_replay(layout, length, dtype):
    """The own launch (a piece's: ``PIECE_AHEAD``, the factors ahead of the serial loop) against float64, replayed
    from a CUDA graph, and padded to a bucket against its rows alone."""
    inputs, arena = gdn_inputs(length, GDN_LAYOUTS[layout], dtype, seed=length)
    want, want_state = gdn_float64(*inputs, arena.state)
    start = arena.state.clone()
    out = delta_rule.gated_delta_rule_triton(*inputs, arena.state)
    assert_within("output vs float64", out, want, TOLERANCE[dtype])
    assert_within("state vs float64", arena.state, want_state, 1e-5)
    eager_state, eager = arena.state.clone(), out.clone()
    arena.state.copy_(start)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        arena.state.copy_(start)
        delta_rule.gated_delta_rule_triton(*inputs, arena.state)          # compile outside the capture
        arena.state.copy_(start)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        captured = delta_rule.gated_delta_rule_triton(*inputs, arena.state)
    arena.state.copy_(start)
    graph.replay()
    torch.cuda.synchronize()
    assert_same_bytes("graph replay output vs eager", captured, eager)
    assert_same_bytes("graph replay state vs eager", arena.state, eager_state)
    if length == 1:
        return   # a one-row launch is a decode step: it has no padding rows (pieces are buckets of 8 or more)
    count = torch.tensor(length - 3, device=DEVICE)
    padded_state, alone_state = start.clone(), start.clone()
    n = int(count)
    padded = delta_rule.gated_delta_rule_triton(*poison_rows(inputs, n), padded_state, count)
    alone = delta_rule.gated_delta_rule_triton(*(t[:n] if t.dim() >= 2 else t for t in inputs), alone_state)
    assert_same_bytes(f"state of a bucket of {length} with count {n} vs {n} rows alone", padded_state, alone_state)
    assert_same_bytes(f"output of a bucket of {length} with count {n} vs {n} rows alone", padded[:n], alone)


@on_gpu
@pytest.mark.parametrize("layout", ["0.8b", "27b"])
@pytest.mark.parametrize("live", [2, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_gated_delta_rule_rows_equal_one_row_steps(layout, live, dtype):
    """Compiled, the rows kernel (STORE_ROWS) still computes the decode kernel's bytes row by row."""
    check_rows_kernel_equals_one_row_steps(layout, live, dtype, seed_of("gpu rows", layout, live))


@on_gpu
@pytest.mark.parametrize("layout", ["0.8b", "27b"])
@pytest.mark.parametrize("span", [2048, 16384])
@pytest.mark.parametrize("length", [1, 16, 64])
def test_gpu_attention_decode_long_buckets_and_one_graph_for_every_position(layout, span, length):
    q, gate, cache = attention_inputs(length, span, ATTENTION_LAYOUTS[layout], torch.bfloat16, seed=span + length)
    g = gen(span)
    positions = decode_positions("consecutive", length, span, g).to(DEVICE)
    out = attention.attention_decode_triton(q, cache[:, 0], cache[:, 1], positions, gate)
    want = attention_float64(q, cache[:, 0], cache[:, 1], positions, gate)
    ref = attention.attention_decode_reference(q, cache[:, 0], cache[:, 1], positions, gate)
    error = assert_within("output vs float64", out, want, TOLERANCE[torch.bfloat16])
    assert error <= 1.5 * rel(ref, want) + 1e-6, f"Triton error {error:.3g} vs the reference's {rel(ref, want):.3g}"
    live = positions.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = attention.attention_decode_triton(q, cache[:, 0], cache[:, 1], live, gate)
    for start in (0, 100, span // 2, span - length):
        live.copy_(torch.arange(start, start + length, device=DEVICE))
        graph.replay()
        eager = attention.attention_decode_triton(q, cache[:, 0], cache[:, 1], live, gate)
        assert_same_bytes(f"graph replay vs eager, positions from {start}", captured, eager)


@on_gpu
@pytest.mark.parametrize("layout", ["0.8b", "27b"])
@pytest.mark.parametrize("length,span", [(4096, 4096), (512, 4096), (16384, 16384)])
def test_gpu_attention_prefill_runs_flash_without_repeated_kv(layout, length, span):
    q, _, cache = attention_inputs(length, span, ATTENTION_LAYOUTS[layout], torch.bfloat16, seed=7)
    keys, values = cache[:, 0], cache[:, 1]
    assert attention._flash_takes_gqa(*(x.transpose(0, 1)[None] for x in (q, keys, values)))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = attention.attention_prefill(q, keys, values)
    ops = {event.name for event in prof.events()}
    fused = {"aten::_scaled_dot_product_flash_attention", "aten::_flash_attention_forward",
             "aten::_scaled_dot_product_cudnn_attention"}   # SDPA picks cuDNN's flash kernel on sm_90 (seen on the H200)
    assert fused & ops, ops
    assert "aten::repeat_interleave" not in ops, ops
    ref = attention.attention_causal(q, keys, values)
    assert_within("flash GQA vs repeated K/V", out, ref, 1e-2)
    if span <= 4096:
        want = attention_float64(q[-64:], keys, values, torch.arange(span - 64, span, device=DEVICE))
        assert_within("last 64 rows vs float64", out[-64:], want, TOLERANCE[torch.bfloat16])


@needs_triton
def test_the_launch_sweep_checks_every_configuration_against_the_default_and_times_the_correct_ones(tmp_path):
    """bench/time_delta_rule.py --sweep: every configuration of the tiny shape computes the default's output (so none
    is reported wrong), and each is timed once per length."""
    import json

    import bench_scripts
    sweep = bench_scripts.load("time_delta_rule")
    out = tmp_path / "sweep.json"
    assert sweep.main(["tiny", "2", "--sweep", "--repeats", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == len(sweep.sweep_configs(16, 2)) and sum(r["default"] for r in rows) == 1
    in_a_step, = json.loads(out.read_text())["in_a_step"]             # the same bytes, checked by the script
    assert in_a_step["config"] == rows[0]["config"]
    assert in_a_step["us"] > 0 and in_a_step["views_us"] > 0 and in_a_step["count_us"] > 0
    assert all(r["correct"] and r["us"] > 0 for r in rows), [r for r in rows if not r["correct"]]


@needs_triton
def test_the_attention_sweep_checks_every_configuration_against_the_default_and_times_the_correct_ones(tmp_path):
    """bench/time_attention.py --sweep: every tile, key block, split count and warp count of the tiny shape computes
    the default's output, and each is timed once per length; a launch whose tile cannot hold a row's heads is
    refused."""
    import json

    import bench_scripts
    sweep = bench_scripts.load("time_attention")
    out = tmp_path / "sweep.json"
    assert sweep.main(["tiny", "5", "--context", "40", "--sweep", "--repeats", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    groups = 2                                                                 # the tiny preset: 4 heads, 2 KV heads
    dim = ATTENTION_LAYOUTS["tiny"][2]
    assert len(rows) == len(sweep.sweep_configs(5, groups, dim)) and sum(r["default"] for r in rows) == 1
    tiles = {length: {c.block_m for c in sweep.sweep_configs(length, groups, dim)} for length in (1, 5, 9, 40, 80)}
    assert tiles == {1: {16}, 5: {16}, 9: {16, 32}, 40: {16, 32, 64, 128}, 80: {16, 32, 64, 128}}  # none past a piece
    wide = {(c.block_m, c.num_warps) for c in sweep.sweep_configs(24, 4, 256)}      # the 0.8B's piece
    assert (128, 8) in wide and (128, 16) in wide and (128, 4) not in wide and (64, 4) in wide
    assert all(r["correct"] and r["us"] > 0 for r in rows), [r for r in rows if not r["correct"]]
    q, gate, cache = attention_inputs(1, 8, ATTENTION_LAYOUTS["tiny"], torch.float32, seed=1)
    with pytest.raises(LayoutError, match="a tile needs"):
        attention.attention_decode_triton(q, cache[:, 0], cache[:, 1], torch.tensor([3], device=DEVICE), gate,
                                          launch=attention.AttentionLaunch(8, 32, 256, 4))


@needs_triton
@pytest.mark.parametrize("layout", ["tiny", "0.8b"])
def test_a_query_rows_attention_does_not_depend_on_its_place_among_the_rows(layout):
    """A speculative verify commits any of its rows as the state a decode step would have written, so row r of an
    L-row call must have the bytes of the same query placed first. Under the interpreter tl.dot is numpy's BLAS,
    which rounds a row by its place in the tile; the kernel's products sum over K in order there instead."""
    length = 5
    q, gate, cache = attention_inputs(length, 64, ATTENTION_LAYOUTS[layout], torch.float32, seed=11)
    positions = torch.arange(40, 40 + length, device=DEVICE)
    full = attention.attention_decode_triton(q, cache[:, 0], cache[:, 1], positions, gate)
    for row in range(length):
        order = [row] + [r for r in range(length) if r != row]
        moved = attention.attention_decode_triton(q[order], cache[:, 0], cache[:, 1], positions[order], gate[order])
        assert torch.equal(moved[0], full[row]), row
