"""The vision tower against HF's ``Qwen3_5VisionModel`` (transformers, test-only) on a small random config that is
not the released shape: images of different grids, a two-frame clip, the features in fp32 within float rounding."""
import pytest
import torch
from transformers import Qwen3_5VisionConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

from flashrt_ros.runtime import ErrorCode, FlashRTError
from flashrt_ros.runtime.vision.config import VisionConfig
from flashrt_ros.runtime.vision.encoder import VisionEncoder

# 3 heads of 16, patches of 4 pixels, a 6 x 6 learned position grid (so every image below resamples it), 3 blocks.
SHAPE = dict(depth=3, hidden_size=48, intermediate_size=72, num_heads=3, out_hidden_size=40, patch_size=4,
             spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=36, in_channels=3)
GRIDS = [(1, 6, 10), (1, 12, 4), (2, 4, 6), (1, 2, 2)]
TOL = 1e-5


def rel_err(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected).norm() / expected.norm())


def hf_tower(seed: int = 0) -> Qwen3_5VisionModel:
    """HF's tower, seeded, at ten times HF's initial weight scale (attention far from uniform, so the rotary
    embedding shows), every LayerNorm and bias moved off its neutral value (a wrong norm or a dropped bias shows), and
    the position table scaled up so that resampling it matters."""
    torch.manual_seed(seed)
    config = Qwen3_5VisionConfig(**SHAPE, hidden_act="gelu_pytorch_tanh", initializer_range=0.2)
    model = Qwen3_5VisionModel(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.add_(0.3 * torch.randn_like(param))
        model.pos_embed.weight.mul_(20)
    return model


def vision_config(**overrides) -> VisionConfig:
    fields = {k: v for k, v in SHAPE.items()}
    return VisionConfig(**fields, image_token_id=3, vision_start_token_id=1, vision_end_token_id=2, **overrides)


def ours_from(hf: Qwen3_5VisionModel, **overrides) -> VisionEncoder:
    encoder = VisionEncoder(vision_config(**overrides)).eval()
    encoder.load_state_dict(hf.state_dict(), strict=True)
    return encoder


def patches(grid, seed: int) -> torch.Tensor:
    t, h, w = grid
    return torch.randn(t * h * w, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_features_equal_hfs_per_image_and_batched():
    hf = hf_tower()
    ours = ours_from(hf)
    inputs = [patches(grid, seed) for seed, grid in enumerate(GRIDS)]
    batched = hf(torch.cat(inputs), grid_thw=torch.tensor(GRIDS)).pooler_output
    offset = 0
    for x, grid in zip(inputs, GRIDS):
        expected = hf(x, grid_thw=torch.tensor([grid])).pooler_output
        got = ours(x, grid)
        tokens = grid[0] * grid[1] * grid[2] // 4
        assert got.shape == expected.shape == (tokens, SHAPE["out_hidden_size"]) and got.dtype == torch.float32
        torch.testing.assert_close(got, expected, rtol=TOL, atol=TOL)
        torch.testing.assert_close(got, batched[offset:offset + tokens], rtol=TOL, atol=TOL)
        offset += tokens


@torch.no_grad()
def test_the_exact_gelu_variant_is_followed():
    """hidden_act gelu (erf) in the blocks (weights scaled up, so that the GELU variants part): a tanh GELU would be
    well outside the tolerance."""
    torch.manual_seed(1)
    hf = Qwen3_5VisionModel(Qwen3_5VisionConfig(**SHAPE, hidden_act="gelu")).float().eval()
    with torch.no_grad():
        for param in hf.parameters():
            param.mul_(4)
    x = patches(GRIDS[0], 7)
    expected = hf(x, grid_thw=torch.tensor([GRIDS[0]])).pooler_output
    assert rel_err(ours_from(hf, hidden_act="gelu")(x, GRIDS[0]), expected) < TOL
    assert rel_err(ours_from(hf)(x, GRIDS[0]), expected) > 10 * TOL


@torch.no_grad()
def test_bfloat16_tower_stays_close_to_fp32():
    hf = hf_tower(seed=2)
    ours = ours_from(hf)
    x = patches(GRIDS[1], 3)
    expected = ours(x, GRIDS[1])
    got = ours.to(torch.bfloat16)(x, GRIDS[1])
    assert got.dtype == torch.bfloat16
    assert rel_err(got, expected) < 0.03


def test_patches_that_do_not_fill_the_grid_are_refused():
    encoder = VisionEncoder(vision_config())
    with pytest.raises(FlashRTError) as refused:
        encoder(patches((1, 4, 4), 0), (1, 4, 6))
    assert refused.value.code == ErrorCode.INVALID_ARGUMENT


def test_an_unknown_activation_is_refused_at_build():
    with pytest.raises(FlashRTError) as refused:
        VisionEncoder(vision_config(hidden_act="quick_gelu"))
    assert refused.value.code == ErrorCode.LOAD_FAILED and "quick_gelu" in refused.value.message
