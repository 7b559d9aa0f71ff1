"""``TowerGraphs`` pads a batch to a bucket: the padded forward's real rows equal the unpadded forward's (fp32, CPU:
the padding's arithmetic; the CUDA graph's capture and replay are checked on the GPU machine,
``clients.tools.tower_kernels``)."""
from __future__ import annotations

import pytest
import torch

from backend.encode.packed_tower import PackedTower
from backend.encode.tower_graphs import TowerGraphs, bucket_tokens, next_pow2, padded_plan

GRIDS = [(1, 4, 4), (1, 8, 6), (1, 16, 22), (2, 6, 10), (1, 2, 30)]


def _tower(windowed: bool):
    torch.manual_seed(0)
    if windowed:
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
        cfg = Qwen2_5_VLVisionConfig(depth=4, hidden_size=64, intermediate_size=96, num_heads=4, out_hidden_size=48,
                                     window_size=56, fullatt_block_indexes=[1, 3], patch_size=14)
        tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(cfg).eval()
    else:
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel
        cfg = Qwen2VLVisionConfig(depth=3, embed_dim=64, hidden_size=48, mlp_ratio=2, num_heads=4, patch_size=14)
        tower = Qwen2VisionTransformerPretrainedModel._from_config(cfg).eval()
    for p in tower.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return tower, cfg


def test_buckets_waste_at_most_a_quarter():
    assert bucket_tokens(10, 1024) == 1024 and bucket_tokens(8192, 1024) == 8192
    assert bucket_tokens(5000, 1024) == 5120 and bucket_tokens(1025, 1024) == 1280
    for n in range(1025, 40000, 37):
        b = bucket_tokens(n, 1024)
        assert n <= b <= n * 1.25 + 1 and b % 128 == 0
    assert [next_pow2(n) for n in (1, 2, 3, 5, 64, 65)] == [1, 2, 4, 8, 64, 128]


@pytest.mark.parametrize("windowed", [False, True], ids=["qwen2-vl", "qwen2.5-vl-windows"])
@pytest.mark.parametrize("grid", [GRIDS, GRIDS[2:3], [(1, 4, 4)] * 3])
def test_padded_batch_gives_the_unpadded_rows(windowed, grid):
    tower, cfg = _tower(windowed)
    packed = PackedTower(tower, cfg)
    patch_dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
    pixels = torch.randn(sum(t * h * w for t, h, w in grid), patch_dim, generator=torch.Generator().manual_seed(1))
    reference = packed(pixels, grid)
    graphs = TowerGraphs(packed, min_tokens=256)
    out = graphs(pixels, torch.tensor(grid))
    assert out.shape == reference.shape
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=2e-6 * float(reference.abs().max()))
    assert out.std() > 0.05


def test_padding_stays_in_sequences_of_its_own():
    tower, cfg = _tower(True)
    packed = PackedTower(tower, cfg)
    real = packed.host_plan([(1, 16, 22), (1, 4, 4)])
    plan, key = padded_plan(packed, [(1, 16, 22), (1, 4, 4)], 512)     # 368 real tokens, 144 padded
    assert plan["positions"].shape == (512, 2) and sum(plan["full"]) == 512
    assert plan["full"] == [352, 16, 144, 0]                           # the pad no longer than the longest image
    window = max(real["window"])                                       # 2 x 2 merge units: 16 tokens
    assert window == 16 and max(plan["window"]) == window and sum(plan["window"]) == 512
    assert plan["window"][:len(real["window"])] == real["window"]
    assert len(plan["window"]) == next_pow2(len(real["window"]) + 144 // 16)
    assert sorted(plan["unit_order"].tolist()) == list(range(128))
    assert key == (512, 4, 512, len(plan["window"]), 16)


def test_topology_takes_cuda_graphs_on_a_gpu_encoder_only(tmp_path):
    from dataclasses import replace
    from pathlib import Path

    from backend.deploy.render import render
    from backend.deploy.topology import load
    from backend.protocol.settings import EncoderSettings, parse_settings
    from tests.topology_errors import assert_refused

    root = Path(__file__).resolve().parents[2]
    checkpoint = root / "models" / "tiny-qwen2-vl"
    topology = load(root / "topologies" / "checkpoint-gpu.yaml", machine="gpu", checkpoint=checkpoint)
    assert topology.stages["encoder"].cuda_graphs is False
    render(topology, tmp_path / "off")
    assert "encoder_cuda_graphs" not in (tmp_path / "off" / "encoder" / "config.pbtxt").read_text()
    on = replace(topology, stages={**topology.stages, "encoder": replace(topology.stages["encoder"], cuda_graphs=True)})
    render(on, tmp_path / "on")
    config = (tmp_path / "on" / "encoder" / "config.pbtxt").read_text()
    for key in ("encoder_compile", "encoder_cuda_graphs"):   # graphs of the compiled tower, even with eager engines
        assert f'key: "{key}" value: {{ string_value: "true" }}' in config
    parameters = {"parameters": {"encoder_cuda_graphs": {"string_value": "true"}}}
    assert parse_settings(EncoderSettings, "encoder", parameters).encoder_cuda_graphs is True
    text = (root / "topologies" / "checkpoint-gpu.yaml").read_text()
    graphs_on = text.replace("encoder: {", "encoder: {cuda_graphs: true, ", 1)
    assert_refused(tmp_path, ((text.replace("encoder: {", "encoder: {cuda_graphs: yes please, ", 1), "expected true or false"),
                              (text.replace("pd: {", "pd: {cuda_graphs: true, ", 1), "only the encoder"),
                              (graphs_on.replace("device: gpu, gpus: [0]}   #", "device: cpu}   #", 1), "need device: gpu")),
                   machine="gpu", checkpoint=checkpoint)
