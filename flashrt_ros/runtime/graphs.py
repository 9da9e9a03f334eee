"""CUDA graph capture and replay per shape bucket, over static buffers (the arena and the token buffer)."""
from __future__ import annotations

from typing import Callable, Hashable, TypeVar

import torch

T = TypeVar("T")


def capture_graph(step: Callable[[], T], pool=None,
                  prepare: Callable[[], None] | None = None) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run ``step`` once on a side stream (warm-up: kernels chosen, workspaces allocated), then record it into a new
    graph in memory pool ``pool`` (None: a private one); returns the graph and what the recorded call returned (its
    static outputs). ``prepare`` puts the static buffers into a valid state before each of the two runs (it may
    mutate them)."""
    if prepare is not None:
        prepare()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    if prepare is not None:
        prepare()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = step()
    return graph, out


class GraphRunner:
    """Holds one captured graph per bucket key; a key without a graph runs eagerly (and on the CPU, always).

    All graphs share one memory pool: they never run concurrently and write their results only into static
    buffers allocated outside the pool, so their intermediates may overlap safely.
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if enabled else None

    def capture(self, key: Hashable, step: Callable[[], None], prepare: Callable[[], None]) -> None:
        """Capture ``step`` under ``key`` (:func:`capture_graph` in the shared pool; ``prepare`` mutates the static
        buffers into a valid state first)."""
        self.graphs[key], _ = capture_graph(step, self.pool, prepare)

    def run(self, key: Hashable, step: Callable[[], None]) -> None:
        graph = self.graphs.get(key)
        if graph is None:
            step()
        else:
            graph.replay()
