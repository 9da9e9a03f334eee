"""SASS instructions per weight in the fused GEMVs' main loop, compiled for a CUDA target on any machine.

    python bench/gemv_sass.py nvfp4 34816 5120 [--rows 1] [--config 32,512,4,1,1] [--arch 90] [--dump out.sass]
                              [--json out.json]
    python bench/gemv_sass.py dense 1024 3584 --fusion gated ...     (the dense GEMV, plain or with one fusion)

Decode GEMVs are bound by instruction issue (an SM issues 128 thread-instructions per clock), so the loop's
instruction count per weight bounds the bytes per second a tile configuration can reach; this counts it without a
GPU: the launch is recorded as ``compile_kernels.py`` records it, compiled by Triton for ``--arch`` and disassembled
with Triton's bundled ``nvdisasm``. The loop is the longest backward branch's body; weights per thread and
iteration are block_n * block_k / (32 * warps).
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compile_kernels as ck  # noqa: E402  (sets a fresh Triton cache and the repository path)
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402

from flashrt_ros.runtime.kernels import dense_gemv  # noqa: E402
from flashrt_ros.runtime.kernels import quant_gemv as kq  # noqa: E402
from flashrt_ros.tools import provenance  # noqa: E402

_ADDRESS = re.compile(r"/\*([0-9a-f]{4,})\*/")


FUSIONS = ("plain", "norm", "gated", "residual")     # the dense GEMV's: its input normed or gated, a residual added


def record(kind: str, n: int, k: int, rows: int, config: kq.GemvConfig | None, fusion: str = "plain") -> ck.Launch:
    """The GEMV launch the kernels make for this shape, recorded on CPU tensors (nothing runs)."""
    recorder = ck._Recorder()
    x = torch.empty(rows, k, dtype=torch.bfloat16)
    with recorder.recording():
        if kind == kq.DENSE:
            weight = torch.empty(n, k, dtype=torch.bfloat16)
            if fusion == "gated":
                dense_gemv.dense_linear_triton(torch.empty(rows, 2 * k, dtype=torch.bfloat16), weight, gated=True,
                                               config=config)
            else:
                dense_gemv.dense_linear_triton(
                    x, weight, torch.empty(k) if fusion == "norm" else None, 1e-6, config=config,
                    residual=torch.empty(rows, n, dtype=torch.bfloat16) if fusion == "residual" else None)
        elif kind == "nvfp4":
            kq.nvfp4_linear_triton(x, torch.empty(n, k // 2, dtype=torch.uint8),
                                   torch.empty(n, k // kq.NVFP4_GROUP, dtype=torch.float8_e4m3fn), torch.empty(n),
                                   config=config)
        else:
            group = k if kind == "fp8" else ck.FP8_BLOCK
            kq.fp8_linear_triton(x, torch.empty(n, k, dtype=torch.float8_e4m3fn), torch.empty(n, k // group),
                                 config=config)
    return next(launch for launch in recorder.launches
                if launch.kernel.__name__ in ("_quant_gemv_kernel", "_dense_gemv_kernel"))


def sass(launch: ck.Launch, arch: int) -> tuple[str, int, int]:
    """The kernel's SASS text, its registers per thread (from the cubin) and its local-memory (spill) accesses."""
    target = GPUTarget("cuda", arch, 32)
    signature, constexprs, attrs, options = ck._compile_key(launch, make_backend(target))
    compiled = triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs), target=target,
                              options=options.__dict__)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp, "kernel.cubin")
        cubin.write_bytes(compiled.asm["cubin"])
        nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
        text = subprocess.run([str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    return text, _registers(compiled.asm["cubin"]), len(re.findall(r"\b(?:STL|LDL)\b", text))


def _registers(cubin: bytes) -> int:
    """Registers per thread, as ptxas records them in the cubin: the EIATTR_REGCOUNT (0x2f) attribute of the ELF
    ``.nv.info`` section, a record of format 4 (a 16-bit size, then the function's symbol and the count as u32)."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = sections[shstrndx][4]
    for name, _, _, _, offset, size, *_ in sections:
        if cubin[names + name:cubin.index(b"\0", names + name)] != b".nv.info":
            continue
        at = offset
        while at < offset + size:
            fmt, attribute = cubin[at], cubin[at + 1]
            length = struct.unpack_from("<H", cubin, at + 2)[0] if fmt == 4 else 0
            if attribute == 0x2F:
                return struct.unpack_from("<I", cubin, at + 8)[0]
            at += 4 + length
    raise ValueError("no register count in the cubin")


def loop_bodies(text: str) -> list[list[str]]:
    """The opcodes of every loop body (a backward branch to a label) in issue order, the loops in program order."""
    lines = [(int(m.group(1), 16), line) for line in text.splitlines() if (m := _ADDRESS.search(line))]
    found = []
    for index, (here, line) in enumerate(lines):
        label = re.search(r"\bBRA\b.*`\((\.L_x_\d+)\)", line)
        if not label:
            continue
        where = text.find(f"{label.group(1)}:")
        after = _ADDRESS.search(text, where) if where >= 0 else None
        start = int(after.group(1), 16) if after else None
        if start is not None and start < here:
            found.append((start, [re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", ln).group(1)
                                  for address, ln in lines[:index + 1] if address >= start]))
    return [body for _, body in sorted(found, key=lambda item: item[0])]


def loops(text: str) -> list[collections.Counter]:
    """Opcode counts of every loop body, in program order."""
    return [collections.Counter(body) for body in loop_bodies(text)]


def loop_opcodes(text: str) -> collections.Counter:
    """Opcode counts of the body of the longest backward branch (the K loop)."""
    return max(loops(text), key=lambda counts: sum(counts.values()), default=collections.Counter())


def loads_before_first_barrier(text: str) -> int:
    """Global loads issued before the kernel's first barrier: a prologue's loads all in flight at once (the dense
    GEMV's row statistics of a normed input) show here as many as the prologue makes."""
    head = text.split("BAR.SYNC", 1)[0]
    return len(re.findall(r"\bLDG\b", head))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=(*kq.WEIGHT_KINDS, kq.DENSE))
    parser.add_argument("--fusion", choices=FUSIONS, default="plain", help="the dense GEMV's fusion")
    parser.add_argument("n", type=int)
    parser.add_argument("k", type=int)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--config", help="block_n,block_k,warps,stages,splits (default: the kernels' choice on CPU)")
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--dump", type=Path, help="write the whole SASS here")
    parser.add_argument("--json", type=Path, help="write the counts here")
    args = parser.parse_args(argv)
    config = kq.GemvConfig(*map(int, args.config.split(","))) if args.config else None
    launch = record(args.kind, args.n, args.k, args.rows, config, args.fusion)
    text, registers, local_accesses = sass(launch, args.arch)
    if args.dump:
        args.dump.write_text(text)
    opcodes = loop_opcodes(text)
    used = config or kq.gemv_config(args.kind, args.n, args.k, args.rows, torch.device("cpu"))
    weights = used.block_n * used.block_k / (32 * used.num_warps)
    total = sum(opcodes.values())
    name = f"{args.kind} {args.fusion}" if args.kind == kq.DENSE else args.kind
    print(f"{name} {args.n}x{args.k} rows {args.rows} {tuple(used)} sm_{args.arch}: {total} loop instructions, "
          f"{weights:.0f} weights per thread, {total / weights:.2f} per weight, {registers} registers, "
          f"{local_accesses} local-memory accesses, {loads_before_first_barrier(text)} global loads before the first "
          "barrier")
    print(", ".join(f"{op} {count}" for op, count in opcodes.most_common()))
    if args.json:
        provenance.write_result(args.json, {"kind": args.kind, "fusion": args.fusion if args.kind == kq.DENSE else None,
                                            "N": args.n, "K": args.k, "rows": args.rows, "arch": f"sm_{args.arch}",
                                            "config": list(used), "instructions": total, "weights_per_thread": weights,
                                            "per_weight": total / weights, "registers": registers,
                                            "local_memory_accesses": local_accesses, "opcodes": dict(opcodes),
                                            "loads_before_first_barrier": loads_before_first_barrier(text)},
                                "cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
