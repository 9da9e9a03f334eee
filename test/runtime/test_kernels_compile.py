"""Every Triton kernel of the runtime compiles for a CUDA target (sm_90) at the launches the engine makes, here on
the CPU: bench/compile_kernels.py runs Triton's compiler (frontend and ptxas) without a device. It runs in a
subprocess because this test process imports the kernels for Triton's interpreter (conftest sets TRITON_INTERPRET=1),
and at the tiny preset's launches only (the GPU command in BENCHMARKS/the report covers every preset and dtype).

This is the check that would have caught triton 3.6's "CompilationError at 49:18" in the fp8 GEMV before a GPU run."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "compile_kernels.py"
CUDA_BACKEND = importlib.util.find_spec("triton") is not None and \
    importlib.util.find_spec("triton.backends.nvidia") is not None


@pytest.mark.skipif(not CUDA_BACKEND, reason="needs triton with its CUDA backend (no GPU needed)")
@pytest.mark.timeout(300)
def test_every_kernel_compiles_to_a_cubin_for_sm90_at_the_engines_launches(tmp_path):
    out = tmp_path / "compile.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--presets", "tiny", "--dtypes", "bfloat16",
                           "--max-context", "256", "--pieces", "8,40", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=280, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads(out.read_text())
    compiled = {r["kernel"] for r in report["results"]}
    assert report["unlaunched"] == [] and compiled == set(report["kernels"]), report["kernels"]
    assert len(report["kernels"]) >= 14      # norms 2, silu, conv 2, delta rule, attention 2, rope, GEMVs 2, dequant,
    assert {"_dense_gemv_kernel", "_block_argmax_kernel", "_row_argmax_kernel"} <= compiled    # the pick 2
    dense = [r["constexprs"] for r in report["results"] if r["kernel"] == "_dense_gemv_kernel"]
    assert all(any(f"{fusion}=True" in c for c in dense) for fusion in ("NORM", "GATED", "RESIDUAL")), dense
    assert all(r["status"] == "cubin" and r["arch"] == "sm_90" for r in report["results"])
    gemv = [r for r in report["results"] if r["kernel"] == "_quant_gemv_kernel"]
    assert {"ONE_ROW=True" in r["constexprs"] for r in gemv} == {True, False}     # decode and the tl.dot path


SASS_SCRIPT = SCRIPT.parent / "gemv_sass.py"


@pytest.mark.skipif(not CUDA_BACKEND, reason="needs triton with its CUDA backend (no GPU needed)")
@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind,opcode_ranges,bound", [
    ("nvfp4", {"HFMA2": (64, 64), "FFMA": (0, 8)}, 4.5),   # 128 weights: a product pair per HFMA2, an FFMA per group
    ("fp8", {"FSEL": (0, 0)}, 5.0)])
def test_the_decode_gemv_loop_stays_lean_in_sm90_sass(tmp_path, kind, opcode_ranges, bound):
    """The decode loop's SASS (bench/gemv_sass.py): nvfp4 multiplies fp16 pairs (one HFMA2 per two weights, fp32
    only once per 16-value group), fp8 loads bytes with zeroed masked lanes (no FSEL per weight), and both stay
    under the instructions per weight the rewrites reached, with margin (one code at a time, the nvfp4 loop issued
    9.6, then 5.1 with fp32 products; the fp8 loop 5.1)."""
    out = tmp_path / "sass.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(SASS_SCRIPT), kind, "4096", "5120", "--config", "32,512,4,1,1",
                           "--json", str(out)], env=env, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["weights_per_thread"] == 128 and report["opcodes"].get("LDG", 0) > 0
    assert report["local_memory_accesses"] == 0 and report["registers"] > 0, report
    for opcode, (low, high) in opcode_ranges.items():
        assert low <= report["opcodes"].get(opcode, 0) <= high, (opcode, report["opcodes"])
    assert 2.0 < report["per_weight"] < bound, report


@pytest.mark.skipif(not CUDA_BACKEND, reason="needs triton with its CUDA backend (no GPU needed)")
@pytest.mark.timeout(300)
def test_the_dense_gemvs_fusions_form_only_the_decode_rows_in_sm90_sass(tmp_path):
    """The dense GEMV forms a normed or gated input for the rows that can be real only (one in decode), not for the
    16 rows the tensor cores take: its fused loops stay within 2x the plain loop's instructions. Formed on all 16
    rows, the gated loop issued 1761 instructions a step against the plain loop's 64 (the down projection's shape
    and configuration on the H100), and the normed one 247 against 92. A normed input's row statistics load all of
    K before the first barrier (one round trip, not one per K block: 3584 / 128 = 28 loads of one bf16 each)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    per_weight = {}
    for fusion in ("plain", "norm", "gated"):
        out = tmp_path / f"{fusion}.json"
        done = subprocess.run([sys.executable, str(SASS_SCRIPT), "dense", "1024", "3584", "--fusion", fusion,
                               "--config", "16,128,4,5,4", "--json", str(out)],
                              env=env, capture_output=True, text=True, timeout=90, check=False)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        report = json.loads(out.read_text())
        assert report["local_memory_accesses"] == 0 and report["opcodes"].get("HMMA", 0) > 0, report
        per_weight[fusion] = report["per_weight"]
        if fusion == "norm":
            assert report["loads_before_first_barrier"] >= 3584 // 128, report
    assert per_weight["norm"] < 2 * per_weight["plain"] and per_weight["gated"] < 2 * per_weight["plain"], per_weight


@pytest.mark.skipif(not CUDA_BACKEND, reason="needs triton with its CUDA backend (no GPU needed)")
@pytest.mark.timeout(200)
def test_a_pieces_delta_rule_loop_has_no_gate_math_in_sm90_sass(tmp_path):
    """bench/delta_rule_sass.py: a piece's own launch computes its rows' gates, norms and q.k ahead of the serial
    loop, so the loop has no MUFU (exp, log, rsqrt, reciprocal) and no more exchanges through shared memory than
    before; the launch of before (two sums, the factors in the loop) has 7 MUFU in a longer loop. (0.8B shape, 24
    rows: 393 instructions against 295 with triton 3.9, 385 against 287 with 3.6.)"""
    out = tmp_path / "sass.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(SCRIPT.parent / "delta_rule_sass.py"), "qwen3.5-0.8b",
                           "--config", "4,1,0,0", "--config", "4,1,1,1", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    before, own = json.loads(out.read_text())["results"]
    assert own["config"] == [4, 1, True, True] and own["local_memory_accesses"] == 0
    assert before["serial_loop"]["mufu"] >= 5, before
    assert own["serial_loop"]["mufu"] == 0 and own["serial_loop"]["exchanges"] <= before["serial_loop"]["exchanges"]
    assert own["serial_loop"]["instructions"] < 0.85 * before["serial_loop"]["instructions"], (before, own)
    assert own["factors_loop"]["mufu"] > 0 and before["factors_loop"] is None
    # with the device count the engine passes, the loop's reduction trees stay interleaved (the padding rows' zero
    # stores after the loop had ptxas issue them one tree after another: 2 of 40 SHFLs adjacent with triton 3.9,
    # 0 with 3.6, against 26 and 29 now)
    assert own["serial_loop"]["shfl_adjacent"] >= own["serial_loop"]["shfl"] // 2, own
