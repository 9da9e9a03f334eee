"""An image ready for the vision tower: its patch rows and grid (what HF's processor gives as ``pixel_values`` and
``image_grid_thw`` for one image). The one class the engine, the layout and the preprocessing share."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass(frozen=True)
class PreparedImage:
    """``patches`` float32 [t*h*w, channels*temporal*patch*patch] (HF's ``pixel_values`` rows of this image) and
    ``grid`` (t, h, w) in patches (its ``image_grid_thw`` row). The engine checks it against its tower when it is
    ingested (``Engine.check_ingest``), where a bad one is refused with the reason before anything changes."""
    patches: "torch.Tensor"
    grid: tuple[int, int, int]
    spatial_merge_size: int = 2           # merged patches per side: one image token per merge**2 patches

    @property
    def token_count(self) -> int:
        """The image pad tokens it takes in the text stream (one per merged block of patches)."""
        t, h, w = self.grid
        return t * h * w // self.spatial_merge_size ** 2
