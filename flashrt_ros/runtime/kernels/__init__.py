"""The runtime's kernels: per operation one reference function (plain PyTorch, the CPU path and the oracle) and,
beside it in the same module, one fast kernel with the same contract. :func:`select` picks the set, in one place.

Every function writes its recurrent outputs into caller-owned buffers (``copy_`` or in-place stores), never
rebinding them, so the same code runs eagerly on the CPU and inside captured CUDA graphs over the arena.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable

import torch

from ._triton import IMPORT_ERROR, triton
from .activations import silu_mul, silu_mul_triton
from .attention import (attention_causal, attention_decode_reference, attention_decode_triton, attention_masked,
                        attention_prefill, output_gate)
from .conv import causal_conv, causal_conv_rows, causal_conv_rows_triton, causal_conv_triton
from .dense_gemv import dense_linear, dense_linear_triton
from .delta_rule import (delta_rule_chunked, delta_rule_fla, delta_rule_gates, delta_rule_recurrent, fla_available,
                         gated_delta_rule_reference, gated_delta_rule_rows, gated_delta_rule_rows_triton,
                         gated_delta_rule_triton)
from .pick import apply_mask, greedy_pick, greedy_pick_triton
from .norms import (add_rms_norm, add_rms_norm_triton, gated_rms_norm, gated_rms_norm_triton, l2norm, rms_norm,
                    rms_norm_triton)
from .rope import apply_rope, qk_norm_rope_kv_write, qk_norm_rope_kv_write_triton

__all__ = ["CHOICES", "DENSE_GEMV_CHOICES", "KernelSet", "REFERENCE", "TRITON", "apply_mask", "apply_rope",
           "attention_causal", "attention_masked", "causal_conv", "delta_rule_chunked", "delta_rule_fla",
           "delta_rule_recurrent", "fla_available", "gated_rms_norm", "l2norm", "output_gate", "rms_norm", "select"]


@dataclasses.dataclass(frozen=True)
class KernelSet:
    """The functions the model calls, by operation. ``name`` goes into the fingerprint and /diagnostics."""
    name: str
    rms_norm: Callable
    add_rms_norm: Callable
    gated_rms_norm: Callable
    silu_mul: Callable
    causal_conv: Callable
    causal_conv_rows: Callable     # a speculative verify's rows, keeping the state after each
    qk_norm_rope_kv_write: Callable
    gated_delta_rule: Callable     # decode and pieces <= SMALL_PIECE (graph-captured on CUDA)
    gated_delta_rule_rows: Callable  # a speculative verify's rows, keeping the state after each
    delta_rule_long: Callable      # eager pieces > SMALL_PIECE
    attention_decode: Callable     # queries at arbitrary positions over a KV bucket, output-gated
    attention_prefill: Callable    # queries that are the last L of exactly T positions
    greedy_pick: Callable          # the argmax of each logits row over the tokens its mask words allow
    dense_linear: Callable | None = None   # dense projections of <= dense_gemv.MAX_ROWS rows (None: F.linear, cuBLAS)


REFERENCE = KernelSet(
    name="reference", rms_norm=rms_norm, add_rms_norm=add_rms_norm, gated_rms_norm=gated_rms_norm,
    silu_mul=silu_mul, causal_conv=causal_conv, causal_conv_rows=causal_conv_rows,
    qk_norm_rope_kv_write=qk_norm_rope_kv_write, gated_delta_rule=gated_delta_rule_reference,
    gated_delta_rule_rows=gated_delta_rule_rows, delta_rule_long=gated_delta_rule_reference,
    attention_decode=attention_decode_reference, attention_prefill=attention_causal,
    greedy_pick=greedy_pick)

TRITON = KernelSet(
    name="triton", rms_norm=rms_norm_triton, add_rms_norm=add_rms_norm_triton, gated_rms_norm=gated_rms_norm_triton,
    silu_mul=silu_mul_triton, causal_conv=causal_conv_triton, causal_conv_rows=causal_conv_rows_triton,
    qk_norm_rope_kv_write=qk_norm_rope_kv_write_triton, gated_delta_rule=gated_delta_rule_triton,
    gated_delta_rule_rows=gated_delta_rule_rows_triton, delta_rule_long=gated_delta_rule_reference,
    attention_decode=attention_decode_triton, attention_prefill=attention_prefill,
    greedy_pick=greedy_pick_triton)


def _gated_delta_rule_fla(q, k, v, a, b, A_log, dt_bias, state, count=None):
    """fla-core's chunked kernel behind the gated contract (eager long pieces only: count is always None there)."""
    return delta_rule_fla(q, k, v, *delta_rule_gates(a, b, A_log, dt_bias), state)


def _with_fla(kernels: KernelSet) -> KernelSet:
    return dataclasses.replace(kernels, name=f"{kernels.name}+fla", delta_rule_long=_gated_delta_rule_fla)


def _with_dense_gemv(kernels: KernelSet) -> KernelSet:
    return dataclasses.replace(kernels, name=f"{kernels.name}+gemv", dense_linear=dense_linear_triton)


CHOICES = ("auto", "triton", "reference")
DENSE_GEMV_CHOICES = ("cublas", "triton")   # dense projections of decode and verify: F.linear, or dense_gemv's


def select(choice: str, device: torch.device, use_fla: bool, dense_gemv: str = "cublas") -> tuple[KernelSet, str]:
    """The kernel set for ``device`` and why. ``auto``: on CUDA, Triton where a start-up probe compiles and runs a
    kernel on the device and matches the reference, else the reference; on the CPU, the reference. ``triton``
    insists (raises if it cannot run); on the CPU it needs Triton's interpreter (TRITON_INTERPRET=1, for tests).
    ``dense_gemv`` ``triton``: the Triton set also multiplies the dense projections of up to
    ``dense_gemv.MAX_ROWS`` rows (decode, verify) with :func:`.dense_gemv.dense_linear_triton` and its fusions,
    where a probe of that kernel passes too (else ``F.linear``, with the reason; the reference set keeps it)."""
    if choice not in CHOICES:
        raise ValueError(f"kernels must be one of {CHOICES}, got {choice!r}")
    if dense_gemv not in DENSE_GEMV_CHOICES:
        raise ValueError(f"dense_gemv must be one of {DENSE_GEMV_CHOICES}, got {dense_gemv!r}")
    fla = use_fla and device.type == "cuda" and fla_available()
    chosen, reason = REFERENCE, "reference kernels requested"
    if choice == "auto" and device.type != "cuda":
        reason = f"reference kernels: the fast kernels are for CUDA, the device is {device.type}"
    elif choice != "reference":
        failure = _probe_triton(device)
        if failure is None:
            chosen, reason = TRITON, "triton probe passed"
        elif choice == "triton":
            raise RuntimeError(f"triton kernels requested but unusable: {failure}")
        else:
            reason = f"reference kernels: {failure}"
    fast = chosen is TRITON
    chosen = _with_fla(chosen) if fla else chosen
    if fast and dense_gemv == "triton":
        failure = _probe_triton(device, _dense_gemv_case)
        if failure is None:
            chosen = _with_dense_gemv(chosen)
        else:
            reason = f"{reason}; dense projections stay F.linear: {failure}"
    return chosen, reason


def _rms_norm_case(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """(Triton's output, the reference's, rtol, atol) of the start-up probe's RMSNorm."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, generator=generator).to(device)
    scale = (1.0 + 0.1 * torch.randn(64, generator=generator)).to(device)
    return TRITON.rms_norm(x, scale, 1e-6), rms_norm(x, scale, 1e-6), 1e-4, 1e-5


def _dense_gemv_case(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """The dense GEMV's probe: two bf16 rows (tensor cores, as decode runs it) normed, with a residual; within a
    bf16 step of the largest output."""
    generator = torch.Generator().manual_seed(0)
    x, weight, residual = (torch.randn(*shape, generator=generator).bfloat16().to(device)
                           for shape in ((2, 64), (48, 64), (2, 48)))
    norm = (1.0 + 0.1 * torch.randn(64, generator=generator)).to(device)
    args = (x, weight, norm, 1e-6, False, residual)
    want = dense_linear(*args)
    return dense_linear_triton(*args), want, 2.0 ** -7, 2.0 ** -7 * float(want.float().abs().max())


def _probe_triton(device: torch.device, case=_rms_norm_case) -> str | None:
    """None when a small Triton kernel (``case``) compiles, runs on ``device`` and matches its reference; else why
    not."""
    if triton is None:
        return f"triton is not importable ({IMPORT_ERROR})"
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "triton runs on the CPU only through its interpreter (TRITON_INTERPRET=1)"
    try:
        got, want, rtol, atol = case(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if not torch.allclose(got.float(), want.float(), rtol=rtol, atol=atol):
            return "triton probe kernel ran but disagreed with the reference"
    except Exception as err:  # noqa: BLE001 - e.g. ptxas cannot build for this GPU (Jetson Thor sm_110)
        return f"triton probe failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return None

