"""The dense skinny GEMM (kernels/dense_gemv.py) against its reference: every row count it serves, ragged N and K,
each fusion (RMSNorm prologue, silu_mul prologue, residual epilogue), split K, its determinism and row independence,
its refusals, and the dense entries of the tuner and the config table.

Without CUDA it runs through Triton's interpreter on CPU tensors (test/conftest.py sets TRITON_INTERPRET=1) at small
shapes; outputs the wrapper allocates are poisoned with NaN, so an element it fails to write fails the comparison.
"""
from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

import bench_scripts
from flashrt_ros.runtime.kernels import dense_gemv as dg
from flashrt_ros.runtime.kernels import quant_gemv as kq
from flashrt_ros.runtime.kernels._layout import LayoutError
from flashrt_ros.runtime.kernels._triton import triton
from flashrt_ros.tools import bench_quant
from kernel_checks import assert_same_bytes, describe

tune = bench_scripts.load("tune_quant_gemv")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(triton is None, reason="triton is not importable")

# max |got - want| / max |want|: one rounding step of the model dtype at the output's largest magnitude (the kernel
# rounds where the reference rounds; only the fp32 summation order differs, and it can move a rounded value by one
# step); fp32 by summation order alone.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}
FUSIONS = ("plain", "norm", "gated", "residual", "norm+residual")
EPS = 1e-6


def gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def inputs(fusion: str, rows: int, n: int, k: int, dtype: torch.dtype, g_: torch.Generator):
    """(x, weight, keyword arguments) of one call with ``fusion``."""
    x = torch.randn(rows, 2 * k if fusion == "gated" else k, generator=g_).to(dtype)
    weight = (torch.randn(n, k, generator=g_) / k ** 0.5).to(dtype)
    kwargs = {}
    if "norm" in fusion:
        kwargs.update(norm=1.0 + 0.1 * torch.randn(k, generator=g_), eps=EPS)
    if fusion == "gated":
        kwargs["gated"] = True
    if "residual" in fusion:
        kwargs["residual"] = torch.randn(rows, n, generator=g_).to(dtype)
    return x.to(DEVICE), weight.to(DEVICE), {k_: v.to(DEVICE) if torch.is_tensor(v) else v for k_, v in kwargs.items()}


def assert_matches_reference(fusion, rows, n, k, dtype, config=None, seed=0) -> torch.Tensor:
    return check(*inputs(fusion, rows, n, k, dtype, gen(fusion, rows, n, k, dtype, seed)), config)


def check(x, weight, kwargs, config=None) -> torch.Tensor:
    """The kernel's output, after checking it against the reference's."""
    got, want = dg.dense_linear_triton(x, weight, config=config, **kwargs), dg.dense_linear(x, weight, **kwargs)
    assert got.shape == (x.shape[0], weight.shape[0]) and got.dtype == x.dtype and torch.isfinite(got).all(), (
        describe(got, want))
    error = float((got.double() - want.double()).abs().max() / want.double().abs().max())
    assert error <= TOLERANCE[x.dtype], (tuple(weight.shape), list(kwargs), config, describe(got, want))
    return got


@pytest.fixture(autouse=True)
def _poisoned(poisoned_empty):
    yield


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fusion", FUSIONS)
def test_every_row_count_and_fusion_matches_the_reference(fusion, dtype):
    """Rows 1..MAX_ROWS at a ragged N and a K that leaves a partial last tile, in one K slice (even rows) and in
    three (odd rows)."""
    for rows in range(1, dg.MAX_ROWS + 1):
        config = kq.GemvConfig(16, 32, 4, 1, 3) if rows % 2 else kq.GemvConfig(16, 64, 4, 1, 1)
        assert_matches_reference(fusion, rows, 37, 80, dtype, config)


@pytest.mark.parametrize("n,k", [(1, 16), (33, 1), (65, 200), (24, 1024)])
@pytest.mark.parametrize("fusion", FUSIONS)
def test_odd_shapes_and_the_default_config_match_the_reference(fusion, n, k):
    assert_matches_reference(fusion, 3, n, k, torch.bfloat16)


def test_float16_matches_the_reference():
    for fusion in FUSIONS:
        assert_matches_reference(fusion, 2, 40, 96, torch.float16)


def test_the_reference_is_the_composition_the_model_makes_of_the_reference_kernels():
    """rms_norm then the projection; silu_mul then the projection; the projection then add_rms_norm's residual
    sum: byte for byte."""
    from flashrt_ros.runtime.kernels.activations import silu_mul
    from flashrt_ros.runtime.kernels.norms import add_rms_norm, rms_norm
    x, weight, kwargs = inputs("norm+residual", 4, 48, 64, torch.bfloat16, gen("composition"))
    norm, residual = kwargs["norm"], kwargs["residual"]
    assert_same_bytes("norm", dg.dense_linear(x, weight, norm=norm, eps=EPS), F.linear(rms_norm(x, norm, EPS), weight))
    _, summed = add_rms_norm(F.linear(x, weight), residual, torch.ones(48).to(DEVICE), EPS)
    assert_same_bytes("residual", dg.dense_linear(x, weight, residual=residual), summed)
    gate_up = torch.randn(4, 128, generator=gen("gate_up")).bfloat16().to(DEVICE)
    assert_same_bytes("gated", dg.dense_linear(gate_up, weight, gated=True), F.linear(silu_mul(gate_up), weight))


@pytest.mark.parametrize("fusion", ["plain", "norm+residual", "gated"])
def test_same_inputs_same_bytes_and_a_row_does_not_depend_on_the_others_or_their_count(fusion):
    """One configuration for every row count (one rows bucket), rows padded to DENSE_ROWS: row r of an L-row call is
    bit-identical to a one-row call of that row, as a verify step's row is to a decode step's; repeats are too, and
    split K leaves every arrival counter at zero."""
    x, weight, kwargs = inputs(fusion, dg.MAX_ROWS, 40, 96, torch.bfloat16, gen("rows", fusion))
    for config in (None, kq.GemvConfig(16, 32, 4, 1, 3)):
        full = dg.dense_linear_triton(x, weight, config=config, **kwargs)
        assert_same_bytes("repeat", dg.dense_linear_triton(x, weight, config=config, **kwargs), full)
        for row in (0, 3, dg.MAX_ROWS - 1):
            one = {k_: v[row:row + 1] if k_ == "residual" else v for k_, v in kwargs.items()}
            assert_same_bytes(f"row {row} alone", dg.dense_linear_triton(x[row:row + 1], weight, config=config, **one),
                              full[row:row + 1])
        other = x.clone()
        other[1:] = torch.randn(other[1:].shape, generator=gen("other")).to(other.dtype)
        assert_same_bytes("row 0 among others", dg.dense_linear_triton(other, weight, config=config, **kwargs)[0],
                          full[0])
        assert kq._arrival_tensor(x.device).count_nonzero() == 0


def test_the_config_comes_from_the_tables_dense_entry_for_every_row_count(monkeypatch):
    tabled = kq.GemvConfig(64, 256, 8, 3, 2)
    monkeypatch.setattr(kq.quant_gemv_configs, "TABLE", {"cpu": {"configs": {("dense", 40, 512, kq.DENSE_ROWS):
                                                                             tuple(tabled)}}})
    cpu = torch.device("cpu")
    assert {kq.gemv_config(kq.DENSE, 40, 512, rows, cpu) for rows in range(1, kq.DENSE_ROWS + 1)} == {tabled}
    assert kq.gemv_config(kq.DENSE, 48, 512, 1, cpu) == kq.default_config(kq.DENSE, 48, 512, kq.DENSE_ROWS)
    assert kq.gemv_config("nvfp4", 40, 512, 1, cpu) == kq.default_config("nvfp4", 40, 512, 1)


def test_every_swept_dense_config_is_correct():
    """Each candidate the tuner may write into the table (warps and stages dropped: the interpreter ignores them),
    with one K slice and two, on a ragged N and a K with a partial last tile."""
    configs = {c._replace(num_warps=4, num_stages=1, splits=s) for c in tune.candidates(kq.DENSE, kq.DENSE_ROWS)
               for s in (1, 2)}
    configs |= {kq.GemvConfig(*c)._replace(num_warps=4, num_stages=1) for table in kq.quant_gemv_configs.TABLE.values()
                for key, c in table["configs"].items() if key[0] == kq.DENSE}
    assert len(configs) >= 10
    for config in sorted(configs):
        assert_matches_reference("norm+residual", 5, 72, 320, torch.bfloat16, config)


def test_refusals_name_what_is_wrong():
    x, weight = torch.randn(2, 64).to(DEVICE), torch.randn(16, 64).to(DEVICE)
    cases = [(lambda: dg.dense_linear_triton(torch.randn(kq.DENSE_ROWS + 1, 64).to(DEVICE), weight), "1..16 rows"),
             (lambda: dg.dense_linear_triton(x, weight.bfloat16()), "weight must be torch.float32"),
             (lambda: dg.dense_linear_triton(x, weight, gated=True), "gated: twice as many"),
             (lambda: dg.dense_linear_triton(torch.randn(2, 128).to(DEVICE), weight, norm=torch.ones(64).to(DEVICE),
                                             gated=True), "not normed"),
             (lambda: dg.dense_linear_triton(x, weight, norm=torch.ones(32).to(DEVICE)), "norm has 32 features"),
             (lambda: dg.dense_linear_triton(x, weight, residual=torch.zeros(2, 8).to(DEVICE)), "residual must be")]
    for call, message in cases:
        with pytest.raises(LayoutError, match=message):
            call()


def test_a_dense_sweep_times_correct_candidates_and_selects_one_config_for_all_its_rows():
    picked = [kq.GemvConfig(16, 64, 4, 1), kq.GemvConfig(32, 32, 4, 1)]
    result = tune.sweep([(24, 96)], (1, 2, 3), torch.device("cpu"), torch.float32, repeats=1, budget_s=60,
                        candidates_of=lambda kind, bucket: picked, kinds=(kq.DENSE,))
    assert result["entries"] and all(e["correct"] for e in result["entries"]) and not result["untuned"]
    assert {e["rows"] for e in result["entries"]} == {1, 2, 3}
    assert not [b for b in result["baselines"] if b["kind"] != "dense"]     # cuBLAS is dense's baseline
    chosen = tune.select(result["entries"], result["baselines"])
    assert list(chosen["configs"]) == [(kq.DENSE, 24, 96, kq.DENSE_ROWS)] and kq.DENSE not in chosen["fused_max_rows"]
    assert chosen["configs"][kq.DENSE, 24, 96, kq.DENSE_ROWS][:2] in {tuple(c[:2]) for c in picked}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fusion", FUSIONS)
def test_gpu_dense_gemv_matches_its_reference_at_the_08b_shapes_and_replays_bit_identically(fusion):
    """Every projection shape of qwen3.5-0.8b (its table's or the default config; the LM head plain only), rows 1
    and 5, bf16: within one bf16 step of the reference; captured in a CUDA graph, the replay writes the eager
    call's bytes and leaves every split-K counter at zero."""
    for n, k in bench_quant.preset_projection_shapes("qwen3.5-0.8b"):
        if fusion != "plain" and n >= 100_000:
            continue                                        # the LM head is plain
        for rows in (1, 5):
            x, weight, kwargs = inputs(fusion, rows, n, k, torch.bfloat16, gen(fusion, rows, n, k))
            eager = check(x, weight, kwargs)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = dg.dense_linear_triton(x, weight, **kwargs)
            graph.replay()
            torch.cuda.synchronize()
            assert_same_bytes(f"replay {n}x{k} rows {rows}", captured, eager)
            assert kq._arrival_tensor(x.device).count_nonzero() == 0


@pytest.mark.parametrize("fusion", bench_scripts.load("gemv_fusions").FUSIONS)
def test_the_fusion_diagnostic_times_the_same_product_both_ways(fusion):
    """bench/gemv_fusions.py compares each fused call with the cuBLAS path's launches for the same result."""
    fusions, g_ = bench_scripts.load("gemv_fusions"), gen("diagnostic", fusion)
    n, k = 40, 96
    w = torch.randn(n, k, generator=g_).to(DEVICE)
    x, gate_up, residual = (torch.randn(1, width, generator=g_).to(DEVICE) for width in (k, 2 * k, n))
    scale = 1.0 + 0.1 * torch.randn(k, generator=g_).to(DEVICE)
    fused, unfused = fusions.fused_and_unfused(fusion, x, gate_up, scale, residual)
    got, want = fused(w), unfused(w)
    assert got.shape == want.shape == (1, n)
    assert (got - want).abs().max() <= TOLERANCE[torch.float32] * want.abs().max(), describe(got, want)
