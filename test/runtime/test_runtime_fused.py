"""The fused (Triton) kernel set end to end: chosen by the start-up probe, recorded in the fingerprint, and on the
CPU run through Triton's interpreter (test/conftest.py sets TRITON_INTERPRET=1 there), where it must agree with the
reference kernel set and keep capsules byte-exact and continuations token-identical.

The interpreter runs every program instance in Python, so these tests keep to short prompts and pieces of at most
16 tokens (buckets 8 and 16) and a few decode steps; long eager pieces are covered on the GPU
(test_runtime_gpu.py) and each kernel at many shapes by the kernel tests."""
import pytest
import torch

from capsule_helpers import plant_foreign_capsule
from flashrt_ros.runtime import Engine, EngineConfig, FlashRTError, kernels
from flashrt_ros.runtime.errors import ErrorCode
from flashrt_ros.tools.verify import prompt_tokens, verify

needs_triton = pytest.mark.skipif(kernels.triton is None, reason="triton is not installed")


def _engine(kernel_set: str, **overrides) -> Engine:
    config = dict(model="tiny", max_context=96, prefill_chunk=16, capsule_budget_bytes=32 << 20,
                  kernels=kernel_set)
    return Engine(EngineConfig(**{**config, **overrides}))


@pytest.fixture(scope="module")
def fused():
    return _engine("triton")


@pytest.fixture(scope="module")
def reference():
    return _engine("reference")


@needs_triton
def test_the_fused_set_is_chosen_and_named(fused, reference):
    assert fused.kernel_name == "triton" and reference.kernel_name == "reference"
    assert fused.stats()["kernel"] == "triton" and "probe passed" in fused.stats()["kernel_reason"]
    assert fused.fingerprint != reference.fingerprint


@needs_triton
def test_fused_logits_match_the_reference_through_every_path(fused, reference):
    """Full pieces (16), a padded small piece (5 -> bucket 8), single-token pieces and decode steps."""
    prompt = prompt_tokens(fused.vocab_size, 16 + 5, "fused-parity")
    for engine in (fused, reference):
        engine.reset()
        engine.ingest(prompt)
    pairs = [(fused.next_token_logits(), reference.next_token_logits())]
    for token in prompt[:2]:
        for engine in (fused, reference):
            engine.ingest([token])
        pairs.append((fused.next_token_logits(), reference.next_token_logits()))
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    decoded = [list(e.generate(3, stop_token_ids=())) for e in (fused, reference)]
    assert decoded[0] == decoded[1]


@needs_triton
def test_capsules_are_byte_exact_and_continuations_token_identical_on_the_fused_path(fused):
    report = verify(fused, prefix_len=16, suffix_len=5, gen=3, kv_only=True)
    assert report["byte_exact"] and report["token_identical"], report
    assert report["kv_only_first_divergence"] is not None


@needs_triton
def test_a_capsule_of_one_kernel_set_is_refused_by_the_other(fused, reference):
    fused.reset()
    fused.ingest(prompt_tokens(fused.vocab_size, 8, "cross"))
    fused.snapshot(capsule_id="from-fused")
    reference.reset()
    reference.ingest(prompt_tokens(reference.vocab_size, 3, "live"))
    before = reference.live_bytes()
    plant_foreign_capsule(reference, fused, "from-fused")
    fused.drop("from-fused")
    with pytest.raises(FlashRTError) as err:
        reference.restore("from-fused")
    assert err.value.code == ErrorCode.FINGERPRINT_MISMATCH
    assert torch.equal(reference.live_bytes(), before)
    reference.drop("from-fused")


def test_auto_falls_back_to_the_reference_with_the_reason(monkeypatch):
    monkeypatch.setattr(kernels, "_probe_triton", lambda device: "triton probe failed: ptxas cannot build sm_110a")
    chosen, reason = kernels.select("auto", torch.device("cuda"), use_fla=False)   # the probe never runs here
    assert chosen is kernels.REFERENCE and "sm_110a" in reason
    with pytest.raises(RuntimeError, match="sm_110a"):
        kernels.select("triton", torch.device("cuda"), use_fla=False)


def test_an_unknown_kernel_set_is_refused_before_anything_is_built():
    with pytest.raises(FlashRTError) as err:
        Engine(EngineConfig(model="tiny", kernels="fastest"))
    assert err.value.code == ErrorCode.INVALID_ARGUMENT and "kernels" in str(err.value)
