"""Weight-only quantization: the fused Triton GEMVs against their references (through Triton's interpreter on the
CPU), the encoders against independent float64 roundings, capsules per format, refusal across formats, and fidelity
figures. (Pre-quantized checkpoints: test_runtime_quant_checkpoints.py.)"""
import importlib.util
import itertools
import json
import math
import zlib

import pytest
import torch

import bench_scripts
from capsule_helpers import plant_foreign_capsule
from flashrt_ros.runtime import Engine, EngineConfig, ErrorCode, FlashRTError
from flashrt_ros.runtime import quant
from flashrt_ros.runtime.kernels import quant_gemv as kq
from flashrt_ros.runtime.kernels._triton import triton
from flashrt_ros.tools import bench_quant
from flashrt_ros.tools.verify import verify
from kernel_checks import describe


tune = bench_scripts.load("tune_quant_gemv")

needs_triton = pytest.mark.skipif(triton is None, reason="triton is not importable")
QUANTIZED = ("fp8", "nvfp4")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- independent float64 roundings ---------------------------------------------------------------------------------
def e2m1_nearest64(values: torch.Tensor) -> torch.Tensor:
    """Nearest signed E2M1 value by exhaustive search in float64; ties to the even code (even mantissa bit)."""
    grid = torch.tensor(kq.E2M1_VALUES, dtype=torch.float64)
    out = []
    for v in values.double().tolist():
        distance = [abs(abs(v) - g) for g in grid.tolist()]
        best = min(distance)
        ties = [i for i, d in enumerate(distance) if d == best]
        code = next((i for i in ties if i % 2 == 0), ties[0])
        out.append(math.copysign(grid[code].item(), v))
    return torch.tensor(out, dtype=torch.float64)


def e4m3_values64() -> torch.Tensor:
    """Every finite non-negative float8_e4m3fn value from its bit layout (bias 7; S.1111.111 is NaN)."""
    values = []
    for e, m in itertools.product(range(16), range(8)):
        if (e, m) == (15, 7):
            continue
        values.append(m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return torch.tensor(values, dtype=torch.float64)


def e4m3_nearest64(values: torch.Tensor) -> torch.Tensor:
    grid = e4m3_values64()
    out = []
    for v in values.double().tolist():
        distance = (grid - v).abs()
        ties = (distance == distance.min()).nonzero().flatten().tolist()
        code = next((i for i in ties if i % 2 == 0), ties[0])   # grid index parity = mantissa parity
        out.append(grid[code].item())
    return torch.tensor(out, dtype=torch.float64)


def test_e2m1_rounding_matches_an_exhaustive_float64_search():
    g_ = gen(1)
    midpoints = torch.tensor([(a + b) / 2 for a, b in zip(kq.E2M1_VALUES, kq.E2M1_VALUES[1:])])
    values = torch.cat([12 * torch.rand(400, generator=g_) - 6, midpoints, -midpoints,
                        torch.tensor(kq.E2M1_VALUES), -torch.tensor(kq.E2M1_VALUES)])
    codes = quant.e2m1_codes(values)
    decoded = kq.unpack_e2m1(quant.pack_e2m1(codes[None, :]))[0]
    assert torch.equal(decoded.double(), e2m1_nearest64(values))
    assert torch.equal(torch.signbit(decoded), torch.signbit(values))


def test_nvfp4_block_scales_are_e4m3_roundings_of_amax_over_6_times_the_global_scale():
    w = torch.randn(24, 64, generator=gen(2)) * torch.logspace(-3, 1, 24)[:, None]
    weight = quant.quantize_nvfp4(w)
    gs = 448.0 * 6.0 / w.abs().max()
    target = w.reshape(24, -1, kq.NVFP4_GROUP).abs().amax(-1) / 6.0 * gs
    assert torch.allclose(1.0 / weight.row_scale, gs.expand(24))
    assert torch.equal(weight.scale.double().flatten(), e4m3_nearest64(target.flatten()))


# ---- round trips: exact for values the format represents -----------------------------------------------------------
def representable_fp8(seed: int, n: int = 12, k: int = 48) -> torch.Tensor:
    """E4M3 values times a power-of-two scale per row, each row holding +-448 (so amax / 448 is that scale)."""
    g_ = gen(seed)
    codes = torch.randn(n, k, generator=g_).mul(60).to(torch.float8_e4m3fn).float()
    codes[:, 0] = 448.0 * torch.where(torch.rand(n, generator=g_) < 0.5, -1.0, 1.0)
    return codes * 2.0 ** torch.randint(-12, 4, (n, 1), generator=g_).float()


def representable_nvfp4(seed: int, n: int = 8, k: int = 64) -> torch.Tensor:
    """E2M1 values times an E4M3 block scale, each block holding +-6, one block scaled by 448, all over 2^j."""
    g_ = gen(seed)
    codes = torch.tensor(kq.E2M1_VALUES)[torch.randint(0, 8, (n, k // 16, 16), generator=g_)]
    codes *= torch.where(torch.rand(n, k // 16, 16, generator=g_) < 0.5, -1.0, 1.0)
    codes[..., 3] = 6.0
    block = e4m3_values64()[torch.randint(40, 126, (n, k // 16), generator=g_)].float()
    block[0, 0] = 448.0
    return (codes * block[..., None]).reshape(n, k) * 2.0 ** -int(torch.randint(0, 9, (1,), generator=g_))


@pytest.mark.parametrize("seed", range(4))
def test_fp8_round_trip_is_exact_for_representable_weights(seed):
    w = representable_fp8(seed)
    weight = quant.quantize_fp8(w)
    assert torch.equal(weight.dequantize(), w)
    assert torch.equal(quant.quantize_fp8(weight.dequantize()).q.view(torch.uint8), weight.q.view(torch.uint8))


@pytest.mark.parametrize("seed", range(4))
def test_nvfp4_round_trip_is_exact_for_representable_weights(seed):
    w = representable_nvfp4(seed)
    weight = quant.quantize_nvfp4(w)
    assert torch.equal(weight.dequantize(), w)
    again = quant.quantize_nvfp4(weight.dequantize())
    assert torch.equal(again.q, weight.q) and torch.equal(again.scale.view(torch.uint8), weight.scale.view(torch.uint8))


@pytest.mark.parametrize("fmt,bound", [("fp8", 0.5), ("nvfp4", 0.5)])
def test_quantization_error_is_bounded_by_half_a_step(fmt, bound):
    """|w - dequant(quant(w))| <= half the spacing of the format's grid at the row's (or block's) scale."""
    w = torch.randn(16, 128, generator=gen(5))
    err = (quant.QUANTIZERS[fmt](w).dequantize() - w).abs()
    if fmt == "fp8":   # the widest E4M3 step is 32 (between 256 and 448) at a scale of amax / 448
        assert bool((err <= bound * 32 / 448 * w.abs().amax(1, keepdim=True) * 1.001).all())
    else:              # the widest E2M1 step is 2 (between 4 and 6) at a block scale of ~amax / 6
        block_amax = w.reshape(16, -1, 16).abs().amax(-1, keepdim=True)
        assert bool((err.reshape(16, -1, 16) <= bound * 2 * block_amax / 6 * 1.07).all())


def test_all_zero_weights_quantize_to_zero_without_nans():
    for fmt in QUANTIZED:
        assert torch.equal(quant.QUANTIZERS[fmt](torch.zeros(4, 32)).dequantize(), torch.zeros(4, 32))


# ---- the fused GEMVs against their references ----------------------------------------------------------------------


GEMV_CASES = [  # rows, N, K: one row block and several, K in one slice and split over several, ragged N; several
    (1, 48, 256), (1, 40, 768), (3, 72, 512), (16, 33, 256), (37, 64, 1024), (64, 8, 256), (150, 24, 256)]  # x blocks


def gemv_tolerance(fmt: str, dtype: torch.dtype, rows: int) -> float:
    """Relative tolerance (of each value, and of the largest) of a fused GEMV against its reference: bf16 outputs
    round to 8 bits; fp32 ones agree to summation order, except nvfp4 decode, whose products and 16-value group
    sums are fp16 (11 bits, see ``_nvfp4_row_step``)."""
    if dtype != torch.float32:
        return 2e-2
    return 2e-3 if fmt == "nvfp4" and rows == 1 else 1e-4


def random_weight(fmt: str, n: int, k: int, g_: torch.Generator) -> quant.QuantizedWeight:
    """``fp8-block``: fp8 codes with 128 x 128 block scales, as a block-scaled checkpoint stores them."""
    if fmt == "fp8-block":
        q = torch.randn(n, k, generator=g_).mul(50).to(torch.float8_e4m3fn)
        return quant.fp8_from_blocks(q, torch.rand(-(-n // 128), k // 128, generator=g_), 128, 128)
    return quant.QUANTIZERS[fmt](torch.randn(n, k, generator=g_) * torch.rand(n, 1, generator=g_))


@needs_triton
@pytest.mark.parametrize("rows,n,k", GEMV_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["fp8", "fp8-block", "nvfp4"])
def test_triton_gemv_matches_its_reference(fmt, dtype, rows, n, k, poisoned_empty):
    g_ = gen(zlib.crc32(repr((fmt, dtype, rows, n, k)).encode()))
    x = torch.randn(rows, k, generator=g_).to(dtype)
    weight = random_weight(fmt, n, k, g_)
    fast, reference = ((kq.fp8_linear_triton, kq.fp8_linear_reference) if weight.fmt == "fp8" else
                       (kq.nvfp4_linear_triton, kq.nvfp4_linear_reference))
    args = (weight.q, weight.scale) + (() if weight.fmt == "fp8" else (weight.row_scale,))
    got, want = fast(x, *args), reference(x, *args)
    assert got.shape == (rows, n) and got.dtype == dtype and not got.isnan().any()
    tol = gemv_tolerance(weight.fmt, dtype, rows)
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * float(want.abs().max())), describe(got, want)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activations", ["outliers", "huge", "tiny", "one split tiny"])
def test_nvfp4_decode_keeps_its_fp16_products_in_range_for_any_activation_scale(activations, dtype):
    """Decode's nvfp4 products are fp16, so x is scaled by a power of two chosen from its largest magnitude in each
    program's K slice: activation outliers of 3e4 next to values of 1e-3, activations of 2^60 or 2^-60 (where fp16
    would overflow or flush), and one split-K slice far smaller than the other all match the fp32 reference."""
    g_ = gen(zlib.crc32(activations.encode()))
    n, k = 40, 1024
    x = torch.randn(1, k, generator=g_)
    if activations == "outliers":
        x = x * 1e-3
        x[0, [5, 700]] = torch.tensor([3e4, -2.5e4])
    elif activations == "huge":
        x = x * 2.0 ** 60
    elif activations == "tiny":
        x = x * 2.0 ** -60
    else:
        x[0, k // 2:] *= 2.0 ** -40
    x = x.to(dtype)
    weight = random_weight("nvfp4", n, k, g_)
    args = (weight.q, weight.scale, weight.row_scale)
    want = kq.nvfp4_linear_reference(x.float(), *args)
    for config in (None, kq.GemvConfig(16, 256, 4, 1, 2)):          # one K slice, and two
        got = kq.nvfp4_linear_triton(x, *args, config=config).float()
        assert got.isfinite().all(), (activations, config, got)
        tol = gemv_tolerance("nvfp4", dtype, 1)
        assert torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max())), describe(got, want)
    assert torch.equal(kq.nvfp4_linear_triton(torch.zeros_like(x), *args), torch.zeros(1, n, dtype=dtype))


@needs_triton
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("rows", [1, 16])
def test_split_k_gemv_is_summed_in_the_kernel_and_leaves_its_counters_zero(fmt, rows):
    """Split K: the last slice of each output tile to arrive sums the partials (no torch reduction after the
    kernel); the result matches the reference, repeats bit for bit, and every arrival counter is back to zero."""
    g_ = gen(zlib.crc32(repr(("split", fmt, rows)).encode()))
    x = torch.randn(rows, 1024, generator=g_).bfloat16()
    weight = random_weight(fmt, 40, 1024, g_)
    config = kq.GemvConfig(16, 128, 4, 1, 3)                         # 3 output tiles x 3 slices
    first = assert_matches_reference(fmt, x, weight, config)
    fused, _, _ = _fused_and_reference(weight)
    assert torch.equal(fused(x, config), first)
    assert kq._arrival_tensor(x.device).count_nonzero() == 0


def _fused_and_reference(weight: quant.QuantizedWeight):
    args = tuple(weight.tensors().values())
    if weight.fmt == "fp8":
        return (lambda x, config=None: kq.fp8_linear_triton(x, *args, config=config)), kq.fp8_linear_reference, args
    return (lambda x, config=None: kq.nvfp4_linear_triton(x, *args, config=config)), kq.nvfp4_linear_reference, args


def assert_matches_reference(fmt, x, weight, config=None):
    fused, reference, args = _fused_and_reference(weight)
    got, want = fused(x, config), reference(x, *args)
    assert got.shape == want.shape and got.dtype == x.dtype and not got.isnan().any(), (fmt, config)
    tol = gemv_tolerance(weight.fmt, x.dtype, x.shape[0])
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * float(want.abs().max())), (
        fmt, config, describe(got, want))
    return got


def _scaled_down_preset_shapes() -> list[tuple[int, int]]:
    """The presets' projection shapes (N, K) divided by 512 along N and 32 along K, kept multiples of 128 in K."""
    shapes = set()
    for preset in ("qwen3.5-0.8b", "qwen3.6-27b"):
        for n, k in bench_quant.preset_projection_shapes(preset):
            shapes.add((max(1, n // 512), max(128, k // 32 // 128 * 128)))
    return sorted(shapes)


SCALED_SHAPES = _scaled_down_preset_shapes()   # at import: meta models, outside poisoned_empty


@needs_triton
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("fmt", ["fp8", "fp8-block", "nvfp4"])
def test_triton_gemv_matches_its_reference_at_random_shapes_and_rows(fmt, seed, poisoned_empty):
    """Random scaled-down preset shapes (and ragged N), random rows in 1..the fused threshold, either dtype."""
    g_ = gen(zlib.crc32(repr((fmt, seed)).encode()))
    n, k = SCALED_SHAPES[int(torch.randint(len(SCALED_SHAPES), (1,), generator=g_))]
    n += int(torch.randint(0, 7, (1,), generator=g_))
    limit = max(kq.fused_max_rows(fmt, torch.device("cpu")), max(kq.ROW_BUCKETS))
    rows = 1 if seed % 2 == 0 else int(torch.randint(2, limit + 1, (1,), generator=g_))
    dtype = (torch.float32, torch.bfloat16)[seed % 3 == 0]
    assert_matches_reference(fmt, torch.randn(rows, k, generator=g_).to(dtype), random_weight(fmt, n, k, g_))


def _interpreted_configs() -> set[tuple[str, int, kq.GemvConfig]]:
    """(weight kind, rows bucket, config) of every table entry and every configuration the tuner sweeps, with warps
    and stages dropped (the interpreter ignores them) and one and two K slices."""
    configs = {(kind, bucket, cfg) for table in kq.quant_gemv_configs.TABLE.values()
               for (kind, _, _, bucket), cfg in ((key, kq.GemvConfig(*c)) for key, c in table["configs"].items())}
    configs |= {(kind, bucket, cfg) for kind in kq.WEIGHT_KINDS for bucket in kq.ROW_BUCKETS
                for cfg in tune.candidates(kind, bucket)}
    return {(kind, bucket, cfg._replace(num_warps=4, num_stages=1, splits=s))
            for kind, bucket, cfg in configs for s in (1, 2)}


@needs_triton
@pytest.mark.parametrize("fmt", ["fp8", "fp8-block", "nvfp4"])
def test_every_tabled_and_swept_config_is_correct(fmt, poisoned_empty):
    """The table's configurations must all be right, not only the default: each on a small shape at a row count of
    its bucket, with a ragged N and a K that leaves a partial last tile for the larger tiles."""
    weight = random_weight(fmt, 72, 640, gen(zlib.crc32(fmt.encode())))
    cases = sorted((b, c) for kind, b, c in _interpreted_configs() if kind == fmt)
    assert len(cases) >= 16
    for bucket, config in cases:
        rows = bucket if bucket == 1 else bucket - 3
        assert_matches_reference(fmt, torch.randn(rows, 640, generator=gen(bucket)), weight, config)


def test_the_config_is_the_tables_for_its_device_and_the_default_elsewhere(monkeypatch):
    tabled = kq.GemvConfig(64, 512, 8, 1, 3)
    monkeypatch.setattr(kq.quant_gemv_configs, "TABLE", {"cpu": {"configs": {("nvfp4", 40, 512, 16): tuple(tabled)},
                                                                  "fused_max_rows": {"nvfp4": 32}}})
    cpu, other = torch.device("cpu"), torch.device("meta")
    assert [kq.gemv_config("nvfp4", 40, 512, rows, cpu) for rows in (9, 16)] == [tabled, tabled]
    for rows, n, device in ((17, 40, cpu), (16, 48, cpu), (16, 40, other)):
        assert kq.gemv_config("nvfp4", n, 512, rows, device) == kq.default_config("nvfp4", n, 512, kq.rows_bucket(rows))
    assert kq.fused_max_rows("nvfp4", cpu) == 32
    assert kq.fused_max_rows("fp8", cpu) == kq.fused_max_rows("nvfp4", other) == \
        kq.quant_gemv_configs.DEFAULT_FUSED_MAX_ROWS


@needs_triton
def test_triton_gemv_is_deterministic_and_rows_do_not_interact():
    """Same inputs, same bytes; a row's result does not depend on the other rows of its piece."""
    weight = quant.quantize_nvfp4(torch.randn(40, 512, generator=gen(7)))
    x = torch.randn(5, 512, generator=gen(8))
    args = (weight.q, weight.scale, weight.row_scale)
    full = kq.nvfp4_linear_triton(x, *args)
    assert torch.equal(full, kq.nvfp4_linear_triton(x, *args))
    other = torch.cat([torch.randn(2, 512, generator=gen(9)), x[2:3]])
    assert torch.equal(full[2], kq.nvfp4_linear_triton(other, *args)[2])


@needs_triton
def test_the_fused_gemv_refuses_more_rows_than_it_serves():
    weight = quant.quantize_fp8(torch.randn(8, 256))
    with pytest.raises(ValueError, match=f"1..{kq.GEMV_MAX_ROWS} rows"):
        kq.fp8_linear_triton(torch.randn(kq.GEMV_MAX_ROWS + 1, 256), weight.q, weight.scale)


@needs_triton
@pytest.mark.parametrize("fmt", ["fp8", "fp8-block", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_dequantise_writes_the_reference_weights(fmt, dtype, poisoned_empty):
    weight = random_weight(fmt, 40, 384, gen(zlib.crc32(repr((fmt, dtype)).encode())))
    got, want = kq.dequantize_triton(weight.q, weight.scale, weight.row_scale, dtype), weight.dequantize().to(dtype)
    assert got.dtype == dtype
    if dtype == torch.float32 or torch.cuda.is_available():
        assert torch.equal(got, want)
    else:   # Triton's interpreter truncates to bf16 where the GPU rounds to nearest: within one bf16 step
        assert torch.allclose(got.float(), want.float(), rtol=2.0 ** -7, atol=0)


@needs_triton
@pytest.mark.parametrize("limit", [1, 16, 40])
def test_quant_linear_takes_the_fused_gemv_up_to_its_rows_and_a_gemm_beyond(monkeypatch, limit):
    weight = quant.quantize_nvfp4(torch.randn(16, 64, generator=gen(9)))
    layer = quant.QuantLinear(weight, use_triton=True)
    calls = []
    monkeypatch.setitem(quant._LINEAR, "nvfp4", (kq.nvfp4_linear_reference,
                                                 lambda *a: calls.append("fused") or kq.nvfp4_linear_reference(*a)))
    monkeypatch.setattr(kq, "dequantize_triton", lambda *a: calls.append("dequantise") or weight.dequantize())
    monkeypatch.setattr(kq.quant_gemv_configs, "TABLE", {"cpu": {"configs": {}, "fused_max_rows": {"nvfp4": limit}}})
    x = torch.randn(kq.GEMV_MAX_ROWS + 1, 64, generator=gen(10))
    layer(x[:limit].reshape(limit, 1, 64))
    layer(x[:limit + 1])
    assert torch.allclose(layer(x), kq.nvfp4_linear_reference(x, *weight.tensors().values()), atol=1e-5)
    assert calls == ["fused", "dequantise", "dequantise"]
    assert quant.QuantLinear(weight, use_triton=False)(x).shape == (kq.GEMV_MAX_ROWS + 1, 16)


# ---- what each format quantizes ------------------------------------------------------------------------------------
def quant_layers(engine: Engine) -> dict[str, str]:
    return {n: m.fmt for n, m in engine.model.named_modules() if isinstance(m, quant.QuantLinear)}


def tiny(**overrides) -> Engine:
    return Engine(EngineConfig(**{"max_context": 256, **overrides}))


def test_every_projection_and_the_lm_head_are_quantized_by_default():
    engine = tiny(weights_format="nvfp4")
    layers = quant_layers(engine)
    assert set(layers.values()) == {"nvfp4"} and "quantized_head" in layers
    assert any(n.endswith("linear_attn.in_proj") for n in layers) and any(n.endswith("gate_up_proj") for n in layers)
    assert not any(isinstance(m, torch.nn.Linear) for m in engine.model.modules())
    assert engine.stats()["weights_format"] == "nvfp4/reference"


def test_exclude_patterns_keep_projections_dense():
    engine = tiny(weights_format="fp8", weights_exclude=("*.linear_attn.*", "lm_head"))
    layers = quant_layers(engine)
    assert layers and not any(".linear_attn." in n for n in layers) and "quantized_head" not in layers
    dense = [n for n, m in engine.model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert dense and all(".linear_attn." in n for n in dense)


def test_unknown_format_is_refused():
    with pytest.raises(FlashRTError) as err:
        tiny(weights_format="int3")
    assert err.value.code == ErrorCode.INVALID_ARGUMENT


# ---- capsules per format, refusal across formats, fidelity ---------------------------------------------------------
@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_capsules_are_byte_exact_and_continuations_token_identical_in_every_format(fmt):
    report = verify(tiny(weights_format=fmt), prefix_len=64, suffix_len=11, gen=8)
    assert report["byte_exact"] and report["token_identical"], report


@pytest.mark.parametrize("source,target", [("dense", "fp8"), ("fp8", "nvfp4"), ("nvfp4", "dense")])
def test_a_capsule_is_refused_by_an_engine_of_another_format(source, target, tmp_path):
    a, b = (tiny(weights_format=fmt, capsule_dir=str(tmp_path)) for fmt in (source, target))
    a.ingest(list(range(20)))
    a.snapshot("c1")
    a.export_capsule("c1")
    b.ingest(list(range(5)))
    before = b.live_bytes()
    for call in (lambda: b.import_capsule("c1"), lambda: plant_foreign_capsule(b, a, "c1") or b.restore("c1")):
        with pytest.raises(FlashRTError) as err:
            call()
        assert err.value.code == ErrorCode.FINGERPRINT_MISMATCH
        assert torch.equal(b.live_bytes(), before) and b.position == 5


def test_the_fingerprint_covers_this_devices_gemv_table(monkeypatch):
    """A table entry for this device fixes the GEMVs' reduction orders, so a quantized engine built under another one
    refuses the first one's capsules; a dense engine does not depend on the table."""
    before = {fmt: tiny(weights_format=fmt).fingerprint for fmt in ("dense", "fp8")}
    monkeypatch.setitem(kq.quant_gemv_configs.TABLE, kq.device_name(torch.device("cpu")),
                        {"configs": {("fp8", 8, 8, 1): (16, 128, 4, 1, 1)}, "fused_max_rows": {"fp8": 4}})
    assert tiny(weights_format="fp8").fingerprint != before["fp8"]
    assert tiny(weights_format="dense").fingerprint == before["dense"]


def test_fidelity_figures_order_the_formats():
    """Logits error and greedy agreement against the fp32 dense engine on the tiny model, teacher-forced along its
    greedy continuation. The dense engine agrees with itself exactly; nvfp4 errs more than fp8; keeping the Gated
    DeltaNet projections dense (as FlashRT does) cuts fp8's error: the recurrence amplifies their rounding.
    The printed figures are the ones BENCHMARKS.md records."""
    prompt, n = list(range(7, 71)), 12
    variants = {"dense": ("dense", ()), "fp8": ("fp8", ()), "nvfp4": ("nvfp4", ()),
                "fp8, GDN dense": ("fp8", ("*.linear_attn.*",)), "nvfp4, GDN dense": ("nvfp4", ("*.linear_attn.*",))}
    engines = {name: tiny(weights_format=fmt, weights_exclude=ex) for name, (fmt, ex) in variants.items()}
    engines["dense"].ingest(prompt)
    ref_free = list(engines["dense"].generate(n, stop_token_ids=()))
    reference = bench_quant.teacher_forced(engines["dense"], prompt, ref_free)
    figures = {}
    for name, engine in engines.items():
        engine.reset()
        engine.ingest(prompt)
        free = list(engine.generate(n, stop_token_ids=()))
        figures[name] = bench_quant.fidelity(reference, bench_quant.teacher_forced(engine, prompt, ref_free),
                                             ref_free, free)
    print(json.dumps(figures, indent=1))
    err = {name: f["logits_rel_l2_mean"] for name, f in figures.items()}
    assert figures["dense"]["logits_max_abs_err"] == 0 and figures["dense"]["greedy_agreement"] == 1.0
    assert figures["dense"]["free_run_first_divergence"] is None
    assert 0 < err["fp8"] < err["nvfp4"] and 0 < err["fp8, GDN dense"] < err["nvfp4, GDN dense"]
    assert err["fp8, GDN dense"] < err["fp8"] and err["nvfp4, GDN dense"] < err["nvfp4"]
    assert figures["fp8, GDN dense"]["greedy_agreement"] > figures["nvfp4"]["greedy_agreement"]


@pytest.mark.parametrize("fmt", quant.FORMATS)
@pytest.mark.parametrize("exclude, model", [((), "tiny"), (("*.linear_attn.*",), "tiny"), (("lm_head",), "tiny"),
                                            ((), "tiny-vl")])
def test_projected_bytes_per_token_match_the_built_model(fmt, exclude, model):
    """What a decode step reads (the vision tower's weights are loaded, never read by a decode step)."""
    engine = tiny(weights_format=fmt, weights_exclude=exclude, model=model)
    element = engine.arena["hidden"].element_size()
    assert bench_quant.projected_bytes_per_token(engine.model_config, fmt, exclude, element) == \
        bench_quant.weights_read_per_token(engine.model)


def test_bench_quant_runs_every_format_side_by_side():
    result = bench_quant.run(bench_quant.QuantBenchConfig(EngineConfig(prefill_chunk=64), context=32,
                                                          decode_tokens=4, prefill_tokens=32, fidelity_tokens=4,
                                                          repeats=1))
    rows = {r["format"]: r for r in result["formats"]}
    assert set(rows) == {"dense", "fp8/reference", "nvfp4/reference"}
    assert rows["dense"]["weight_bytes_per_token"] > rows["fp8/reference"]["weight_bytes_per_token"] > \
        rows["nvfp4/reference"]["weight_bytes_per_token"]
    assert all(r["decode_ms_per_token"] > 0 and r["cold_ttft_ms"] > 0 for r in rows.values())
    assert {g["shape"] for g in result["gemv"]} >= {"lm_head"}
    for g in result["gemv"]:   # one layer's error: rounding to E4M3 (3 mantissa bits), then to E2M1 (1), ordered
        assert g["dense_rel_err"] < 1e-3 < g["fp8_rel_err"] < 0.05 < g["nvfp4_rel_err"] < 0.2, g
    assert len(result["thor_projection"]) == 9
    assert "projection" in bench_quant.markdown(result)


def run_cli(capsys, *argv) -> tuple[int, dict]:
    from flashrt_ros.tools.cli import main
    code = main(list(argv))
    return code, json.loads(capsys.readouterr().out)


def test_the_cli_runs_a_quantized_engine_and_refuses_hf_comparison_of_one(capsys, tmp_path):
    code, out = run_cli(capsys, "generate", "--prompt-ids", "1,2,3", "--max-new-tokens", "3",
                        "--weights-format", "nvfp4", "--weights-exclude", "*.linear_attn.*, lm_head")
    assert code == 0 and len(out["tokens"]) == 3
    code, out = run_cli(capsys, "bench", "--contexts", "64", "--weights-format", "fp8", "--compare-hf")
    assert code == 2 and out["error"] == "INVALID_ARGUMENT" and "--compare-hf" in out["message"]
    code, out = run_cli(capsys, "bench-quant", "--formats", "nvfp4", "--context", "16", "--decode-tokens", "2",
                        "--prefill-tokens", "16", "--fidelity-tokens", "2", "--repeats", "1", "--prefill-chunk", "64",
                        "--out", str(tmp_path / "q.json"))
    assert code == 0 and [r["format"] for r in out["formats"]] == ["dense", "nvfp4/reference"]
    assert json.loads((tmp_path / "q.json").read_text())["formats"] == out["formats"]


# ---- on the GPU ----------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", QUANTIZED)
def test_gpu_quantized_engine_with_graphs_is_byte_exact_and_uses_the_fused_gemv(fmt):
    engine = Engine(EngineConfig(model="tiny", device="cuda", dtype="bfloat16", max_context=512,
                                 weights_format=fmt))
    assert engine.weights_format == f"{fmt}/triton", engine.platform.quant_kernels
    report = verify(engine, prefix_len=128, suffix_len=24, gen=32)
    assert report["byte_exact"] and report["token_identical"], report


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", QUANTIZED)
@pytest.mark.parametrize("rows,n,k", [(1, 1024, 3584), (1, 248320, 1024), (8, 6144, 1024), (64, 5120, 17408)])
def test_gpu_gemv_matches_its_reference_at_model_shapes(fmt, rows, n, k):
    g_ = torch.Generator(device="cuda").manual_seed(rows + n + k)
    x = torch.randn(rows, k, device="cuda", generator=g_).bfloat16()
    weight = quant.QUANTIZERS[fmt](torch.randn(n, k, device="cuda", generator=g_) / k ** 0.5)
    fast = quant.QuantLinear(weight, use_triton=True)(x).float()
    want = quant.QuantLinear(weight, use_triton=False)(x).float()
    assert torch.allclose(fast, want, rtol=2e-2, atol=2e-2 * float(want.abs().max())), describe(fast, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", QUANTIZED)
def test_gpu_split_k_gemv_replays_bit_identically_and_resets_its_counters(fmt):
    """Seven K slices of a 5120 x 17408 GEMV summed in the kernel by the last slice to arrive: a CUDA graph of it
    replayed 30 times gives the eager result bit for bit, and the arrival counters end at zero."""
    g_ = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(1, 17408, device="cuda", generator=g_).bfloat16()
    weight = quant.QUANTIZERS[fmt](torch.randn(5120, 17408, device="cuda", generator=g_) / 17408 ** 0.5)
    fused, reference, args = _fused_and_reference(weight)
    config = kq.GemvConfig(64, 512, 4, 1, 7)
    eager = fused(x, config)
    want = reference(x, *args)
    assert torch.allclose(eager.float(), want.float(), rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = fused(x, config)
    for _ in range(30):
        replayed.zero_()
        graph.replay()
        assert torch.equal(replayed, eager)
    assert kq._arrival_tensor(x.device).count_nonzero() == 0


# ---- the config sweep (bench/tune_quant_gemv.py) -------------------------------------------------------------------
def _timing(kind, n, k, rows, config, us, correct=True):
    return {"kind": kind, "N": n, "K": k, "rows": rows, "config": list(config), "us": us, "correct": correct}


def test_the_sweep_selection_picks_the_fastest_correct_config_per_bucket_and_the_fused_threshold():
    a, b, wrong = kq.GemvConfig(32, 256, 4, 3, 1), kq.GemvConfig(64, 128, 8, 3, 2), kq.GemvConfig(16, 512, 4, 1, 1)
    entries = [_timing("nvfp4", 64, 512, 1, a, 5.0), _timing("nvfp4", 64, 512, 1, b, 4.0),
               _timing("nvfp4", 64, 512, 1, wrong, None, correct=False),
               # bucket 32 (rows 24, 32): b is faster at 24, a over both; `wrong` is never chosen
               _timing("nvfp4", 64, 512, 24, a, 6.0), _timing("nvfp4", 64, 512, 24, b, 5.0),
               _timing("nvfp4", 64, 512, 32, a, 6.0), _timing("nvfp4", 64, 512, 32, b, 8.0),
               _timing("nvfp4", 64, 512, 32, wrong, None, correct=False),
               # bucket 16: `wrong` was only timed at 8 (not 16): incomplete, not chosen though fastest
               _timing("nvfp4", 64, 512, 8, a, 9.0), _timing("nvfp4", 64, 512, 16, a, 9.0),
               _timing("nvfp4", 64, 512, 8, b, 1.0)]
    gemm = [{"kind": "nvfp4 dequantise+gemm", "N": 64, "K": 512, "rows": r, "us": us}
            for r, us in ((1, 50.0), (8, 5.0), (16, 10.0), (24, 10.0), (32, 3.0))]
    chosen = tune.select(entries, gemm + [{"kind": "dense", "N": 64, "K": 512, "rows": 1, "us": 1.0}])
    assert chosen["configs"] == {("nvfp4", 64, 512, 1): tuple(b), ("nvfp4", 64, 512, 16): tuple(a),
                                 ("nvfp4", 64, 512, 32): tuple(a)}
    # fused beats dequantise + GEMM at rows 1, 8 (1.0 < 5.0), 16, 24, but not at 32
    assert chosen["fused_max_rows"] == {"nvfp4": 24}


def test_a_decode_only_sweep_replaces_its_keys_and_keeps_the_rest_of_the_entry():
    old, new = (16, 256, 4, 1, 1), (32, 512, 4, 1, 1)
    existing = {"configs": {("nvfp4", 64, 512, 1): old, ("nvfp4", 64, 512, 16): old, ("fp8-block", 64, 512, 1): old},
                "fused_max_rows": {"nvfp4": 8, "fp8-block": 8}}
    chosen = {"configs": {("nvfp4", 64, 512, 1): new, ("fp8", 64, 512, 1): new}, "fused_max_rows": {"nvfp4": 1}}
    merged = tune.merged_entry(existing, chosen, rows=(1,))
    assert merged["configs"] == {("fp8", 64, 512, 1): new, ("fp8-block", 64, 512, 1): old,
                                 ("nvfp4", 64, 512, 1): new, ("nvfp4", 64, 512, 16): old}
    assert merged["fused_max_rows"] == {"nvfp4": 8, "fp8-block": 8}            # one row count compares nothing
    assert tune.merged_entry(existing, chosen, rows=(1, 8))["fused_max_rows"] == {"nvfp4": 1, "fp8-block": 8}
    assert tune.merged_entry({}, chosen, rows=(1,)) == {"configs": dict(sorted(chosen["configs"].items())),
                                                        "fused_max_rows": {}}


@needs_triton
def test_a_candidate_that_does_not_fit_the_device_is_recorded_as_an_error_and_never_chosen():
    def too_big(x, *tensors, config):
        raise triton.runtime.errors.OutOfResources(300000, 232448, "shared memory")
    result = tune._try(too_big, torch.zeros(1, 8), [()], kq.GemvConfig(64, 1024, 8, 3), None, torch.device("cpu"), 1)
    assert result["us"] is None and not result["correct"] and "shared memory" in result["error"]
    entries = [{"kind": "fp8", "N": 8, "K": 8, "rows": 1, "config": [64, 1024, 8, 3], **result},
               _timing("fp8", 8, 8, 1, kq.GemvConfig(16, 128, 4, 1), 3.0)]
    assert tune.select(entries, [])["configs"] == {("fp8", 8, 8, 1): tuple(kq.GemvConfig(16, 128, 4, 1))}


@needs_triton
def test_a_tiny_sweep_writes_a_table_module_that_the_kernels_then_use(tmp_path, monkeypatch):
    picked = [kq.GemvConfig(16, 128, 4, 1), kq.GemvConfig(32, 256, 4, 1)]
    result = tune.sweep([(24, 256)], (1, 8), torch.device("cpu"), torch.float32, repeats=1, budget_s=60,
                        candidates_of=lambda kind, bucket: picked, kinds=("fp8", "nvfp4"))
    assert result["entries"] and all(e["correct"] for e in result["entries"]) and not result["untuned"]
    assert {(e["kind"], e["rows"]) for e in result["entries"]} == {(k, r) for k in ("fp8", "nvfp4") for r in (1, 8)}
    chosen = tune.select(result["entries"], result["baselines"])
    source = tune.table_source({"other GPU": {"configs": {}, "fused_max_rows": {"fp8": 64}}, "cpu": chosen})
    (tmp_path / "table.py").write_text(source)
    spec = importlib.util.spec_from_file_location("written_table", tmp_path / "table.py")
    written = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(written)
    assert written.TABLE["cpu"] == chosen and written.TABLE["other GPU"]["fused_max_rows"] == {"fp8": 64}
    assert written.DEFAULT_FUSED_MAX_ROWS == kq.quant_gemv_configs.DEFAULT_FUSED_MAX_ROWS
    assert set(chosen["configs"]) == {(k, 24, 256, b) for k in ("fp8", "nvfp4") for b in (1, 16)}
    monkeypatch.setattr(kq.quant_gemv_configs, "TABLE", written.TABLE)
    for (kind, n, k, bucket), config in chosen["configs"].items():
        assert kq.gemv_config(kind, n, k, bucket, torch.device("cpu")) == kq.GemvConfig(*config)
        assert config[:2] in {tuple(c[:2]) for c in picked}


@pytest.mark.parametrize("use_triton", [False, pytest.param(True, marks=needs_triton)])
@pytest.mark.parametrize("fmt", ["fp8", "fp8-block", "nvfp4"])
def test_a_quantized_head_read_for_its_leading_rows_gives_those_outputs_exactly(fmt, use_triton):
    """``out_features`` (the MTP drafts' vocabulary prefix) reads only the first rows: those columns of the whole
    product, whatever the format's per-row or per-block scales (the fused kernel's launch configuration depends on
    N, so its sums may be ordered differently: within its tolerance; drafts need no exactness)."""
    g_ = gen(7)
    layer = quant.QuantLinear(random_weight(fmt, 256, 128, g_), use_triton=use_triton)
    x = torch.randn(3, 128, generator=g_)
    whole, leading = layer(x), layer(x, out_features=96)
    assert leading.shape == (3, 96)
    if use_triton:
        tol = gemv_tolerance(fmt, x.dtype, 3)
        assert torch.allclose(leading, whole[:, :96], rtol=tol, atol=tol * float(whole.abs().max())), describe(
            leading, whole[:, :96])
    else:
        assert torch.equal(leading, whole[:, :96])


@pytest.mark.parametrize("tied", [True, False])
def test_the_gemv_tables_shapes_list_the_lm_head_once_whether_tied_or_not(tied):
    """bench-quant's GEMV table and the sweeps time each distinct projection shape once, the LM head last: an
    untied head is also an ``nn.Linear`` of the model and was timed twice."""
    import dataclasses

    from flashrt_ros.runtime.config import PRESETS
    from flashrt_ros.runtime.model import Qwen35
    with torch.device("meta"):
        model = Qwen35(dataclasses.replace(PRESETS["qwen3.6-27b"], tie_word_embeddings=tied))
    model.fuse_projections()
    shapes = bench_quant.projection_shapes(model)
    assert [(n, k) for _, n, k in shapes].count((248320, 5120)) == 1 and shapes[-1][0] == quant.LM_HEAD
    assert len({(n, k) for _, n, k in shapes}) == len(shapes)
