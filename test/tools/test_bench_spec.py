"""bench-spec runs end to end on the tiny preset and projects tok/s from an assumed acceptance or from another
result's measured tokens per step (no timing is asserted)."""
import json
import re

import pytest

from flashrt_ros.tools.cli import main

ARGS = ["bench-spec", "--drafts", "0,2", "--prompts", "1", "--context", "8", "--decode-tokens", "6", "--repeats", "1"]


def test_bench_spec_projects_from_an_assumed_or_a_measured_acceptance(tmp_path, capsys):
    assumed = tmp_path / "assumed.json"
    assert main([*ARGS, "--assumed-acceptance", "0.5", "--out", str(assumed)]) == 0
    first = json.loads(assumed.read_text())
    assert [r["speculative_tokens"] for r in first["rows"]] == [0, 2] and first["projection"] == "50%"
    plain, drafted = first["rows"]
    assert plain["projected_tokens_per_s"] == pytest.approx(1000.0 / plain["step_ms"])
    assert drafted["projected_tokens_per_s"] == pytest.approx(1000.0 * 1.75 / drafted["step_ms"])   # 1 + a + a^2
    printed = capsys.readouterr()
    assert "| tok/s at 50% | vs plain there |" in printed.out + printed.err
    # a trained model's measured tokens per step (here: edited into the first result) project the second run
    first["model"] = "/models/trained-lm"
    first["rows"][1]["tokens_per_step"] = 2.5
    assumed.write_text(json.dumps(first))
    measured = tmp_path / "measured.json"
    assert main([*ARGS, "--acceptance-from", str(assumed), "--out", str(measured)]) == 0
    second = json.loads(measured.read_text())
    assert second["projection"] == "trained-lm's tokens/step" and second["acceptance_from"] == str(assumed)
    plain, drafted = second["rows"]
    assert drafted["projected_tokens_per_s"] == pytest.approx(1000.0 * 2.5 / drafted["step_ms"])
    assert drafted["projected_speedup"] == pytest.approx(drafted["projected_tokens_per_s"]
                                                         / plain["projected_tokens_per_s"])


def test_bench_spec_refuses_a_projection_file_without_the_drafts_it_runs(tmp_path, capsys):
    for text, message in (("not json", "not a bench-spec result"),
                          (json.dumps({"model": "m", "rows": [{"speculative_tokens": 0, "tokens_per_step": 1.0}]}),
                           "no row for drafts \\[2\\]")):
        path = tmp_path / "bad.json"
        path.write_text(text)
        assert main([*ARGS, "--acceptance-from", str(path)]) == 2
        error = json.loads(capsys.readouterr().out.splitlines()[-1])
        assert error["error"] == "INVALID_ARGUMENT" and re.search(message, error["message"]), error


def test_bench_spec_frees_each_engine_before_building_the_next(monkeypatch):
    """Each drafts value builds its own engine; an engine sits in reference cycles, so unless the benchmark collects
    it the next one is built beside it (on a GPU: two 27B engines in 80 GB, out of memory)."""
    import weakref

    from flashrt_ros.tools import bench_spec

    alive = []

    class Counted(bench_spec.Engine):
        def __init__(self, *args, **kwargs):
            assert not [ref for ref in alive if ref() is not None], "the engine before is still alive"
            super().__init__(*args, **kwargs)
            alive.append(weakref.ref(self))

    monkeypatch.setattr(bench_spec, "Engine", Counted)
    config = bench_spec.SpecBenchConfig(engine=bench_spec.EngineConfig(model="tiny", max_context=64),
                                        drafts=(0, 1, 2), prompts=1, context=8, decode_tokens=4, repeats=1)
    assert len(bench_spec.run(config)["rows"]) == 3 and len(alive) == 3
