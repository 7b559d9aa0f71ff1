"""``clients.tools.tower_kernels``' arithmetic on the CPU (its timings run on the GPU machine: scripts/gpu_tower.sh):
the kernels' kinds by name, and Qwen2-VL's tower counted in Qwen2.5-VL's terms."""
from __future__ import annotations

from clients.bench.gpu import tower_flops
from clients.tools.tower_kernels import flops_config, kind_of


def test_kernels_are_sorted_into_kinds_by_name():
    assert kind_of("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<96") == "attention"
    assert kind_of("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_bias_TNN") == "matmul"
    assert kind_of("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_bf16_256x128_64x3_tn_align2>") == "matmul"
    assert kind_of("triton_red_fused_add_native_layer_norm_2") == "fused"
    assert kind_of("void at::native::vectorized_elementwise_kernel<8>") == "other"


def test_a_qwen2_vl_tower_is_counted_with_full_attention_in_every_block():
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig

    cfg = flops_config(Qwen2VLVisionConfig(depth=2, embed_dim=64, hidden_size=48, mlp_ratio=4, num_heads=4))
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.out_hidden_size, cfg.fullatt_block_indexes) == (64, 256, 48, [0, 1])
    assert cfg.gated_mlp is False
    grid = [(1, 4, 4)]                                                   # 16 patches
    linear = 2 * 16 * (64 * 3 * 64 + 64 * 64 + 2 * 64 * 256)           # per block: qkv, proj, fc1 and fc2
    attention = 4 * 16 * 16 * 64                                       # scores and values over all 16 patches
    merger = 2 * 4 * (256 * 256 + 256 * 48)
    assert tower_flops(cfg, grid) == 2 * linear + 2 * attention + merger + 2 * 16 * 3 * 2 * 14 * 14 * 64
