"""The streams the speculative-decoding tests compare (test_speculative.py on the CPU, test_speculative_gpu.py on
CUDA): a speculative engine's, and its oracle's, the same plan fed one token per generate call (no drafts)."""
import torch

from flashrt_ros.runtime import Engine, EngineConfig
from flashrt_ros.runtime.engine import SPECULATIVE_PLAN_VERSION


def engine(folder, k: int, **overrides) -> Engine:
    return Engine(EngineConfig(model=str(folder), speculative_tokens=k, max_context=512, **overrides))


def prompts(folder, engine_: Engine, count: int, length: int) -> list[list[int]]:
    text = (folder / "heldout.txt").read_text(encoding="utf-8")
    ids = engine_.tokenizer.encode(text)
    return [ids[i * 97:i * 97 + length] for i in range(count)]


def run(e: Engine, prompt: list[int], tokens: int, sampling=None) -> tuple[list[int], list[torch.Tensor]]:
    """Tokens and the live bytes after each of them."""
    e.reset()
    e.ingest(prompt)
    out, states = [], []
    for token in e.generate(tokens, sampling, stop_token_ids=[]):
        out.append(token)
        states.append(e.live_bytes())
    return out, states


def undrafted(e: Engine, tokens: int, sampling=None):
    """The oracle's stream: one token per generate call on an engine of the speculative plan, so no step drafts."""
    assert e.plan == SPECULATIVE_PLAN_VERSION
    for _ in range(tokens):
        yield from e.generate(1, sampling, stop_token_ids=[])
        assert e.generation_stats.drafted == 0


def run_undrafted(e: Engine, prompt: list[int], tokens: int, sampling=None) -> tuple[list[int], list[torch.Tensor]]:
    """:func:`run` through the oracle's stream."""
    e.reset()
    e.ingest(prompt)
    out, states = [], []
    for token in undrafted(e, tokens, sampling):
        out.append(token)
        states.append(e.live_bytes())
    return out, states


def assert_same_stream(got, want):
    assert got[0] == want[0]
    for index, (a, b) in enumerate(zip(got[1], want[1])):
        assert torch.equal(a, b), f"live state differs after token {index}"
