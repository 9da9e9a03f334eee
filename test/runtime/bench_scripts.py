"""The scripts of bench/ as modules, for tests that call their functions (bench/ is no package)."""
import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load(name: str):
    """bench/<name>.py, imported under ``name``."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
