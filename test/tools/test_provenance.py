"""Every benchmark result says where it came from: commit (an override for copied trees), date, host, device,
versions and the command; bench/h200.sh files one run's results under <card>_<commit>/."""
import json
import os
import pathlib
import subprocess

from flashrt_ros.tools import provenance
from flashrt_ros.tools.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHA = "0123456789abcdef0123456789abcdef01234567"


def _head() -> str:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_the_commit_comes_from_the_environment_when_set_else_from_this_checkout():
    assert provenance.git_state({provenance.COMMIT_ENV: SHA}) == {"commit": SHA, "dirty": False,
                                                                  "commit_source": "env"}
    assert provenance.git_state({provenance.COMMIT_ENV: SHA + "-dirty\n"})["dirty"] is True
    from_git = provenance.git_state({})
    assert from_git["commit"] == _head() and from_git["commit_source"] == "git"
    assert isinstance(from_git["dirty"], bool)


def test_a_cpu_result_names_the_cpu_the_versions_and_the_command():
    block = provenance.collect("cpu", argv=["python3", "-m", "flashrt_ros.tools", "bench", "--model", "a b"],
                               environ={provenance.COMMIT_ENV: SHA})
    assert block["commit"] == SHA and block["device_type"] == "cpu" and block["device_name"]
    assert block["command"] == "python3 -m flashrt_ros.tools bench --model 'a b'"
    assert block["versions"]["torch"].startswith("2.") and "triton" in block["versions"]
    assert block["date_utc"].endswith("+00:00") and block["host"]


def test_a_bench_subcommand_writes_its_provenance_into_its_json(tmp_path, monkeypatch):
    monkeypatch.setenv(provenance.COMMIT_ENV, SHA)
    out = tmp_path / "bench.json"
    assert main(["bench-constraint", "--decode-tokens", "4", "--repeats", "1", "--out", str(out)]) == 0
    written = json.loads(out.read_text())["provenance"]
    assert written["commit"] == SHA and written["commit_source"] == "env" and written["device_type"] == "cpu"


def _run_h200(tmp_path, env_extra, commit_file=None):
    """bench/h200.sh with no phase, a fake nvidia-smi naming an H100, in a scratch tree."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 550.54.15, 81559 MiB, 1980 MHz, 1980 MHz'\n")
    smi.chmod(0o755)
    (tmp_path / "bench").mkdir()
    if commit_file is not None:
        (tmp_path / "bench" / "gpu_commit.txt").write_text(commit_file)
    env = {k: v for k, v in os.environ.items() if k != provenance.COMMIT_ENV}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", OUT=str(tmp_path / "out"), **env_extra)
    return subprocess.run(["bash", str(ROOT / "bench" / "h200.sh")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)


def test_h200_script_refuses_to_run_without_a_commit(tmp_path):
    done = _run_h200(tmp_path, {})
    assert done.returncode == 2 and "gpu_commit.txt" in done.stderr
    assert not (tmp_path / "out").exists()


def test_h200_script_files_the_run_under_card_and_commit(tmp_path):
    _run_h200(tmp_path, {}, commit_file=SHA + "-dirty\n")
    run = tmp_path / "out" / "h100_0123456-dirty"
    assert f"commit {SHA}-dirty" in (run / "gpu.txt").read_text()
