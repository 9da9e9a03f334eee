"""Start-up probes and their fallbacks, with each failure simulated: Jetson facts that are absent or fail, a torch
build without kernels for the GPU, a device that cannot multiply, quantized kernels that fail to compile (and the
ptxas retry), and the capsule budget as a share of MemAvailable."""
import os
import stat

import pytest
import torch

from flashrt_ros.runtime import Engine, EngineConfig, ErrorCode, FlashRTError, platform
from flashrt_ros.runtime.kernels import quant_gemv as kq
from flashrt_ros.runtime.kernels._triton import triton


def script(folder, name: str, body: str) -> None:
    path = folder / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def tools(tmp_path, monkeypatch):
    """A PATH holding only the fake tools a test writes into it."""
    monkeypatch.setenv("PATH", str(tmp_path))
    return tmp_path


def test_mem_available_is_read_from_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       131072000 kB\nMemFree:  1000 kB\nMemAvailable:   98765432 kB\n")
    assert platform.mem_available_bytes(meminfo) == 98765432 * 1024
    meminfo.write_text("MemTotal: 5 kB\nMemAvailable: lots\n")
    assert platform.mem_available_bytes(meminfo) == 0
    assert platform.mem_available_bytes(tmp_path / "absent") == 0


def test_jetson_is_recognised_from_the_device_tree_or_the_l4t_release(tmp_path):
    release, model = tmp_path / "nv_tegra_release", tmp_path / "model"
    assert platform.jetson_model((release, model)) == ""
    model.write_bytes(b"NVIDIA Jetson AGX Thor Developer Kit\x00")
    assert platform.jetson_model((release, model)) == "NVIDIA Jetson AGX Thor Developer Kit"
    model.write_bytes(b"Raspberry Pi 5\x00")
    assert platform.jetson_model((release, model)) == ""
    release.write_text("# R38 (release), REVISION: 2.0\n")
    assert platform.jetson_model((release, model)) == "Jetson (L4T)"


def test_tools_report_their_output_absence_or_failure(tools, monkeypatch):
    assert platform.run_tool(["nvpmodel", "-q"]) == "absent"
    script(tools, "nvpmodel", 'echo "NV Power Mode: MAXN"; echo 0')
    assert platform.run_tool(["nvpmodel", "-q"]) == "NV Power Mode: MAXN; 0"
    script(tools, "jetson_clocks", 'echo "must be run as root" >&2; exit 3')
    assert platform.run_tool(["jetson_clocks", "--show"]) == "unavailable: exit 3: must be run as root"
    script(tools, "slow", "while :; do :; done")
    monkeypatch.setattr(platform, "TOOL_TIMEOUT_S", 0.2)
    assert platform.run_tool(["slow"]).startswith("unavailable: TimeoutExpired")


def test_a_torch_build_without_kernels_for_the_gpu_is_reported():
    assert platform.torch_arch_support((9, 0), ["sm_80", "sm_90"]) == "yes (sm_90)"
    assert platform.torch_arch_support((11, 0), ["sm_90", "compute_90"]).startswith("yes (PTX compute_90")
    missing = platform.torch_arch_support((11, 0), ["sm_80", "sm_90", "sm_120"])
    assert missing.startswith("no:") and "sm_110" in missing and "cu130" in missing
    assert platform.torch_arch_support(None) == "n/a (cpu)"


def test_the_smoke_matmul_passes_on_the_cpu_and_reports_failures(monkeypatch):
    assert platform.smoke_matmul(torch.device("cpu"), torch.float32) is None
    assert platform.smoke_matmul(torch.device("cpu"), torch.bfloat16) is None

    def no_kernel(*_):
        raise RuntimeError("CUDA error: no kernel image is available for execution on the device\nmore")
    monkeypatch.setattr(torch, "matmul", no_kernel)
    assert "no kernel image is available" in platform.smoke_matmul(torch.device("cpu"), torch.float32)
    monkeypatch.setattr(torch, "matmul", lambda a, b: torch.zeros(a.shape[0], b.shape[1], dtype=a.dtype))
    assert "disagrees" in platform.smoke_matmul(torch.device("cpu"), torch.float32)


def test_an_engine_refuses_to_build_on_a_device_that_cannot_multiply(monkeypatch):
    monkeypatch.setattr(platform, "smoke_matmul", lambda device, dtype: "matmul failed on cpu: RuntimeError: boom")
    with pytest.raises(FlashRTError, match="device probe: matmul failed") as err:
        Engine(EngineConfig(max_context=64))
    assert err.value.code == ErrorCode.LOAD_FAILED


@pytest.mark.skipif(triton is None, reason="triton is not importable")
def test_the_quant_kernel_check_runs_them_and_reports_failures(monkeypatch):
    cpu = torch.device("cpu")
    assert platform.check_quant_kernels(cpu, torch.float32) is None     # through the interpreter here

    def ptxas_too_old(*_):
        raise RuntimeError("PTXASError: ptxas fatal   : Value 'sm_110a' is not defined for option 'gpu-name'")
    monkeypatch.setattr(kq, "nvfp4_linear_triton", ptxas_too_old)
    why = platform.check_quant_kernels(cpu, torch.float32)
    assert why.startswith("nvfp4 GEMV failed") and "sm_110a" in why and "TRITON_PTXAS_PATH" in why
    monkeypatch.setattr(kq, "nvfp4_linear_triton", lambda x, q, s, r: 2 * kq.nvfp4_linear_reference(x, q, s, r))
    assert platform.check_quant_kernels(cpu, torch.float32) == "nvfp4 GEMV ran but disagrees with its reference"
    monkeypatch.setattr(platform, "triton", None)
    assert platform.check_quant_kernels(cpu, torch.float32).startswith("triton is not importable")


@pytest.fixture
def simulated_gpu(monkeypatch):
    """quant_kernel_choice on a pretend sm_90 device whose kernel check follows ``outcomes`` (one per call)."""
    outcomes, calls = [], []
    monkeypatch.setattr(platform, "compute_capability", lambda device: (9, 0))
    monkeypatch.setattr(platform, "check_quant_kernels",
                        lambda device, dtype: calls.append(os.environ.get("TRITON_PTXAS_PATH")) or outcomes.pop(0))
    monkeypatch.delenv("TRITON_PTXAS_PATH", raising=False)
    return outcomes, calls


def test_quantized_layers_fall_back_to_the_reference_when_the_gpu_lacks_fp8(monkeypatch):
    monkeypatch.setattr(platform, "compute_capability", lambda device: (8, 0))
    use, why = platform.quant_kernel_choice(torch.device("cpu"), torch.bfloat16)
    assert not use and "8.0 has no FP8 conversion" in why
    monkeypatch.setattr(platform, "compute_capability", lambda device: None)
    assert platform.quant_kernel_choice(torch.device("cpu"), torch.bfloat16) == \
        (False, "cpu: dequantise + GEMM (reference)")


def test_a_failed_kernel_compile_retries_with_the_system_ptxas(simulated_gpu, tmp_path, monkeypatch):
    outcomes, calls = simulated_gpu
    ptxas = tmp_path / "ptxas"
    ptxas.write_text("")
    monkeypatch.setattr(platform, "CUDA_PTXAS", ptxas)
    outcomes += ["nvfp4 GEMV failed to compile or run: sm_110a is not defined", None]
    use, why = platform.quant_kernel_choice(torch.device("cpu"), torch.bfloat16)
    assert use and f"TRITON_PTXAS_PATH={ptxas}" in why and calls == [None, str(ptxas)]
    assert os.environ["TRITON_PTXAS_PATH"] == str(ptxas)


def test_a_kernel_compile_that_fails_twice_falls_back_and_leaves_the_environment(simulated_gpu, tmp_path,
                                                                                monkeypatch):
    outcomes, calls = simulated_gpu
    monkeypatch.setattr(platform, "CUDA_PTXAS", tmp_path / "ptxas")
    (tmp_path / "ptxas").write_text("")
    outcomes += ["first failure", "second failure"]
    use, why = platform.quant_kernel_choice(torch.device("cpu"), torch.bfloat16)
    assert (use, why) == (False, "reference: first failure") and "TRITON_PTXAS_PATH" not in os.environ
    outcomes += ["no ptxas to retry with"]
    monkeypatch.setattr(platform, "CUDA_PTXAS", tmp_path / "absent")
    assert platform.quant_kernel_choice(torch.device("cpu"), torch.bfloat16) == \
        (False, "reference: no ptxas to retry with")


def report(**overrides) -> platform.PlatformReport:
    base = dict(device="cuda:0", compute_capability="11.0", torch_arch="yes (sm_110)", integrated=True,
                smoke_matmul="ok", quant_triton=True, quant_kernels="triton probe passed", jetson="Thor",
                nvpmodel="NV Power Mode: MAXN", jetson_clocks="absent", mem_available_bytes=100 << 30)
    return platform.PlatformReport(**{**base, **overrides})


def test_the_capsule_budget_is_capped_by_a_share_of_mem_available_on_host_memory_devices():
    gib = 1 << 30
    assert platform.capsule_budget_bytes(8 * gib, 0.05, report(), 100 * gib) == int(0.05 * 100 * gib)
    assert platform.capsule_budget_bytes(1 * gib, 0.05, report(), 100 * gib) == gib          # the configured cap
    assert platform.capsule_budget_bytes(8 * gib, 0.0, report(), 100 * gib) == 8 * gib      # fraction off
    assert platform.capsule_budget_bytes(8 * gib, 0.05, report(integrated=False), 100 * gib) == 8 * gib  # discrete
    cpu = report(compute_capability="", integrated=False)
    assert platform.capsule_budget_bytes(8 * gib, 0.05, cpu, 100 * gib) == int(0.05 * 100 * gib)
    assert platform.capsule_budget_bytes(8 * gib, 0.05, report(), 0) == 8 * gib            # MemAvailable unreadable


def test_the_engine_reports_its_probes_and_jetson_facts(monkeypatch):
    monkeypatch.setattr(platform, "jetson_model", lambda: "NVIDIA Jetson AGX Thor Developer Kit")
    monkeypatch.setattr(platform, "run_tool", lambda argv: {"nvpmodel": "NV Power Mode: MAXN; 0"}.get(argv[0],
                                                                                                     "absent"))
    monkeypatch.setattr(platform, "mem_available_bytes", lambda: 1 << 30)
    engine = Engine(EngineConfig(max_context=64, capsule_budget_bytes=1 << 40, capsule_budget_fraction=0.25))
    stats = engine.stats()
    assert stats["platform.jetson"] == "NVIDIA Jetson AGX Thor Developer Kit"
    assert stats["platform.nvpmodel"] == "NV Power Mode: MAXN; 0" and stats["platform.jetson_clocks"] == "absent"
    assert stats["platform.smoke_matmul"] == "ok" and stats["platform.quant_kernels"].startswith("cpu")
    assert stats["capsule_budget_bytes"] == 1 << 28


def test_a_budget_fraction_outside_zero_to_one_is_refused():
    with pytest.raises(FlashRTError) as err:
        Engine(EngineConfig(max_context=64, capsule_budget_fraction=1.5))
    assert err.value.code == ErrorCode.INVALID_ARGUMENT
