"""CUDA graph capture and replay per shape bucket, over static buffers (the arena and the token buffer)."""
from __future__ import annotations

from typing import Callable, Hashable

import torch


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
        """Run ``step`` once on a side stream (warm-up: kernels, workspaces), then record it.

        ``prepare`` puts the static buffers into a valid state before the warm-up run (it mutates them).
        """
        prepare()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        prepare()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            step()
        self.graphs[key] = graph

    def run(self, key: Hashable, step: Callable[[], None]) -> None:
        graph = self.graphs.get(key)
        if graph is None:
            step()
        else:
            graph.replay()
