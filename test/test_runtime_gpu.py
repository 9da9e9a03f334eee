"""CUDA-only checks: graphs vs eager, fused (Triton) vs reference kernels, fla vs reference, CuPy vs torch checksum,
capsules in bf16 on every kernel set."""
import pytest
import torch

from flashrt_ros.runtime import Engine, EngineConfig, kernels
from flashrt_ros.runtime.checksum import checksum_torch
from flashrt_ros.runtime.verify import prompt_tokens, verify

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _run(engine, prompt, gen):
    engine.reset()
    engine.ingest(prompt)
    tokens = list(engine.generate(gen, stop_token_ids=()))
    return tokens, engine.live_bytes().cpu()


KERNEL_SETS = ["reference", "triton"]


@pytest.mark.parametrize("kernel_set", KERNEL_SETS)
def test_graph_replay_equals_eager_bytes_and_tokens(kernel_set):
    prompt = prompt_tokens(512, 157, "gpu-prompt")
    graphed = Engine(EngineConfig(device="cuda", max_context=512, cuda_graphs=True, kernels=kernel_set))
    eager = Engine(EngineConfig(device="cuda", max_context=512, cuda_graphs=False, kernels=kernel_set))
    assert graphed.graphs.graphs and not eager.graphs.graphs
    tokens_g, bytes_g = _run(graphed, prompt, 40)
    tokens_e, bytes_e = _run(eager, prompt, 40)
    assert tokens_g == tokens_e
    assert torch.equal(bytes_g, bytes_e)


@pytest.mark.skipif(not kernels.fla_available(), reason="fla-core is not installed")
@pytest.mark.parametrize("length", [7, 64, 200])
def test_fla_chunk_matches_reference(length):
    gen = torch.Generator(device="cuda").manual_seed(length)
    hk, hv, dk, dv = 2, 4, 64, 64
    q = torch.randn(length, hk, dk, device="cuda", generator=gen)
    k = torch.randn(length, hk, dk, device="cuda", generator=gen)
    v = torch.randn(length, hv, dv, device="cuda", generator=gen)
    g = -torch.rand(length, hv, device="cuda", generator=gen)
    beta = torch.rand(length, hv, device="cuda", generator=gen)
    s0 = torch.randn(hv, dk, dv, device="cuda", generator=gen) * 0.1
    s_ref, s_fla = s0.clone(), s0.clone()
    out_ref = kernels.delta_rule_chunked(q, k, v, g, beta, s_ref)
    out_fla = kernels.delta_rule_fla(q, k, v, g, beta, s_fla)
    assert (out_fla - out_ref).norm() / out_ref.norm() < 5e-3
    assert (s_fla - s_ref).norm() / s_ref.norm() < 5e-3


def test_cupy_checksum_matches_torch():
    cupy_checksum = pytest.importorskip("flashrt_ros.runtime.checksum").checksum_cupy
    from flashrt_ros.runtime import checksum as mod
    if mod._cupy_kernel is None:
        pytest.skip("cupy is not installed")
    data = torch.randint(0, 256, (10_000_003,), dtype=torch.uint8, device="cuda")
    assert cupy_checksum(data) == checksum_torch(data) == checksum_torch(data.cpu())


@pytest.mark.parametrize("kernel_set", KERNEL_SETS)
@pytest.mark.parametrize("prefill_chunk", [64, 1024])
def test_verify_bf16_capsules(kernel_set, prefill_chunk):
    engine = Engine(EngineConfig(device="cuda", dtype="bfloat16", max_context=2048, prefill_chunk=prefill_chunk,
                                 kernels=kernel_set))
    assert engine.kernel_name.startswith(kernel_set)
    report = verify(engine, prefix_len=1024, suffix_len=24, gen=32, kv_only=True)
    assert report["byte_exact"] and report["token_identical"], report
    assert report["kv_only_first_divergence"] is not None, "restoring only the KV cache should diverge"


@pytest.mark.parametrize("preset,dtype,tolerance", [("tiny", "float32", 1e-4), ("qwen3.5-0.8b", "bfloat16", 3e-2)])
def test_fused_kernels_match_the_reference_engine(preset, dtype, tolerance):
    """The same weights and prompt through both kernel sets: next-token logits after a long piece, a padded small
    piece and decode steps agree within the dtype's tolerance."""
    prompt = prompt_tokens(512 if preset == "tiny" else 248_320, 1024 + 37, "gpu-fused")
    logits = {}
    for kernel_set in KERNEL_SETS:
        engine = Engine(EngineConfig(model=preset, device="cuda", dtype=dtype, max_context=2048,
                                     prefill_chunk=1024, kernels=kernel_set))
        engine.ingest(prompt)
        steps = [engine.next_token_logits()]
        for token in prompt[:4]:                 # teacher-forced decode-sized pieces
            engine.ingest([token])
            steps.append(engine.next_token_logits())
        logits[kernel_set] = torch.stack(steps).double()
        del engine
        torch.cuda.empty_cache()
    ref, fused = logits["reference"], logits["triton"]
    assert ((fused - ref).norm() / ref.norm()).item() < tolerance
    assert torch.equal(fused.argmax(-1), ref.argmax(-1))
