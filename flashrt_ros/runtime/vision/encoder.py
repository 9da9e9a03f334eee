"""The vision tower of Qwen3.5/3.6 (HF ``Qwen3_5VisionModel``): patches of one image in, one embedding per merged
block of patches out, in the text model's hidden size (they replace the image pad tokens' embeddings).

A ViT: a linear patch embedding (stored as HF's Conv3d, whose stride equals its kernel), learned position
embeddings on a square grid resampled bilinearly to each image's grid, pre-norm blocks of bidirectional attention
with 2-D rotary embeddings (rows' and columns' angles side by side, over the whole head) and a GELU MLP, then the
merger: LayerNorm, each merge x merge block of patches concatenated, an MLP to ``out_hidden_size``. Parameter names
are HF's (``patch_embed.proj``, ``pos_embed``, ``blocks.N.{norm1,attn.qkv,attn.proj,norm2,mlp.linear_fc1,...}``,
``merger.{norm,linear_fc1,linear_fc2}``), so a checkpoint's ``model.visual.*`` loads under ``visual.*``.

One image (or one clip of ``t`` frames, each frame attending within itself) per call.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ErrorCode, FlashRTError
from ..kernels.rope import apply_rope
from .config import VisionConfig

_ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}     # hidden_act -> F.gelu's approximate


def _gelu(hidden_act: str) -> str:
    if hidden_act not in _ACTIVATIONS:
        raise FlashRTError(ErrorCode.LOAD_FAILED, f"unsupported vision hidden_act {hidden_act!r}; supported: "
                                                  f"{', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[hidden_act]


class PatchEmbed(nn.Module):
    def __init__(self, vision: VisionConfig):
        super().__init__()
        kernel = (vision.temporal_patch_size, vision.patch_size, vision.patch_size)
        self.proj = nn.Conv3d(vision.in_channels, vision.hidden_size, kernel, stride=kernel, bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(patches.to(weight.dtype), weight.reshape(weight.shape[0], -1), self.proj.bias)


class Attention(nn.Module):
    def __init__(self, vision: VisionConfig):
        super().__init__()
        self.heads = vision.num_heads
        self.qkv = nn.Linear(vision.hidden_size, 3 * vision.hidden_size, bias=True)
        self.proj = nn.Linear(vision.hidden_size, vision.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: int) -> torch.Tensor:
        """x [N, hidden] (N = frames x patches per frame); cos, sin [N, head_dim] fp32."""
        length = x.shape[0]
        q, k, v = self.qkv(x).view(length, 3, self.heads, -1).unbind(1)           # [N, heads, head_dim] each
        q = apply_rope(q.float(), cos, sin).to(x.dtype)       # the rotation in fp32, as HF's vision rope
        k = apply_rope(k.float(), cos, sin).to(x.dtype)
        q, k, v = (t.view(frames, length // frames, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v)                                # [frames, heads, n, head_dim]
        return self.proj(out.transpose(1, 2).reshape(length, -1))


class MLP(nn.Module):
    def __init__(self, vision: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(vision.hidden_size, vision.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(vision.intermediate_size, vision.hidden_size, bias=True)
        self.approximate = _gelu(vision.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class Block(nn.Module):
    def __init__(self, vision: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(vision.hidden_size, eps=vision.layer_norm_eps)
        self.norm2 = nn.LayerNorm(vision.hidden_size, eps=vision.layer_norm_eps)
        self.attn = Attention(vision)
        self.mlp = MLP(vision)

    def forward(self, x, cos, sin, frames: int) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, frames)
        return x + self.mlp(self.norm2(x))


class Merger(nn.Module):
    """LayerNorm per patch, then each merge x merge block (consecutive rows) as one vector through an MLP."""

    def __init__(self, vision: VisionConfig):
        super().__init__()
        merged = vision.hidden_size * vision.spatial_merge_size ** 2
        self.norm = nn.LayerNorm(vision.hidden_size, eps=vision.layer_norm_eps)
        self.linear_fc1 = nn.Linear(merged, merged, bias=True)
        self.linear_fc2 = nn.Linear(merged, vision.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).view(-1, self.linear_fc1.in_features)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionEncoder(nn.Module):
    def __init__(self, vision: VisionConfig):
        super().__init__()
        _gelu(vision.hidden_act)
        self.vision = vision
        self.side = int(vision.num_position_embeddings ** 0.5)
        self.patch_embed = PatchEmbed(vision)
        self.pos_embed = nn.Embedding(vision.num_position_embeddings, vision.hidden_size)
        self.blocks = nn.ModuleList(Block(vision) for _ in range(vision.depth))
        self.merger = Merger(vision)

    def _merge_order(self, grid: torch.Tensor) -> torch.Tensor:
        """[..., h, w] to [h*w, ...]: patches in merge-block order (each merge x merge block's patches in a row),
        the order of the preprocessor's rows."""
        m = self.vision.spatial_merge_size
        *lead, h, w = grid.shape
        blocks = grid.reshape(*lead, h // m, m, w // m, m)
        lead_dims = list(range(len(lead)))
        return blocks.permute(len(lead), len(lead) + 2, len(lead) + 1, len(lead) + 3, *lead_dims).reshape(h * w, *lead)

    def position_embeddings(self, h: int, w: int) -> torch.Tensor:
        """The learned side x side grid resampled bilinearly (corners aligned) to h x w, in fp32, merge-block order."""
        table = self.pos_embed.weight.float().t().reshape(1, -1, self.side, self.side)
        resampled = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]     # [hidden, h, w]
        return self._merge_order(resampled)

    def rotary(self, h: int, w: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [h*w, head_dim] fp32: a quarter of the head's frequencies on the row, a quarter on the column,
        the two halves of the head (rotate-half) alike."""
        half = self.vision.head_dim // 2
        exponents = torch.arange(0, half, 2, dtype=torch.float, device=device) / half
        inv_freq = 1.0 / (self.vision.rope_theta ** exponents)
        rows, cols = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
        positions = self._merge_order(torch.stack([rows, cols]))                       # [h*w, 2]
        angles = (positions[..., None].float() * inv_freq).flatten(1)                  # [h*w, row | col]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    def forward(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """patches [t*h*w, in_channels*temporal*patch**2] of one image (its ``PreparedImage``), grid (t, h, w) ->
        [t*h*w / merge**2, out_hidden_size] in the tower's dtype."""
        t, h, w = grid
        if patches.shape[0] != t * h * w:
            raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"{patches.shape[0]} patches do not fill grid {grid}")
        x = self.patch_embed(patches.to(self.pos_embed.weight.device))
        x = x + self.position_embeddings(h, w).repeat(t, 1).to(x.dtype)
        cos, sin = (c.repeat(t, 1) for c in self.rotary(h, w, x.device))
        for block in self.blocks:
            x = block(x, cos, sin, t)
        return self.merger(x)
