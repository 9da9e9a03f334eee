"""The ~/observation QoS settings agree wherever they are stated: params.py's defaults, both shipped parameter
files and the README's parameter table. (default.yaml and thor.yaml said depth 10 while params.py and the README
said 1000: with 10, 470 of 500 observations of a burst vanished.)"""
from pathlib import Path

import pytest
import yaml

from flashrt_ros.params import PARAMETERS

ROOT = Path(__file__).resolve().parents[2]
OBSERVATION_QOS = [name for name, *_ in PARAMETERS if name.startswith("qos.observation.")]


def readme_default(name: str) -> str:
    rows = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith(f"| `{name}` |")]
    assert len(rows) == 1, f"one README parameter row for {name}"
    return rows[0].split("|")[2].strip().strip("`")


@pytest.mark.parametrize("file", ["default.yaml", "thor.yaml"])
def test_parameter_files_use_the_declared_observation_qos(file):
    observation = yaml.safe_load((ROOT / "config" / file).read_text())["/**"]["ros__parameters"]["qos"]["observation"]
    defaults = {name: default for name, default, *_ in PARAMETERS}
    assert {f"qos.observation.{k}": v for k, v in observation.items()} == {n: defaults[n] for n in OBSERVATION_QOS}


def test_readme_states_the_declared_observation_qos():
    defaults = {name: default for name, default, *_ in PARAMETERS}
    assert OBSERVATION_QOS and {n: readme_default(n) for n in OBSERVATION_QOS} == {
        n: str(defaults[n]) for n in OBSERVATION_QOS}

