"""bench-image-ttft runs end to end on tiny-vl (HF's tower of its shape as ``model.visual``) and refuses a model
without a tower with a clear error."""
import json

import hf_vision as hv
from flashrt_ros.runtime import Engine, EngineConfig
from flashrt_ros.tools import bench_image_ttft, cli


def test_cold_and_capsule_paths_are_timed_and_agree():
    engine = Engine(EngineConfig(model="tiny-vl", max_context=256, image_min_pixels=1))
    engine.model.visual = hv.preset_tower(engine.model_config.vision)
    result = bench_image_ttft.run(engine, bench_image_ttft.random_image(engine, 4, 6), repeats=2)
    assert result["image_tokens"] == 6 and result["same_first_token"]
    assert result["prompt_positions"] == len(engine.tokenizer.encode(bench_image_ttft.PREAMBLE)) + 8 + \
        result["question_tokens"]
    for key in ("cold_ms", "from_capsule_ms", "tower_ms"):
        assert result[key]["n"] == 2 and result[key]["p50"] > 0
    assert engine.capsules() == []                       # the bench's capsule is dropped
    assert "speedup (p50)" in bench_image_ttft.markdown(result)


def test_a_model_without_a_tower_is_refused(capsys):
    assert cli.main(["bench-image-ttft", "--model", "tiny", "--max-context", "256", "--repeats", "1"]) == 2
    out = json.loads(capsys.readouterr().out)
    assert out["error"] == "INVALID_ARGUMENT" and "no vision tower" in out["message"]
