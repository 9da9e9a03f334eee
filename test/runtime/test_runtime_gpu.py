"""CUDA-only checks: graphs vs eager, fused (Triton) vs reference kernels, fla vs reference, CuPy vs torch checksum,
capsules in bf16 on every kernel set."""
import pytest
import torch

from flashrt_ros.runtime import Engine, EngineConfig, kernels
from flashrt_ros.runtime.checksum import checksum_torch
from flashrt_ros.tools.verify import prompt_tokens, verify

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


def test_a_stream_has_each_token_while_its_forward_runs_and_sees_the_state_after_it():
    """The plain plan releases a token once it is picked (Engine._plain_step): the host has it while the device
    still runs the forward over it, and an operation after the yield (a snapshot) is ordered after that forward, so
    it holds the state after the token: the capsule bytes of a stream synchronised after every token."""
    prompt = prompt_tokens(512, 157, "gpu-prompt")
    released, synced = (Engine(EngineConfig(device="cuda", max_context=512)) for _ in range(2))
    stream, busy = torch.cuda.current_stream(), []
    for engine in (released, synced):
        engine.ingest(prompt)
    for n, _ in enumerate(released.generate(12, stop_token_ids=())):
        busy.append(not stream.query())
        released.snapshot(f"t{n}")
    for n, _ in enumerate(synced.generate(12, stop_token_ids=())):
        torch.cuda.synchronize()
        synced.snapshot(f"t{n}")
    assert sum(busy) >= 9, busy          # a descheduled host may find a forward done now and then
    for n in range(12):
        assert torch.equal(released.capsule_bytes(f"t{n}"), synced.capsule_bytes(f"t{n}")), n


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
    parts = [data[:1001], data[1001:1001], data[1001:5_000_002], data[5_000_002:]]   # odd lengths, word offsets
    assert cupy_checksum(parts) == cupy_checksum(data) == checksum_torch([p.cpu() for p in parts])


@pytest.mark.parametrize("kernel_set", KERNEL_SETS)
@pytest.mark.parametrize("prefill_chunk", [64, 1024])
def test_verify_bf16_capsules(kernel_set, prefill_chunk):
    engine = Engine(EngineConfig(device="cuda", dtype="bfloat16", max_context=2048, prefill_chunk=prefill_chunk,
                                 kernels=kernel_set))
    assert engine.kernel_name.startswith(kernel_set)
    report = verify(engine, prefix_len=1024, suffix_len=24, gen=32, kv_only=True)
    assert report["byte_exact"] and report["token_identical"], report
    assert report["kv_only_first_divergence"] is not None, "restoring only the KV cache should diverge"


def _teacher_forced(engine: Engine, prompt: list[int], steps: int) -> torch.Tensor:
    """Next-token logits after the prompt (a long piece, then a padded small piece) and after each of ``steps``
    teacher-forced decode-sized pieces, float64 [steps + 1, vocab]."""
    engine.reset()
    engine.ingest(prompt)
    logits = [engine.next_token_logits()]
    for token in prompt[:steps]:
        engine.ingest([token])
        logits.append(engine.next_token_logits())
    return torch.stack(logits).double()


def _fp32_oracle(preset: str, source: Engine, **config) -> Engine:
    """The reference kernels in fp32 (no fla-core, no graphs) on ``source``'s weights, bf16 values and all."""
    oracle = Engine(EngineConfig(model=preset, device="cuda", dtype="float32", kernels="reference", use_fla=False,
                                 cuda_graphs=False, **config))
    weights = dict(source.model.named_parameters())
    with torch.no_grad():
        for name, param in oracle.model.named_parameters():
            param.copy_(weights[name])
    oracle.model.bind(oracle.arena, oracle.kernels)         # norm scales from the copied weights
    return oracle


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


FUSED_CONFIG = dict(max_context=2048, prefill_chunk=1024)
FUSED_PROMPT, FUSED_STEPS = 1024 + 37, 4


def test_fused_kernels_match_the_reference_engine_in_fp32():
    """fp32, tiny model: both kernel sets compute the same function to fp32 rounding, through a long piece, a padded
    small piece and decode steps."""
    prompt = prompt_tokens(512, FUSED_PROMPT, "gpu-fused")
    logits = {}
    for kernel_set in KERNEL_SETS:
        engine = Engine(EngineConfig(model="tiny", device="cuda", dtype="float32", kernels=kernel_set, **FUSED_CONFIG))
        logits[kernel_set] = _teacher_forced(engine, prompt, FUSED_STEPS)
    error = _relative(logits["triton"], logits["reference"])
    assert error < 1e-4, f"fused vs reference logits: relative error {error:.3g}"
    assert torch.equal(logits["triton"].argmax(-1), logits["reference"].argmax(-1))


# bf16: the fused set's error against the fp32 oracle may exceed the reference set's by this factor plus this floor.
DRIFT_RATIO, DRIFT_FLOOR = 1.5, 0.01
DRIFT_STEPS = 16


def test_fused_kernels_in_bf16_are_as_accurate_as_the_reference_kernels():
    """Qwen3.5-0.8B (24 layers, seeded random weights) in bf16, the prompt above, then DRIFT_STEPS teacher-forced
    decode steps: each kernel set is compared with an fp32 run of the reference kernels on the same (bf16-valued)
    weights. Two bf16 runs that round at different points drift apart through the layers, so comparing them with each
    other says nothing about which is wrong. The requirement is that the fused set is no less accurate than the
    reference set.

    Measured (relative L2 of the stacked logits; the reference's fp32 run is the oracle):
    - H200, triton 3.6.0, 4 steps: fused bf16 vs reference bf16 0.081 (the old test's failure, bound 0.03).
    - CPU, full 0.8B preset, this prompt, 4 steps, reference kernels: bf16 vs fp32 0.168 (0.149-0.188 per step),
      argmax agreement 4 of 5. The reference set alone drifts twice as far as the two sets differed on the H200.
    - CPU, Triton's interpreter, 0.8B head layout with 4 layers, vocabulary 2048, a 16 + 5-token prompt, 2 steps:
      reference bf16 vs fp32 0.0295, fused bf16 vs fp32 0.0293 (ratio 0.996), fused vs reference 0.0120; fused fp32
      vs reference fp32 1.9e-6; argmax agreement 3 of 3 for both.
    - Kernel by kernel (test_kernels_*, against float64), the fused bf16 kernels are at least as accurate as the
      references: delta rule 3.0e-3 vs 3.9e-3; attention decode with fp32 scores where the reference rounds them to
      bf16; the norms, conv, SiLU and RoPE round where the references do.
    - H200 at 98fafab, 16 steps: relative error 0.1656 (reference) and 0.1633 (fused); argmax agreement with fp32
      10 of 17 and 7 of 17. At errors of this size near-tied winners flip on some rows, on different rows for the
      two sets, so an agreement fraction says nothing about a defect (a bound of 0.5 failed by 2 rows there).
    So DRIFT_RATIO allows 50% more than the reference's error (0.996x was measured), and the floor covers a reference
    error near zero. Greedy tokens are checked only where they cannot flip by rounding: rows whose oracle winner leads
    by more than twice the reference set's largest logit error on that row. The errors and the number of such rows
    are printed (pytest -s / -rP) and are in the failure message."""
    preset = "qwen3.5-0.8b"
    prompt = prompt_tokens(248_320, FUSED_PROMPT, "gpu-fused")
    logits, engines = {}, {}
    for kernel_set in KERNEL_SETS:
        engines[kernel_set] = Engine(EngineConfig(model=preset, device="cuda", dtype="bfloat16", kernels=kernel_set,
                                                  **FUSED_CONFIG))
        logits[kernel_set] = _teacher_forced(engines[kernel_set], prompt, DRIFT_STEPS)
    oracle = _fp32_oracle(preset, engines["reference"], **FUSED_CONFIG)
    del engines
    torch.cuda.empty_cache()
    want = _teacher_forced(oracle, prompt, DRIFT_STEPS)
    errors = {name: _relative(got, want) for name, got in logits.items()}
    agree = {name: (got.argmax(-1) == want.argmax(-1)).double().mean().item() for name, got in logits.items()}
    # Rows where the oracle's winner leads by more than twice the reference set's largest error on that row: no
    # rounding of the reference's size can flip them, so the fused set must pick the oracle's token there.
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * (logits["reference"] - want).abs().amax(-1)
    flipped = (clear & (logits["triton"].argmax(-1) != want.argmax(-1))).sum().item()
    report = (f"relative logits error vs fp32: {errors}; fused vs reference "
              f"{_relative(logits['triton'], logits['reference']):.3g}; argmax agreement with fp32: {agree}; "
              f"clear-winner rows {clear.sum().item()} of {len(clear)}, flipped by the fused set {flipped}")
    print(report)
    assert errors["triton"] <= DRIFT_RATIO * errors["reference"] + DRIFT_FLOOR, report
    assert flipped == 0, report
