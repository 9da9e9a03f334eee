"""The dense GEMV path of the engine (EngineConfig.dense_gemv = "triton"): where the kernel set takes it, what a
decode step then launches, its logits against the reference path's, and its continuations from a capsule.

Without CUDA the Triton kernels run through Triton's interpreter (test/conftest.py sets TRITON_INTERPRET=1), which
is slow: one engine per path, shared by the tests of this module, on the tiny preset.
"""
import dataclasses
import os

import pytest
import torch

from flashrt_ros.runtime import Engine, EngineConfig, ErrorCode, FlashRTError
from flashrt_ros.runtime import kernels as kernel_sets
from flashrt_ros.runtime.kernels import dense_gemv
from flashrt_ros.runtime.kernels import quant_gemv as kq

pytestmark = pytest.mark.skipif(kernel_sets.triton is None or not (
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs Triton on CUDA or Triton's interpreter (TRITON_INTERPRET=1)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPT = [5, 17, 230, 41, 99, 3, 64, 128, 7, 250, 11]
TOLERANCE = {"float32": 1e-4, "bfloat16": 2.0 ** -6}    # of the largest logit: the dtype's rounding, a few steps deep


def config(**overrides) -> EngineConfig:
    return EngineConfig(model="tiny", device=DEVICE, max_context=64, **overrides)


@pytest.fixture(scope="module")
def engines():
    """(reference path, dense GEMV path), fp32 tiny."""
    return Engine(config(kernels="reference")), Engine(config(kernels="triton", dense_gemv="triton"))


def test_the_kernel_set_takes_the_dense_gemv_only_where_asked_and_its_probe_passes(monkeypatch):
    """Asked for and probed: the Triton set with the GEMV; a probe that fails (a GPU its compiler cannot build for)
    keeps F.linear and says why; the reference set never takes it; an unknown path is refused."""
    cpu = torch.device(DEVICE)
    fast, _ = kernel_sets.select("triton", cpu, False, "triton")
    assert fast.dense_linear is dense_gemv.dense_linear_triton and fast.name == "triton+gemv"
    assert kernel_sets.select("triton", cpu, False, "cublas")[0].dense_linear is None
    assert kernel_sets.select("reference", cpu, False, "triton")[0] is kernel_sets.REFERENCE

    def unusable(device):
        raise RuntimeError("ptxas cannot build sm_110a")
    monkeypatch.setattr(kernel_sets, "_dense_gemv_case", unusable)
    kept, reason = kernel_sets.select("triton", cpu, False, "triton")
    assert kept.dense_linear is None and kept.name == "triton" and "ptxas cannot build sm_110a" in reason
    with pytest.raises(ValueError, match="dense_gemv must be one of"):
        kernel_sets.select("triton", cpu, False, "cutlass")
    with pytest.raises(FlashRTError) as refused:
        config(dense_gemv="cutlass").validate()
    assert refused.value.code == ErrorCode.INVALID_ARGUMENT and "dense_gemv" in refused.value.message


class _Counting:
    """Calls of the kernel set's functions by name, and the fusions each dense GEMV call took."""

    def __init__(self, kernels):
        self.calls, self.gemv = {}, []
        wrapped = {name: self._wrap(name, getattr(kernels, name)) for name in ("add_rms_norm", "silu_mul", "rms_norm")}
        self.kernels = dataclasses.replace(kernels, dense_linear=self._gemv(kernels.dense_linear), **wrapped)

    def _wrap(self, name, fn):
        def call(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return call

    def _gemv(self, fn):
        def call(x, weight, norm=None, eps=0.0, gated=False, residual=None):
            self.gemv.append((tuple(weight.shape), norm is not None, gated, residual is not None))
            return fn(x, weight, norm, eps, gated, residual)
        return call


def test_a_decode_step_fuses_the_norms_the_gate_and_the_residual_adds_into_its_projections(engines):
    """One decode token: each layer's in-projection norms its input, its output projection adds the residual, the
    MLP's gate_up norms and its down projection gates and adds; no add_rms_norm or silu_mul launch is left."""
    _, gemv = engines
    gemv.reset()
    gemv.ingest(PROMPT)
    original = gemv.model.kernels
    counting = _Counting(original)
    gemv.model.kernels = counting.kernels
    try:
        list(gemv.generate(1, stop_token_ids=()))
    finally:
        gemv.model.kernels = original
    layers = gemv.model_config.num_layers
    assert counting.calls.get("add_rms_norm", 0) == 0 and counting.calls.get("silu_mul", 0) == 0, counting.calls
    fused = [call[1:] for call in counting.gemv]
    assert fused.count((True, False, False)) == 2 * layers             # in-projections and gate_up: norm prologue
    assert fused.count((False, False, True)) == layers                 # out_proj / o_proj: residual epilogue
    assert fused.count((False, True, True)) == layers                  # down_proj: gate prologue, residual epilogue
    vocab = gemv.model_config.vocab_size
    assert (vocab, gemv.model_config.hidden_size) in [call[0] for call in counting.gemv]   # the LM head too


def test_logits_of_the_gemv_path_stay_within_the_dtypes_rounding_of_the_reference(engines):
    """Prefill (cuBLAS), then decode steps (one row) and one-token pieces (eight padded rows), both through the
    GEMV: the next-token logits after each stay within tolerance of the reference path's, and greedy picks agree."""
    reference, gemv = engines
    for engine in engines:
        engine.reset()
        engine.ingest(PROMPT)
    for step in range(3):
        want, got = reference.next_token_logits(), gemv.next_token_logits()
        error = float((got - want).abs().max() / want.abs().max())
        assert error <= TOLERANCE["float32"], (step, error)
        if step % 2:
            tokens = [list(engine.generate(1, stop_token_ids=()))[0] for engine in engines]
            assert tokens[0] == tokens[1]
        else:
            for engine in engines:
                engine.ingest([int(want.argmax())])
    assert gemv.position == reference.position == len(PROMPT) + 3


def test_greedy_continuations_from_a_capsule_repeat_token_for_token_on_the_gemv_path(engines):
    """A capsule of the GEMV path continues with the same tokens and the same live bytes after every one when
    restored; the GEMV path's fingerprint is not the cuBLAS path's (its decode gives other bytes), so neither
    engine takes the other's capsules."""
    _, gemv = engines
    gemv.reset()
    gemv.ingest(PROMPT)
    gemv.snapshot("mid")

    def continuation(engine):
        tokens, states = [], []
        for token in engine.generate(3, stop_token_ids=()):
            tokens.append(token)
            states.append(engine.live_bytes())
        return tokens, states

    first = continuation(gemv)
    gemv.restore("mid")
    again = continuation(gemv)
    assert again[0] == first[0]
    assert all(torch.equal(a, b) for a, b in zip(again[1], first[1]))
    assert gemv.fingerprint != Engine(config(kernels="triton")).fingerprint


def test_the_gemv_paths_fingerprint_covers_this_devices_gemv_table(monkeypatch):
    """The table fixes the dense GEMV's reduction order too: an engine of the GEMV path built under another entry
    for this device refuses the first one's capsules; the cuBLAS path does not depend on the table."""
    paths = ("cublas", "triton")
    before = {path: Engine(config(kernels="triton", dense_gemv=path)).fingerprint for path in paths}
    monkeypatch.setitem(kq.quant_gemv_configs.TABLE, kq.device_name(torch.device(DEVICE)),
                        {"configs": {(kq.DENSE, 8, 8, kq.DENSE_ROWS): (16, 64, 4, 1, 1)}, "fused_max_rows": {}})
    after = {path: Engine(config(kernels="triton", dense_gemv=path)).fingerprint for path in paths}
    assert after["triton"] != before["triton"] and after["cublas"] == before["cublas"]
