"""bench-constraint runs end to end on the tiny model and reports what it measured (no timing is asserted)."""
import json

from flashrt_ros.tools.cli import main


def test_bench_constraint_reports_decode_and_mask_per_token(tmp_path, capsys):
    out = tmp_path / "constraint.json"
    assert main(["bench-constraint", "--decode-tokens", "12", "--repeats", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["constrained_tokens"] == [12, 12]            # the open-ended schema never ends early
    assert result["decode_ms_per_token"]["constrained"]["n"] == result["decode_ms_per_token"]["unconstrained"]["n"] == 22
    assert result["mask_ms_per_token"]["n"] == 24 and result["mask_ms_per_token"]["p50"] > 0
    assert result["mask_overlapped"] is False                   # the CPU: computed between steps
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == result
