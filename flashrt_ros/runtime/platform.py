"""Where the engine runs: start-up probes with their fallbacks, Jetson power facts, and the memory capsules may use.

Run once when an engine is built (:func:`probe`); the outcome is in ``Engine.stats()`` (so in ``/diagnostics``)
under ``platform.*`` and in the bench JSON:

* **compute capability** of the CUDA device, and whether this torch build carries kernels for it (PyTorch's cu128
  wheels have none for Thor's sm_110; a cu130 build is needed). Informational: the smoke matmul decides.
* **smoke matmul** in the engine's dtype on the device, checked against fp32 on the CPU. If it fails, nothing can
  run there: the engine refuses to build (``LOAD_FAILED`` with the reason), which a node reports as ``last_error``.
* **quantized GEMV kernels**: Triton compiles and runs both fused kernels on the device and they match their
  references; if not, once more with ``TRITON_PTXAS_PATH`` at the system CUDA's ptxas (Triton <= 3.6 fails on
  sm_110 with its bundled one); otherwise quantized layers fall back to dequantise + GEMM, with the reason recorded.
* on a **Jetson**: ``nvpmodel -q`` (power mode) and ``jetson_clocks --show`` where present, and MemAvailable, since
  ``torch.cuda.mem_get_info`` under-reports free memory where CPU and GPU share DRAM (page cache counts as used).

Every reader degrades to a short "absent" / "unavailable: why" string; none raises.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import shutil
import subprocess
from pathlib import Path

import torch

from .errors import ErrorCode, FlashRTError
from .kernels import quant_gemv as kq
from .kernels._triton import IMPORT_ERROR, triton

FP8_MIN_CAPABILITY = (8, 9)          # hardware E4M3 conversion (Ada, Hopper, Blackwell)
TOOL_TIMEOUT_S = 5.0
JETSON_MARKERS = (Path("/etc/nv_tegra_release"), Path("/proc/device-tree/model"))
MEMINFO = Path("/proc/meminfo")
CUDA_PTXAS = Path("/usr/local/cuda/bin/ptxas")


@dataclasses.dataclass(frozen=True)
class PlatformReport:
    device: str
    compute_capability: str          # "9.0"; "" on the CPU
    torch_arch: str                  # whether this torch build has kernels for that capability
    integrated: bool                 # GPU and CPU share DRAM (Jetson): capsules and weights use host memory
    smoke_matmul: str
    quant_triton: bool
    quant_kernels: str               # why the quantized layers use the fused kernels or the reference
    jetson: str                      # the board's model string, "" elsewhere
    nvpmodel: str
    jetson_clocks: str
    mem_available_bytes: int         # MemAvailable at start-up (0 where /proc/meminfo is unreadable)

    @property
    def host_memory(self) -> bool:
        """Capsules live in host DRAM: on the CPU and on integrated GPUs."""
        return self.integrated or not self.compute_capability

    @property
    def pinned_host_tier(self) -> bool:
        """Capsules can spill to pinned host memory: a discrete GPU (on integrated ones host and device are one
        DRAM and pinned-host registration is unsupported; on the CPU the device tier is host memory already)."""
        return bool(self.compute_capability) and not self.integrated

    def diagnostics(self) -> dict[str, str]:
        return {f"platform.{k}": str(v) for k, v in dataclasses.asdict(self).items()}


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def mem_available_bytes(meminfo: Path = MEMINFO) -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping, page cache included); 0 if absent."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def jetson_model(markers: tuple[Path, ...] = JETSON_MARKERS) -> str:
    """The board's model string on a Jetson (L4T), else ""."""
    release, model = markers
    try:
        name = model.read_bytes().rstrip(b"\x00").decode(errors="replace").strip()
    except OSError:
        name = ""
    if "jetson" in name.lower() or "thor" in name.lower():
        return name
    return "Jetson (L4T)" if release.exists() else ""


def run_tool(argv: list[str]) -> str:
    """A tool's output condensed to one line; "absent" when not installed, "unavailable: why" when it fails."""
    if shutil.which(argv[0]) is None:
        return "absent"
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError) as err:
        return f"unavailable: {_first_line(err)}"
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip().splitlines()
        return f"unavailable: exit {done.returncode}{': ' + why[0] if why else ''}"
    return "; ".join(line.strip() for line in done.stdout.splitlines() if line.strip())


def compute_capability(device: torch.device) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def torch_arch_support(capability: tuple[int, int] | None, arch_list: list[str] | None = None) -> str:
    """"yes (sm_90)" when this torch build has kernels for the device (native, or PTX it can JIT), else "no: ..."."""
    if capability is None:
        return "n/a (cpu)"
    arches = torch.cuda.get_arch_list() if arch_list is None else arch_list
    major, minor = capability
    native = f"sm_{major}{minor}"
    if native in arches:
        return f"yes ({native})"
    ptx = [a for a in arches if a.startswith("compute_") and int(a[len("compute_"):]) <= major * 10 + minor]
    if ptx:
        return f"yes (PTX {ptx[-1]}, JIT-compiled at first use)"
    return (f"no: this torch build has {', '.join(arches) or 'no CUDA kernels'}, nothing for {native} "
            "(on Jetson Thor use a cu130 build)")


def smoke_matmul(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when a small matmul on the device in ``dtype`` matches fp32 on the CPU; else why not."""
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 96, generator=generator), torch.randn(96, 32, generator=generator)
    try:
        got = torch.matmul(a.to(device, dtype), b.to(device, dtype)).float().cpu()
    except Exception as err:  # noqa: BLE001 - e.g. "no kernel image is available for execution on the device"
        return f"matmul failed on {device}: {_first_line(err)}"
    want = a.to(dtype).float() @ b.to(dtype).float()
    if not torch.allclose(got, want, rtol=0.05, atol=0.05 * float(want.abs().max())):
        return f"matmul on {device} ran but disagrees with the CPU (max error {float((got - want).abs().max()):.3g})"
    return None


def check_quant_kernels(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when both fused GEMVs compile, run on ``device`` and match their references; else why not."""
    if triton is None:
        return f"triton is not importable ({IMPORT_ERROR})"
    generator = torch.Generator().manual_seed(0)
    n, k = 48, 512
    x = torch.randn(3, k, generator=generator).to(device, dtype)
    q8 = torch.randn(n, k, generator=generator).to(torch.float8_e4m3fn).to(device)
    s8 = (0.5 + torch.rand(n, 1, generator=generator)).to(device)
    q4 = torch.randint(0, 256, (n, k // 2), generator=generator, dtype=torch.uint8).to(device)
    s4 = (4 * torch.rand(n, k // kq.NVFP4_GROUP, generator=generator)).to(torch.float8_e4m3fn).to(device)
    r4 = (0.5 + torch.rand(n, generator=generator)).to(device)
    cases = [("fp8", kq.fp8_linear_triton, kq.fp8_linear_reference, (q8, s8)),
             ("nvfp4", kq.nvfp4_linear_triton, kq.nvfp4_linear_reference, (q4, s4, r4))]
    for (name, fast, reference, weights), rows in itertools.product(cases, (x[:1], x)):   # decode and dot paths
        try:
            got = fast(rows, *weights).float()
        except Exception as err:  # noqa: BLE001 - e.g. Triton <= 3.6 on sm_110: "sm_110a is not defined"
            hint = " (set TRITON_PTXAS_PATH to CUDA 13's ptxas)" if "sm_110" in str(err) else ""
            return f"{name} GEMV failed to compile or run: {_first_line(err)}{hint}"
        want = reference(rows, *weights).float()
        if not torch.allclose(got, want, rtol=0.02, atol=0.02 * float(want.abs().max())):
            return f"{name} GEMV ran but disagrees with its reference"
    return None


def quant_kernel_choice(device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether quantized layers use the fused Triton GEMVs on ``device``, and why."""
    capability = compute_capability(device)
    if capability is None:
        return False, "cpu: dequantise + GEMM (reference)"
    if capability < FP8_MIN_CAPABILITY:
        return False, f"reference: compute capability {capability[0]}.{capability[1]} has no FP8 conversion"
    failure = check_quant_kernels(device, dtype)
    if failure is not None and "TRITON_PTXAS_PATH" not in os.environ and CUDA_PTXAS.is_file():
        # Triton <= 3.6 bundles a ptxas that predates sm_110 (Thor); the system CUDA 13 one knows it.
        os.environ["TRITON_PTXAS_PATH"] = str(CUDA_PTXAS)
        retry = check_quant_kernels(device, dtype)
        if retry is None:
            return True, f"triton probe passed with TRITON_PTXAS_PATH={CUDA_PTXAS} (bundled ptxas: {failure})"
        del os.environ["TRITON_PTXAS_PATH"]
    if failure is not None:
        return False, f"reference: {failure}"
    return True, "triton probe passed"


def probe(device: torch.device, dtype: torch.dtype) -> PlatformReport:
    """Run every start-up probe; raises LOAD_FAILED when the device cannot even multiply matrices."""
    failure = smoke_matmul(device, dtype)
    if failure is not None:
        raise FlashRTError(ErrorCode.LOAD_FAILED, f"device probe: {failure}")
    capability = compute_capability(device)
    use_triton, why = quant_kernel_choice(device, dtype)
    board = jetson_model()
    return PlatformReport(
        device=str(device), compute_capability="" if capability is None else f"{capability[0]}.{capability[1]}",
        torch_arch=torch_arch_support(capability),
        integrated=bool(capability) and bool(torch.cuda.get_device_properties(device).is_integrated),
        smoke_matmul="ok", quant_triton=use_triton, quant_kernels=why, jetson=board,
        nvpmodel=run_tool(["nvpmodel", "-q"]) if board else "absent",
        jetson_clocks=run_tool(["jetson_clocks", "--show"]) if board else "absent",
        mem_available_bytes=mem_available_bytes())


def capsule_budget_bytes(configured: int, fraction: float, report: PlatformReport, available: int) -> int:
    """The capsule budget: ``configured``, capped at ``fraction`` of ``available`` (MemAvailable now) where capsules
    live in host DRAM (integrated GPUs, the CPU). ``fraction`` 0 disables the cap; so does an unreadable 0."""
    if fraction > 0 and report.host_memory and available:
        return min(configured, int(fraction * available))
    return configured

