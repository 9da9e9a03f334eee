"""Programmatic dependent launch (EngineConfig.pdl): where the kernel set takes it, that it changes no byte, and that
the interpreter refuses it clearly. The kernels' PDL builds (the waits, the launch attribute, the GEMV's L2 prefetch)
are checked in sm_90 PTX on the CPU in test_kernels_compile.py; the bytes are checked on a GPU here."""
import dataclasses
import functools
import os

import pytest
import torch

from flashrt_ros.runtime import Engine, EngineConfig
from flashrt_ros.runtime import kernels as kernel_sets
from flashrt_ros.runtime.kernels import _triton, norms
from flashrt_ros.runtime.quant import QuantLinear
from flashrt_ros.tools.verify import prompt_tokens

needs_triton = pytest.mark.skipif(kernel_sets.triton is None or not (
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs Triton on CUDA or Triton's interpreter (TRITON_INTERPRET=1)")


@needs_triton
def test_the_kernel_set_takes_pdl_only_where_the_device_has_it_and_its_probe_passes(monkeypatch):
    """Here (the interpreter, or a GPU older than sm_90) the set stays plain and says why; where the device has it
    and the probe passes, every Triton operation is launched with it and the name (the fingerprint's) is the plain
    set's: PDL changes no byte. A failing probe keeps the plain set; the reference set never takes it."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    plain, _ = kernel_sets.select("triton", device, False, "triton")
    if _triton.pdl_unsupported(device):
        kept, reason = kernel_sets.select("triton", device, False, "triton", pdl=True)
        assert kept == plain and not kept.pdl and "no programmatic dependent launch" in reason
    monkeypatch.setattr(kernel_sets, "pdl_unsupported", lambda device: None)
    monkeypatch.setattr(kernel_sets, "_probe_triton", lambda device, case=None: None)
    launched, reason = kernel_sets.select("triton", device, False, "triton", pdl=True)
    assert launched.pdl and launched.name == plain.name and "programmatic dependent launch" in reason
    for op in kernel_sets.PDL_OPERATIONS:
        call = getattr(launched, op)
        assert isinstance(call, functools.partial) and call.func is getattr(plain, op)
        assert call.keywords == {"pdl": True}
    assert launched.attention_prefill is plain.attention_prefill and launched.delta_rule_long is plain.delta_rule_long
    assert kernel_sets.select("triton", device, False, "cublas", pdl=True)[0].dense_linear is None
    assert kernel_sets.select("reference", device, False, "triton", pdl=True)[0] is kernel_sets.REFERENCE

    monkeypatch.undo()
    monkeypatch.setattr(kernel_sets, "pdl_unsupported", lambda device: None)

    def stale(device, pdl=False):
        raise AssertionError("the probe's second norm read stale bytes")
    monkeypatch.setattr(kernel_sets, "_rms_norm_case", stale)
    kept, reason = kernel_sets.select("triton", device, False, "triton", pdl=True)
    assert not kept.pdl and kept == plain and "stale bytes" in reason


@pytest.mark.skipif(not _triton.INTERPRETED or kernel_sets.triton is None, reason="checks Triton's interpreter")
def test_the_interpreter_refuses_a_pdl_launch_by_name():
    x, scale = torch.randn(2, 64), torch.ones(64)
    with pytest.raises(RuntimeError, match="programmatic dependent launch needs compiled kernels"):
        norms.rms_norm_triton(x, scale, 1e-6, pdl=True)
    assert _triton.pdl_launch(False) == {"PDL": False}


def _decode(engine: Engine, prompt: list[int], tokens: int) -> tuple[list[int], torch.Tensor]:
    engine.reset()
    engine.ingest(prompt)
    out = list(engine.generate(tokens, stop_token_ids=()))
    return out, engine.live_bytes().cpu()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dense_gemv,weights_format,dtype", [
    ("cublas", "dense", "bfloat16"), ("triton", "dense", "bfloat16"), ("triton", "dense", "float32"),
    ("cublas", "fp8", "bfloat16"), ("cublas", "nvfp4", "bfloat16")])
def test_gpu_pdl_decodes_the_same_tokens_and_bytes_as_plain_launches(dense_gemv, weights_format, dtype):
    """Many graph replays (prefill pieces, then decode steps that each chain dozens of PDL launches, the quantized
    GEMVs' too): a kernel that read or wrote before its wait would race its predecessor and, sooner or later,
    change a byte."""
    if _triton.pdl_unsupported(torch.device("cuda")):
        pytest.skip(_triton.pdl_unsupported(torch.device("cuda")))
    config = EngineConfig(device="cuda", dtype=dtype, max_context=1024, kernels="triton", dense_gemv=dense_gemv,
                          weights_format=weights_format)
    plain, launched = Engine(config), Engine(dataclasses.replace(config, pdl=True))
    assert launched.kernels.pdl and not plain.kernels.pdl and launched.fingerprint == plain.fingerprint
    prompt = prompt_tokens(plain.vocab_size, 300, "pdl-prompt")
    tokens, state = _decode(launched, prompt, 200)
    want_tokens, want_state = _decode(plain, prompt, 200)
    assert tokens == want_tokens and torch.equal(state, want_state)


def test_binding_a_pdl_kernel_set_launches_the_quantized_projections_with_it_too():
    """The quantized GEMVs are the model's modules, not the kernel set's functions: bind hands them its ``pdl``."""
    engine = Engine(EngineConfig(weights_format="nvfp4"))
    layers = [m for m in engine.model.modules() if isinstance(m, QuantLinear)]
    assert layers and not any(m.pdl for m in layers)
    engine.model.bind(engine.arena, kernel_sets.with_pdl(kernel_sets.TRITON))
    assert all(m.pdl for m in layers)
    engine.model.bind(engine.arena, kernel_sets.TRITON)
    assert not any(m.pdl for m in layers)
