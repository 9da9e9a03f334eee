"""Self-speculative decoding on CUDA: the captured STEP_ROWS-row steps with the Triton rows kernels (conv and delta
rule writing every row's state) and the carried pick, against the oracle of test_speculative.py (the same plan fed
one token per generate call), token for token and byte for byte, on the model trained here (its MTP head drafts
tokens the model accepts). ``FLASHRT_SPEC_MODEL`` names a folder of bench/train_tiny_lm.py to use instead of the
``trained`` fixture (bench/h200.sh sets it to the model it benchmarks: the GPU machine's transformers cannot run the
training script's MTP head)."""
import os
import pathlib

import pytest
import torch

from speculative_streams import assert_same_stream, engine, prompts, run, run_undrafted

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture
def model_folder(request) -> pathlib.Path:
    named = os.environ.get("FLASHRT_SPEC_MODEL")
    return pathlib.Path(named) if named else request.getfixturevalue("trained")[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphed_speculation_is_token_and_byte_identical_to_its_plan_without_drafts(model_folder, dtype):
    folder = model_folder
    options = dict(device="cuda", dtype=dtype, kernels="triton", cuda_graphs=True)
    oracle = engine(folder, 1, **options)
    cases = [(prompt, 40) for prompt in prompts(folder, oracle, 2, 24)] + [(prompts(folder, oracle, 1, 300)[0], 24)]
    wants = [run_undrafted(oracle, prompt, tokens) for prompt, tokens in cases]
    for k in (1, 2, 4):
        spec = engine(folder, k, **options)
        carried = []
        step = spec.stepper.step
        spec.stepper.step = lambda d, greedy, kv_len, carry=False: carried.append(carry) or step(d, greedy, kv_len,
                                                                                                 carry)
        for (prompt, tokens), want in zip(cases, wants):
            assert_same_stream(run(spec, prompt, tokens), want)
        stats = spec.speculative_stats
        assert stats.accepted > 0 and sum(carried) > len(cases), (k, stats, carried)
        # a capsule between two tokens of one step, restored: the rest is the oracle's
        prompt, tokens = cases[0]
        spec.reset()
        spec.ingest(prompt)
        stream = spec.generate(tokens, stop_token_ids=[])
        head = [next(stream) for _ in range(9)]
        spec.snapshot("mid")
        spec.restore("mid")
        assert head + list(stream) == wants[0][0]
        assert torch.equal(spec.live_bytes(), wants[0][1][-1])
