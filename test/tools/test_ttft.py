"""Cold and capsule TTFT are defined once (flashrt_ros/tools/ttft.py) and `bench` and `bench-quant` both use it."""
import pytest

from flashrt_ros.runtime.engine import Engine, EngineConfig
from flashrt_ros.tools import ttft
from flashrt_ros.tools.cli import main
from flashrt_ros.tools.verify import prompt_tokens


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(max_context=256, prefill_chunk=128))


def test_cold_ttft_is_a_prefill_from_empty_at_the_engines_chunk(engine):
    prompt = prompt_tokens(engine.vocab_size, 150, "ttft")
    cold = ttft.cold_ttft(engine, prompt, repeats=2)
    engine.reset()
    engine.ingest(prompt)
    assert cold["cold_first_token"] == engine.peek_token()
    assert (cold["cold_prompt_tokens"], cold["prefill_chunk"]) == (150, 128) and cold["cold_ttft_ms"] > 0


def test_capsule_ttft_phases_and_host_overhead_add_up_to_its_wall_time(engine):
    prefix, suffix = prompt_tokens(engine.vocab_size, 128, "p"), prompt_tokens(engine.vocab_size, 24, "s")
    engine.reset()
    engine.ingest(prefix)
    engine.snapshot("ttft-prefix")
    token, times = ttft._capsule_ttft_once(engine, "ttft-prefix", suffix)
    parts = [times[f"{p}_ms"] for p in ttft.PHASES]
    assert all(t > 0 for t in parts) and times["host_overhead_ms"] >= 0
    assert sum(parts) + times["host_overhead_ms"] == pytest.approx(times["total_ms"])
    result = ttft.capsule_ttft(engine, "ttft-prefix", suffix, repeats=3)
    assert result["capsule_first_token"] == token == ttft.cold_ttft(engine, prefix + suffix, 1)["cold_first_token"]
    assert set(result) == {"capsule_ttft_ms", "capsule_ttft_restore_ms", "capsule_ttft_suffix_prefill_ms",
                           "capsule_ttft_first_token_ms", "capsule_ttft_host_overhead_ms", "capsule_first_token"}
    assert engine.position == 128 + 24                      # left at the capsule plus the suffix
    engine.drop("ttft-prefix")


def test_bench_and_bench_quant_report_cold_ttft_at_the_same_prefill_chunk(capsys):
    assert main(["bench", "--contexts", "64", "--repeats", "1", "--decode-tokens", "2"]) == 0
    assert main(["bench-quant", "--formats", "dense", "--context", "16", "--decode-tokens", "2", "--prefill-tokens",
                 "64", "--fidelity-tokens", "2", "--repeats", "1"]) == 0
    import json
    bench, quant = (json.loads(line) for line in capsys.readouterr().out.splitlines()[-2:])
    row, dense = bench["rows"][0], quant["formats"][0]
    assert row["prefill_chunk"] == dense["prefill_chunk"] == ttft.BENCH_PREFILL_CHUNK
    assert row["cold_prompt_tokens"] == 64 + 24 and dense["cold_prompt_tokens"] == 64
    assert row["capsule_ttft_restore_ms"] > 0 and row["capsule_ttft_suffix_prefill_ms"] > 0
