"""Compile every Triton kernel of the runtime for a CUDA target, without a GPU, at the launches the engine makes.

    python bench/compile_kernels.py [--arch 90 --arch 110] [--presets tiny,qwen3.5-0.8b,qwen3.6-27b]
                                    [--dtypes bfloat16,float32] [--max-context 16384] [--json out.json]

Triton's frontend (AST -> TTIR -> TTGIR -> LLVM -> PTX) runs without a device, and so does ptxas (PTX -> cubin), so
a kernel that a Triton version cannot build shows up here, on any machine (e.g. triton 3.6's "CompilationError at
49:18" in the fp8 GEMV, or its bundled ptxas refusing Thor's sm_110a).

How the launches are found: the kernel modules are imported as compiled (JIT) kernels, each kernel's launch is
replaced by a recorder, and then the engine's own code runs on CPU tensors: the model's forward pass with the fused
kernel set for decode and a speculative verify of STEP_ROWS rows (every KV bucket), every small-piece bucket (with a
device count) and one long piece, and the quantized GEMVs and the dequantise kernel at every projection shape of the
preset (fp8 with per-channel and 128-wide block scales, nvfp4; decode, and 8 / 24 / 40 / 256 rows: each row block the
GEMV has). The recorded arguments go through Triton's own binder for the CUDA backend, so the signature, the
constexprs and the specialisations (divisibility by 16, values of 1) are those a GPU launch would compile. Weights
are never computed: the model's linear layers are shape-only stand-ins and the quantized weights are uninitialised,
so a 27B layout costs little memory. The presets' layouts are kept (hidden size, heads, head dims, intermediate and
vocabulary sizes); only the layer count is cut to one Gated DeltaNet and one attention layer (plus the MTP head),
which run the same launches as all of them. A kernel of the package that no launch reaches is an error too (a new
kernel must be added here).

Each distinct compile is reported as ``cubin`` (all stages), ``ptx only`` (the frontend built PTX, ptxas refused it:
the message says why) or ``FAILED`` (the frontend itself failed). Exit status 1 when anything is not ``cubin`` or a
kernel was never launched.
Triton's cache is a fresh temporary directory, so nothing is taken from an earlier run.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("compile_kernels: unset TRITON_INTERPRET (the kernels must be imported as compiled kernels)")
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="flashrt-triton-cache-")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from torch import nn  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from flashrt_ros.runtime import kernels as kernel_sets  # noqa: E402
from flashrt_ros.runtime.arena import Arena, buffer_specs  # noqa: E402
from flashrt_ros.runtime.config import PRESETS  # noqa: E402
from flashrt_ros.runtime.engine import _MIN_KV_BUCKET, EngineConfig  # noqa: E402
from flashrt_ros.runtime.kernels import (activations, attention, conv, delta_rule, dense_gemv, norms,  # noqa: E402
                                         pick, quant_gemv, rope)
from flashrt_ros.runtime.model import PIECE_BUCKET, SMALL_PIECE, Qwen35, StepRows  # noqa: E402
from flashrt_ros.runtime.speculative import STEP_ROWS, RowStates  # noqa: E402
from flashrt_ros.tools import provenance  # noqa: E402
from flashrt_ros.tools.bench_quant import preset_projection_shapes  # noqa: E402

KERNEL_MODULES = (activations, attention, conv, delta_rule, dense_gemv, norms, pick, quant_gemv, rope)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
GEMV_ROWS = (1, 8, 24, 40, quant_gemv.GEMV_MAX_ROWS)     # BLOCK_L 1, 16, 32, 64 (and several row blocks)
FP8_BLOCK = 128                                            # compressed-tensors' block-scaled FP8 checkpoints
PIECES = list(range(PIECE_BUCKET, SMALL_PIECE + 1, PIECE_BUCKET))   # the engine's small-piece buckets
QUANT_KERNELS = ("_dequant_kernel", "_quant_gemv_kernel")
LONG_PIECE = 2 * SMALL_PIECE                               # an eager piece: the tiled conv and its state launch


@dataclasses.dataclass
class Launch:
    kernel: JITFunction
    args: tuple
    kwargs: dict
    origin: str


class _Recorder:
    """Replaces every kernel's launch by a record of its arguments (nothing runs)."""

    def __init__(self):
        self.launches: list[Launch] = []
        self.origin = ""
        self.kernels = [value for module in KERNEL_MODULES for value in vars(module).values()
                        if isinstance(value, JITFunction) and value.__module__ == module.__name__
                        and value.__name__.endswith("_kernel")]

    @contextmanager
    def recording(self):
        """Kernel wrappers accept CPU tensors only where TRITON_INTERPRET=1 (read at call time); set it only here.
        The kernels themselves were built as compiled kernels at import (Triton decides that at decoration)."""
        def recorder(kernel):
            def run(*args, grid, warmup, **kwargs):
                self.launches.append(Launch(kernel, args, kwargs, self.origin))
            return run
        for kernel in self.kernels:
            kernel.run = recorder(kernel)
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            yield
        finally:
            del os.environ["TRITON_INTERPRET"]
            for kernel in self.kernels:
                del kernel.run


class _ShapeOnly(nn.Module):
    """A bias-free linear layer that only has a shape: its output is uninitialised (no kernel reads its values)."""

    def __init__(self, out_features: int):
        super().__init__()
        self.out_features = out_features

    def forward(self, x):
        return torch.empty(*x.shape[:-1], self.out_features, dtype=x.dtype)


def _layout_model(preset: str, dtype: torch.dtype, max_context: int) -> Qwen35:
    """The preset's layout with one layer of each kind (and the MTP head), weights uninitialised, fused projections,
    linear layers shape-only, bound to an arena and the fused kernel set."""
    cfg = dataclasses.replace(PRESETS[preset], layer_types=("linear_attention", "full_attention"))
    with torch.device("meta"):
        model = Qwen35(cfg)
    model.fuse_projections()
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, _ShapeOnly(module.out_features))
    model = model.to_empty(device="cpu").to(dtype)
    model.bind(Arena(buffer_specs(cfg, max_context, dtype), torch.device("cpu")), kernel_sets.TRITON)
    return model


def kv_buckets(max_context: int) -> list[int]:
    """The engine's KV buckets (Engine._kv_bucket_sizes) for ``max_context``."""
    sizes, size = [], _MIN_KV_BUCKET
    while size < max_context:
        sizes.append(size)
        size *= 2
    return sizes + [max_context]


def record_model(recorder: _Recorder, preset: str, dtype: torch.dtype, max_context: int, pieces: list[int]) -> None:
    model = _layout_model(preset, dtype, max_context)
    tokens = torch.zeros(LONG_PIECE, dtype=torch.int64)
    count = torch.ones((), dtype=torch.int64)
    with torch.no_grad():
        verify = StepRows(live=STEP_ROWS, states=RowStates(model.arena, STEP_ROWS),
                          hidden=torch.zeros(STEP_ROWS, model.cfg.hidden_size, dtype=dtype))
        for kv_len in kv_buckets(max_context):
            recorder.origin = f"{preset}/{dtype} decode kv {kv_len}"
            model.forward(tokens[:1], kv_len)
            recorder.origin = f"{preset}/{dtype} speculative verify kv {kv_len}"
            model.forward(tokens[:STEP_ROWS], kv_len, count=count, step=verify)
            for bucket in pieces:
                recorder.origin = f"{preset}/{dtype} piece {bucket} kv {kv_len}"
                model.forward(tokens[:bucket], kv_len, count=count)
        recorder.origin = f"{preset}/{dtype} long piece {LONG_PIECE}"
        model.forward(tokens, LONG_PIECE, dense=True)


def record_quant(recorder: _Recorder, preset: str, dtype: torch.dtype) -> None:
    for n, k in preset_projection_shapes(preset):
        fp8 = torch.empty(n, k, dtype=torch.float8_e4m3fn)
        nvfp4 = (torch.empty(n, k // 2, dtype=torch.uint8),
                 torch.empty(n, k // quant_gemv.NVFP4_GROUP, dtype=torch.float8_e4m3fn), torch.ones(n))
        weights = {"fp8": (quant_gemv.fp8_linear_triton, (fp8, torch.ones(n, 1))),          # per channel (at load)
                   "nvfp4": (quant_gemv.nvfp4_linear_triton, nvfp4)}
        if k % FP8_BLOCK == 0:
            weights["fp8-block"] = (quant_gemv.fp8_linear_triton, (fp8, torch.ones(n, k // FP8_BLOCK)))
        for fmt, (fused, tensors) in weights.items():
            for rows in GEMV_ROWS:
                recorder.origin = f"{preset}/{dtype} {fmt} GEMV {rows}x{k} -> {n}"
                fused(torch.empty(rows, k, dtype=dtype), *tensors)
            recorder.origin = f"{preset}/{dtype} {fmt} dequantise {n}x{k}"
            quant_gemv.dequantize_triton(tensors[0], tensors[1], tensors[2] if fmt == "nvfp4" else None, dtype)


def record_step(recorder: _Recorder, preset: str, dtype: torch.dtype) -> None:
    """What a decode or verify step launches besides the forward: the greedy pick over the vocabulary (one row, a
    verify's rows), and (``dense_gemv: triton``) the dense GEMV of every projection shape with each of its fusions."""
    vocab = PRESETS[preset].vocab_size
    for rows in (1, STEP_ROWS):
        recorder.origin = f"{preset}/{dtype} greedy pick {rows}x{vocab}"
        pick.greedy_pick_triton(torch.empty(rows, vocab), torch.empty(rows, -(-vocab // 32), dtype=torch.int32), ())
    for n, k in preset_projection_shapes(preset):
        weight = torch.empty(n, k, dtype=dtype)
        for rows in (1, dense_gemv.MAX_ROWS):
            x, gate_up = torch.empty(rows, k, dtype=dtype), torch.empty(rows, 2 * k, dtype=dtype)
            for fusion, call in (
                    ("plain", lambda: dense_gemv.dense_linear_triton(x, weight)),
                    ("norm", lambda: dense_gemv.dense_linear_triton(x, weight, torch.empty(k), 1e-6)),
                    ("gated", lambda: dense_gemv.dense_linear_triton(gate_up, weight, gated=True)),
                    ("residual", lambda: dense_gemv.dense_linear_triton(
                        x, weight, residual=torch.empty(rows, n, dtype=dtype)))):
                recorder.origin = f"{preset}/{dtype} dense GEMV {rows}x{k} -> {n}, {fusion}"
                call()


def _compile_key(launch: Launch, backend) -> tuple:
    """Triton's own binding of the recorded launch for ``backend``: the ASTSource inputs and the options."""
    kernel, kwargs = launch.kernel, dict(launch.kwargs, debug=False)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return signature, constexprs, attrs, options


def _describe(kernel: JITFunction, constexprs: dict) -> str:
    names = kernel.arg_names
    return ", ".join(f"{names[path[0]]}={value}" for path, value in sorted(constexprs.items()))


def _gist(error: str) -> str:
    """The line of a compiler error that says what went wrong (ptxas' "fatal", the frontend's ValueError, ...)."""
    lines = [line.strip() for line in error.splitlines() if line.strip() and not set(line.strip()) <= set("=^ ")]
    telling = [line for line in lines if any(w in line for w in ("fatal", "Error(", "error:", "Error: "))]
    return (telling or lines or [""])[-1 if telling else 0]


def compile_all(launches: list[Launch], arch: int) -> list[dict]:
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    seen, results = {}, []
    for launch in launches:
        signature, constexprs, attrs, options = _compile_key(launch, backend)
        key = (launch.kernel.__name__, json.dumps(signature, sort_keys=True), repr(sorted(constexprs.items())),
               repr(sorted(attrs.items())), repr(sorted(options.__dict__.items())))
        if key in seen:
            seen[key]["launches"] += 1
            continue
        started = time.perf_counter()
        try:
            compiled = triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs), target=target,
                                      options=options.__dict__)
            status, error = ("cubin" if "cubin" in compiled.asm else "ptx only"), ""
        except Exception as err:  # noqa: BLE001 - every failure is reported, none stops the run
            text = str(err).strip()
            status = "ptx only" if type(err).__name__ == "PTXASError" else "FAILED"
            error = f"{type(err).__name__}: {text}"
        result = {"kernel": launch.kernel.__name__, "arch": f"sm_{arch}", "status": status,
                  "constexprs": _describe(launch.kernel, constexprs), "first_launch": launch.origin,
                  "launches": 1, "seconds": round(time.perf_counter() - started, 2), "error": error}
        seen[key] = result
        results.append(result)
        mark = "ok  " if status == "cubin" else "FAIL"
        print(f"{mark} sm_{arch} {status:8s} {result['kernel']} [{result['constexprs']}] ({launch.origin})"
              + (f"\n     {_gist(error)}" if status != "cubin" else ""), flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, action="append", help="compute capability x10 (default: 90)")
    parser.add_argument("--presets", default="tiny,qwen3.5-0.8b,qwen3.6-27b")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--max-context", type=int, default=EngineConfig().max_context,
                        help="the engine's max_context: its KV buckets set the attention kernels' split sizes")
    parser.add_argument("--pieces", default=",".join(map(str, PIECES)),
                        help="small-piece buckets to run (default: every bucket the engine captures)")
    parser.add_argument("--no-quant", action="store_true", help="skip the quantized GEMV and dequantise kernels")
    parser.add_argument("--json", type=Path, help="write every result here")
    args = parser.parse_args(argv)
    recorder = _Recorder()
    with recorder.recording():
        for preset in args.presets.split(","):
            for dtype in (DTYPES[d] for d in args.dtypes.split(",")):
                record_model(recorder, preset, dtype, args.max_context, [int(p) for p in args.pieces.split(",")])
                record_step(recorder, preset, dtype)
                if not args.no_quant:
                    record_quant(recorder, preset, dtype)
    print(f"triton {triton.__version__}, torch {torch.__version__}: {len(recorder.launches)} launches recorded",
          flush=True)
    results = [r for arch in (args.arch or [90]) for r in compile_all(recorder.launches, arch)]
    failed = [r for r in results if r["status"] != "cubin"]
    kernels = sorted(k.__name__ for k in recorder.kernels)
    unlaunched = sorted(set(kernels) - {launch.kernel.__name__ for launch in recorder.launches})
    if args.no_quant:
        unlaunched = [k for k in unlaunched if k not in QUANT_KERNELS]
    print(f"{len(results)} distinct compiles of {len(kernels) - len(unlaunched)} of the {len(kernels)} kernels: "
          f"{len(results) - len(failed)} cubin, {sum(r['status'] == 'ptx only' for r in failed)} ptx only, "
          f"{sum(r['status'] == 'FAILED' for r in failed)} failed"
          + (f"; never launched: {', '.join(unlaunched)}" if unlaunched else ""))
    if args.json:
        provenance.write_result(args.json, {"triton": triton.__version__, "torch": torch.__version__,
                                            "kernels": kernels, "unlaunched": unlaunched, "results": results}, "cpu")
    return 1 if failed or unlaunched else 0


if __name__ == "__main__":
    sys.exit(main())
