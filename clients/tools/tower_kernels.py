"""Where the vision tower's GPU time goes (run it on the GPU machine; docs/results/gpu.md has the results).

For each batch shape (``--cases``: images of SIZE px, BATCH of them) and each way of running the packed tower, one line: ms per
forward, images/s, % of the bf16 matmul peak (``clients.bench.gpu.tower_flops``), the kernels' summed time per forward
by kind (matmul, attention, Triton-fused element-wise, other) and the GPU's busy share (kernel time / wall time: under
1.0, the host's launches leave the GPU idle). Ways:
- ``eager``: ``PackedTower`` without compile;
- ``compile``: torch.compile over the block (what the encoders serve with);
- ``eager-unaligned``, ``compile-unaligned``: the same without ``align_mlp`` (Qwen2.5-VL's 3,420-wide MLP as it is);
- ``compile+graph``: the same forward captured once as a CUDA graph for this exact batch and replayed
  (``backend.encode.packed_tower.TowerGraphs``, which pads a batch to a bucket; here the batch is one bucket).

Each row also gives the way's largest difference to the case's first way (relative to its largest value; bf16).

    python -m clients.tools.tower_kernels [--tower qwen25-7b|qwen2-2b] [--cases 448x1,448x8] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from clients.bench.gpu import PATCH_DIM, PEAK_TFLOPS, qwen25_7b_tower, random_tower, tower_flops


def qwen2_2b_tower(dtype=torch.bfloat16):
    """Qwen2-VL-2B's vision tower shape (675M parameters: embed 1280, 32 blocks, MLP 5120, full attention)."""
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    cfg = Qwen2VLVisionConfig(depth=32, embed_dim=1280, hidden_size=1536, mlp_ratio=4, num_heads=16,
                              patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    return random_tower(Qwen2VisionTransformerPretrainedModel, cfg, dtype), cfg


def flops_config(cfg):
    """``tower_flops`` takes Qwen2.5-VL's field names; Qwen2-VL's tower is the same with full attention everywhere
    and an MLP of two matmuls (fc1, fc2)."""
    if hasattr(cfg, "fullatt_block_indexes"):
        return cfg
    from types import SimpleNamespace
    return SimpleNamespace(hidden_size=cfg.embed_dim, intermediate_size=cfg.embed_dim * cfg.mlp_ratio, gated_mlp=False,
                           out_hidden_size=cfg.hidden_size, spatial_merge_size=cfg.spatial_merge_size,
                           window_size=1 << 20, depth=cfg.depth, fullatt_block_indexes=list(range(cfg.depth)))


KINDS = (("attention", ("flash", "fmha", "attn")),
         ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "sm90", "splitk")),
         ("fused", ("triton",)))


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, marks in KINDS:
        if any(mark in low for mark in marks):
            return kind
    return "other"


def kernel_times(fn, iters: int) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """Per forward: ms of kernel time by kind, and the ten longest kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    by_kind: dict[str, float] = {}
    kernels = []
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", None)
        if us is None:
            us = getattr(event, "cuda_time_total", 0.0)
        if not us or event.key.startswith("ProfilerStep"):
            continue
        ms = us / 1000 / iters
        kind = kind_of(event.key)
        by_kind[kind] = by_kind.get(kind, 0.0) + ms
        kernels.append((event.key[:90], ms))
    kernels.sort(key=lambda item: -item[1])
    return by_kind, kernels[:10]


def wall_ms(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / iters * 1000


def ways(tower, cfg, pixels, grid) -> dict:
    """name -> a factory of the forward to time (made in turn: an aligned ``PackedTower`` pads the tower's MLP in
    place, so the unaligned way comes first, on a tower of its own per case)."""
    from backend.encode.packed_tower import PackedTower
    from backend.encode.tower_graphs import TowerGraphs

    def make(**kwargs):
        packed = PackedTower(tower, cfg, **kwargs)
        return lambda: packed(pixels, grid)

    def graphs():
        captured = TowerGraphs(PackedTower(tower, cfg, compile=True))
        return lambda: captured(pixels, grid)

    return {"eager-unaligned": lambda: make(align=False), "compile-unaligned": lambda: make(compile=True, align=False),
            "eager": lambda: make(), "compile": lambda: make(compile=True), "compile+graph": graphs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tower", choices=["qwen25-7b", "qwen2-2b"], default="qwen25-7b")
    parser.add_argument("--cases", default="448x1,448x8", help="SIZExBATCH,...")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--ways", default="compile-unaligned,eager,compile,compile+graph")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = []
    for case in args.cases.split(","):
        tower, cfg = qwen25_7b_tower() if args.tower == "qwen25-7b" else qwen2_2b_tower()  # unaligned again
        size, batch = (int(v) for v in case.split("x"))
        side = size // 14
        grid = [(1, side, side)] * batch
        pixels = torch.randn(batch * side * side, PATCH_DIM, device="cuda", dtype=torch.bfloat16)
        flops = tower_flops(flops_config(cfg), grid)
        reference = None
        with torch.inference_mode():
            made = ways(tower, cfg, pixels, grid)
            for name in [n for n in made if n in args.ways.split(",")]:
                fn = made[name]()
                out = fn().float()
                fn()  # compile and capture outside the timing
                if reference is None:
                    reference = out
                ms = wall_ms(fn, args.iters)
                by_kind, top = kernel_times(fn, max(2, args.iters // 2))
                busy = sum(by_kind.values())
                row = {"tower": args.tower, "size": size, "batch": batch, "way": name, "ms": round(ms, 2),
                       "img_s": round(batch / ms * 1000, 1),
                       "pct_peak": round(100 * flops / (ms / 1000) / 1e12 / PEAK_TFLOPS, 1),
                       "kernel_ms": {k: round(v, 2) for k, v in sorted(by_kind.items())},
                       "gpu_busy": round(busy / ms, 3),
                       "diff": float((out - reference).abs().max() / reference.abs().max()),
                       "top": [(k, round(v, 3)) for k, v in top]}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
