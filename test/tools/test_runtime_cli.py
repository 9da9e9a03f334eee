"""The flashrt-runtime command line: generate, verify, bench and plan print JSON and exit with meaningful codes."""
import json
from pathlib import Path

import pytest
import yaml

from flashrt_ros.runtime import Engine, EngineConfig
from flashrt_ros.runtime.config import PRESETS
from flashrt_ros.runtime.vision.preprocess import resized_size
from flashrt_ros.tools.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, json.loads(captured.out), captured.err


def test_generate_matches_the_engine_and_reports_timings(capsys):
    code, out, _ = run(capsys, "generate", "--model", "tiny", "--prompt", "pick up the cup", "--max-new-tokens", "6")
    assert code == 0
    engine = Engine(EngineConfig(max_context=4096))
    engine.ingest(engine.tokenizer.encode("pick up the cup"))
    assert out["tokens"] == list(engine.generate(6))
    assert out["text"] == engine.tokenizer.decode(out["tokens"])
    assert out["ttft_ms"] > 0 and out["prompt_tokens"] == len("pick up the cup")


def test_seeded_sampling_is_reproducible_and_seed_dependent(capsys):
    args = ("generate", "--prompt-ids", "1,2,3,4", "--max-new-tokens", "12", "--temperature", "1.0")
    first = run(capsys, *args, "--seed", "7")
    again = run(capsys, *args, "--seed", "7")
    other = run(capsys, *args, "--seed", "8")
    assert first[1]["tokens"] == again[1]["tokens"]
    assert first[1]["tokens"] != other[1]["tokens"]


@pytest.mark.parametrize("argv, error", [
    (("generate", "--prompt-ids", "1,2,999999", "--max-new-tokens", "1"), "TOKEN_OUT_OF_RANGE"),
    (("generate", "--prompt", "x" * 300, "--max-context", "256", "--max-new-tokens", "1"), "CONTEXT_OVERFLOW"),
    (("generate", "--model", "/nonexistent/model", "--prompt", "x"), "LOAD_FAILED"),
])
def test_bad_requests_exit_2_with_a_json_error(capsys, argv, error):
    code, out, _ = run(capsys, *argv)
    assert code == 2
    assert out["error"] == error and out["message"]


def test_verify_reports_the_papers_checks(capsys):
    code, out, _ = run(capsys, "verify", "--prefix-len", "64", "--suffix-len", "8", "--gen", "12", "--kv-only")
    assert code == 0
    assert out["byte_exact"] and out["token_identical"] and out["a_eq_c"] and out["d1_eq_d2"]
    assert out["kv_only_first_divergence"] is not None
    assert out["kv_only_tokens"] != out["tokens_a"]
    assert out["capsule_bytes"] > 0 and out["restore_ms"] > 0


def test_bench_writes_rows_with_consistent_ratios(capsys, tmp_path):
    target = tmp_path / "bench.json"
    code, out, table = run(capsys, "bench", "--contexts", "128", "--repeats", "3", "--decode-tokens", "4",
                    "--out", str(target))
    assert code == 0
    assert json.loads(target.read_text()) == out
    row = out["rows"][0]
    engine = Engine(EngineConfig(max_context=128 + 24 + 4 + 8))
    assert row["capsule_bytes"] == engine.arena.live_nbytes(128)
    assert row["restore_over_floor"] == pytest.approx(row["restore_p50_ms"] / row["copy_floor_p50_ms"])
    assert row["ttft_speedup"] == pytest.approx(row["cold_ttft_ms"] / row["capsule_ttft_ms"])
    for op in ("fork", "rollback_step", "rollback_capsule"):
        assert 0 < row[f"{op}_p50_ms"] <= row[f"{op}_p99_ms"], op
    assert table.startswith("| context |")


def test_bench_compares_a_model_with_a_vision_tower_against_hfs_text_model(capsys):
    """The HF oracle of ``--compare-hf`` is the text model: the tower's weights stay out of it (they made its
    strict state-dict load fail on every multimodal preset)."""
    code, out, _ = run(capsys, "bench", "--model", "tiny-vl", "--contexts", "64", "--repeats", "3",
                       "--decode-tokens", "4", "--compare-hf")
    assert code == 0, out
    row = out["rows"][0]
    assert row["hf_cold_ttft_ms"] > 0 and row["cold_ttft_over_hf"] == pytest.approx(
        row["cold_ttft_ms"] / row["hf_cold_ttft_ms"])


# ---- plan: will it fit? --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["tiny", "tiny-vl"])
@pytest.mark.parametrize("fmt", ["dense", "fp8", "nvfp4"])
def test_plan_counts_the_bytes_a_load_allocates(capsys, fmt, preset):
    """The plan's weights and arena are what loading a tiny preset really allocates (from shapes, nothing loaded),
    its vision tower included (dense in every format)."""
    code, out, table = run(capsys, "plan", "--presets", preset, "--formats", fmt, "--dtype", "float32",
                           "--max-context", "256", "--capsule-budget-mb", "16", "--history-depth", "4",
                           "--memory-gb", "0.01")
    row = out["rows"][0]
    engine = Engine(EngineConfig(model=preset, weights_format=fmt, max_context=256, history_depth=4))
    assert code == 0 and f"| {preset} | {fmt}" in table
    assert row["weights_bytes"] == sum(p.numel() * p.element_size() for p in engine.model.parameters())
    assert row["arena_bytes"] == engine.arena_bytes
    assert row["history_bytes"] == engine._history.numel()
    assert row["total_bytes"] == row["weights_bytes"] + row["arena_bytes"] + row["history_bytes"] + (16 << 20)
    assert row["fits"] == (row["total_bytes"] <= 10**7)


def test_thor_profile_fits_128_gb_with_room_for_the_rest_of_the_robot(capsys):
    """config/thor.yaml's model, format, context, capsule budget and rollback depth: the engine takes under 15% of
    Thor's 128 GB, leaving over 100 GB to the OS, perception and planning (what the file's comments promise)."""
    params = yaml.safe_load((Path(__file__).resolve().parents[2] / "config" / "thor.yaml").read_text())
    p = params["/**"]["ros__parameters"]
    preset = Path(p["model"]).name.lower()                  # /opt/flashrt/models/Qwen3.5-2B -> the qwen3.5-2b preset
    code, out, _ = run(capsys, "plan", "--presets", preset, "--formats", p["weights_format"], "--dtype", p["dtype"],
                       "--max-context", str(p["max_context"]), "--capsule-budget-mb", str(p["capsule_budget_mb"]),
                       "--history-depth", str(p["history_depth"]), "--weights-exclude", p["weights_exclude"])
    row = out["rows"][0]
    assert code == 0 and out["memory_gb"] == 128 and row["fits"]
    assert row["total_bytes"] < 0.15 * row["memory_bytes"] and row["left_bytes"] > 100 * 10**9, row


# ---- bench-vision --------------------------------------------------------------------------------------------------
def test_bench_vision_reports_each_resolution(capsys, tmp_path):
    target = tmp_path / "vision.json"
    code, out, table = run(capsys, "bench-vision", "--model", "tiny-vl", "--resolutions", "40x60,100x30",
                           "--repeats", "2", "--min-pixels", "1024", "--max-pixels", "8192", "--out", str(target))
    assert code == 0 and json.loads(target.read_text()) == out and table.startswith("| camera |")
    vision = PRESETS["tiny-vl"].vision
    for row, (height, width) in zip(out["rows"], [(40, 60), (100, 30)]):
        resized = resized_size(height, width, vision, 1024, 8192)
        assert (row["height"], row["width"], tuple(row["resized"])) == (height, width, resized)
        assert row["patches"] == resized[0] * resized[1] // 16 ** 2 == 4 * row["tokens"]
        assert row["preprocess_ms"] > 0 and row["encoder_ms"] > 0


@pytest.mark.parametrize("argv, error", [(("--model", "tiny"), "INVALID_ARGUMENT"),
                                         (("--resolutions", "640"), "INVALID_ARGUMENT")])
def test_bench_vision_refuses_what_it_cannot_run(capsys, argv, error):
    code, out, _ = run(capsys, "bench-vision", "--repeats", "1", *argv)
    assert code == 2 and out["error"] == error
