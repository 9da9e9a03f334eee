"""The vision tower as one CUDA graph per image grid: captured on the first image of a grid, replayed for every
later one, so an image costs the tower's kernels rather than their launches (eager on an H100 the 0.8B tower spent
~4.3 ms a frame on launches and host work: 4.6 ms for 80 image tokens against 8.5 ms for 880)."""
from __future__ import annotations

import torch

from ..graphs import capture_graph

MAX_GRIDS = 8       # graphs kept (each holds the tower's activations for its grid); other grids run eagerly


class CapturedTower:
    """Runs ``tower(patches, grid)``: on CUDA through a graph per grid (at most :data:`MAX_GRIDS`), else eagerly.
    Each graph has its own memory pool, and its output is copied out, so nothing another graph (or the next image
    of the same grid) runs can overwrite an image's embeddings before they are used. Graphs are of one tower
    object: another one (a model whose ``visual`` was replaced) drops them."""

    def __init__(self, device: torch.device, enabled: bool):
        self.device, self.enabled = device, enabled
        self.tower: torch.nn.Module | None = None
        self.graphs: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor, torch.cuda.CUDAGraph]] = {}

    @torch.inference_mode()     # the static buffers are inference tensors, whoever calls (the tower has no grads)
    def __call__(self, tower: torch.nn.Module, patches: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        if tower is not self.tower:
            self.tower, self.graphs = tower, {}
        if not self.enabled or (grid not in self.graphs and len(self.graphs) >= MAX_GRIDS):
            return tower(patches.to(self.device), grid)
        if grid not in self.graphs:
            self.graphs[grid] = self._capture(patches, grid)
        static, out, graph = self.graphs[grid]
        static.copy_(patches)
        graph.replay()
        return out.clone()

    def _capture(self, patches: torch.Tensor, grid: tuple[int, int, int]):
        static = patches.to(self.device, copy=True)
        graph, out = capture_graph(lambda: self.tower(static, grid))
        return static, out, graph
