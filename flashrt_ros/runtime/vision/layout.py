"""Where an ingest's checked items go in the text stream: the token ids (an image as ``<vision_start>``, one
``<image_pad>`` per merged patch, ``<vision_end>``), the rows its image embeddings replace, and every token's M-RoPE
position (HF's ``Qwen3_5Model.get_rope_index``).

M-RoPE positions: a text token rotates at (p, p, p); an image whose first pad follows a text token at p takes
(s + t, s + h, s + w) for its merged patch (t, h, w) with s = p + 1, and the token after it continues at
s + max(h', w') (h', w': the merged grid). So after an image a text token's rotary position is its row plus a delta
(<= 0); the arena keeps that delta (``arena.ROPE_DELTA``), so capsules, restores and rollbacks carry it.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence, Union

import torch

from .config import VisionConfig
from .prepared import PreparedImage

Item = Union[int, PreparedImage]


def ingest_length(items: Sequence[Item]) -> int:
    """Stream positions the checked ``items`` take: 1 per token id, ``token_count + 2`` per image (its start and end
    tokens, which the engine inserts)."""
    return sum(item.token_count + 2 if isinstance(item, PreparedImage) else 1 for item in items)


def image_positions(start: int, grid: tuple[int, int, int], merge: int) -> torch.Tensor:
    """[t * h' * w', 3] M-RoPE positions of an image's merged patches in raster order (t, h', w'), from ``start``."""
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    axes = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([axis.reshape(-1) for axis in axes], dim=1) + start


@dataclasses.dataclass(frozen=True)
class StreamLayout:
    token_ids: list[int]
    images: list[tuple[int, PreparedImage]]     # each image with the row (in token_ids) of its first pad
    rope_positions: torch.Tensor                # [len(token_ids), 3] int64
    rope_delta: int                             # the arena's ROPE_DELTA after the last token


def lay_out(items: Sequence[Item], vision: VisionConfig, start: int, rope_delta: int) -> StreamLayout:
    """The layout of checked ``items`` appended at token row ``start`` of a stream whose ROPE_DELTA is
    ``rope_delta``."""
    ids: list[int] = []
    images: list[tuple[int, PreparedImage]] = []
    parts: list[torch.Tensor] = []
    rotary = start + rope_delta                 # the next text token's rotary position

    def text(token_ids: list[int]) -> None:
        nonlocal rotary
        ids.extend(token_ids)
        parts.append((torch.arange(len(token_ids)) + rotary)[:, None].expand(-1, 3))
        rotary += len(token_ids)

    run: list[int] = []                         # token ids since the last image, laid out together
    for item in items:
        if not isinstance(item, PreparedImage):
            run.append(item)
            continue
        text(run + [vision.vision_start_token_id])
        run = []
        images.append((len(ids), item))
        ids.extend([vision.image_token_id] * item.token_count)
        parts.append(image_positions(rotary, item.grid, vision.spatial_merge_size))
        rotary += max(item.grid[1], item.grid[2]) // vision.spatial_merge_size
        run.append(vision.vision_end_token_id)
    if run:
        text(run)
    positions = torch.cat(parts) if parts else torch.zeros(0, 3, dtype=torch.int64)
    return StreamLayout(ids, images, positions, rotary - (start + len(ids)))
