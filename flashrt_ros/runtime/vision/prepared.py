"""An image ready for the vision tower: its patch rows and grid (what HF's processor gives as ``pixel_values`` and
``image_grid_thw`` for one image)."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass(frozen=True)
class PreparedImage:
    patches: "torch.Tensor"               # float32 [t*h*w, in_channels * temporal_patch_size * patch_size**2]
    grid: tuple[int, int, int]            # (t, h, w) in patches
    spatial_merge_size: int = 2           # merged patches per side: one image token per merge**2 patches

    @property
    def token_count(self) -> int:
        """The image pad tokens it takes in the text stream (one per merged patch)."""
        t, h, w = self.grid
        return t * h * w // self.spatial_merge_size ** 2
