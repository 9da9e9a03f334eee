"""Fixtures of the runtime tests."""
from pathlib import Path

import pytest

import bench_scripts


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> tuple[Path, dict]:
    """A small Qwen3.5-layout model with its MTP head, trained here by bench/train_tiny_lm.py (once per session: the
    weight-format fidelity and the speculative-decoding tests share it). Returns its folder and training record."""
    folder = tmp_path_factory.mktemp("trained") / "lm"
    record = bench_scripts.load("train_tiny_lm").build(
        folder, steps=150, hidden=64, layers=4, heads=4, head_dim=16, vocab=320, batch=16, seq_len=64, lr=3e-3,
        corpus_chars=400_000, heldout=0.02, seed=0)
    return folder, record
