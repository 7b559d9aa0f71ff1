"""The packed tower equals transformers' tower on the same weights (fp32, CPU): Qwen2-VL (the tiny test
checkpoint) and Qwen2.5-VL (window attention; a small random tower built here)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend.encode.packed_tower import PackedTower, _grid_plan, packed_attention

ROOT = Path(__file__).resolve().parents[2]
GRIDS = [(1, 4, 4), (1, 8, 6), (1, 16, 22), (2, 6, 10), (1, 2, 30)]  # patches; (2, ...) is a two-frame item


def _pixels(grid, patch_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = sum(t * h * w for t, h, w in grid)
    return torch.randn(tokens, patch_dim, generator=g)


def _check(tower, cfg, grid):
    patch_dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
    pixels = _pixels(grid, patch_dim)
    grid_t = torch.tensor(grid)
    with torch.inference_mode():
        out = tower(pixels, grid_thw=grid_t)
        reference = getattr(out, "pooler_output", out)
    packed = PackedTower(tower, cfg)(pixels, grid_t)
    assert packed.shape == reference.shape
    scale = float(reference.abs().max())  # fp32 rounding, relative to the output's size
    torch.testing.assert_close(packed, reference, rtol=1e-5, atol=2e-6 * scale)
    return packed


def test_qwen2_vl_tower_matches_transformers():
    from transformers import AutoConfig
    from backend.encode.encoder import VisionEncoder
    encoder = VisionEncoder.load(ROOT / "models" / "tiny-qwen2-vl", impl="transformers")
    cfg = AutoConfig.from_pretrained(ROOT / "models" / "tiny-qwen2-vl").vision_config
    _check(encoder.tower, cfg, GRIDS)
    _check(encoder.tower, cfg, GRIDS[2:3])  # one item alone: the same as in a batch


def test_qwen2_5_vl_window_tower_matches_transformers():
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
    torch.manual_seed(0)
    cfg = Qwen2_5_VLVisionConfig(depth=4, hidden_size=64, intermediate_size=96, num_heads=4, out_hidden_size=48,
                                 window_size=56, fullatt_block_indexes=[1, 3], patch_size=14)
    tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(cfg).eval()
    for p in tower.parameters():  # HF init leaves biases and norms trivial: draw them all
        torch.nn.init.normal_(p, std=0.3)
    out = _check(tower, cfg, GRIDS)
    assert out.std() > 0.05  # not a degenerate tower


def test_window_plan_covers_every_token_once():
    positions, order, lengths = _grid_plan(1, 10, 6, 2, 2)  # 5 x 3 merge units, windows of 2 x 2 units
    assert positions.shape == (60, 2) and sorted(order.tolist()) == list(range(15))
    assert sum(lengths) == 60 and lengths == (16, 8, 16, 8, 8, 4)


def test_attention_fallback_is_per_sequence():
    torch.manual_seed(1)
    lengths = (5, 3, 5, 0, 7)
    q, k, v = (torch.randn(sum(lengths), 2, 8) for _ in range(3))
    cu = torch.tensor([0, 5, 8, 13, 13, 20], dtype=torch.int32)
    out = packed_attention(q, k, v, cu, 7, lengths)
    start = 0
    for length in lengths:
        s = slice(start, start + length)
        ref = torch.nn.functional.scaled_dot_product_attention(*(t[s].transpose(0, 1) for t in (q, k, v)))
        torch.testing.assert_close(out[s], ref.transpose(0, 1))
        start += length


def test_unknown_encoder_impl_is_refused():
    from backend.encode.encoder import VisionEncoder
    with pytest.raises(ValueError, match="encoder impl must be 'packed' or 'transformers'"):
        VisionEncoder.load(ROOT / "models" / "tiny-qwen2-vl", impl="flash")


def test_a_gated_mlp_padded_to_aligned_rows_gives_the_same_embeddings():
    """``align_mlp`` (applied on CUDA): Qwen2.5-VL's 3,420-wide MLP padded with zeros gives the same output, and the
    module's own forward (its parameters now views of the padded tensors) too."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    from backend.encode.packed_tower import align_mlp

    torch.manual_seed(0)
    cfg = Qwen2_5_VLVisionConfig(depth=2, hidden_size=64, intermediate_size=90, num_heads=4, out_hidden_size=48,
                                 window_size=56, fullatt_block_indexes=[1], patch_size=14)
    tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(cfg).eval()
    for p in tower.parameters():
        torch.nn.init.normal_(p, std=0.3)
    grid = GRIDS[:3]
    pixels = _pixels(grid, 3 * 2 * 14 * 14)
    with torch.inference_mode():
        before = PackedTower(tower, cfg)(pixels, grid)
        module_before = tower(pixels, grid_thw=torch.tensor(grid)).pooler_output
    packed = PackedTower(tower, cfg)
    packed._padded = align_mlp(tower, multiple=64)
    assert sorted(packed._padded) == [0, 1] and packed._padded[0][0].shape == (128, 64)
    assert tower.blocks[0].mlp.down_proj.weight.shape == (64, 90)
    with torch.inference_mode():
        after = packed(pixels, grid)
        module_after = tower(pixels, grid_thw=torch.tensor(grid)).pooler_output
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(module_after, module_before, rtol=1e-5, atol=1e-5)
    again = align_mlp(tower, multiple=64)        # another PackedTower over it: the same tensors, nothing copied
    assert sorted(again) == [0, 1] and all(a is b for a, b in zip(again[0], packed._padded[0]))
