"""GPU benchmark, one run, two side-by-side tables (run it on the GPU machine; docs/results/gpu.md has the results).

1. Encoder: a Qwen2.5-VL-7B-sized vision tower (670M parameters, random weights, bf16), images of 448 and
   896 px in batches of 1/8/32: img/s and % of the bf16 matmul peak for
   - ``transformers``: the model's own module (sdpa attention), the reference;
   - ``packed``: ``backend.encode.packed_tower`` eager;
   - ``packed+compile``: the same with torch.compile over the block.
   Accuracy of each against transformers in fp32 on the same weights (max abs error / max abs value).
2. Handoff between two processes on the same GPU, 64 KiB-256 MiB, GB/s and latency per pull:
   - ``ipc``: ``EmbeddingConsumer.pull`` with the CUDA IPC path (what same-host consumers use), VRAM->VRAM;
   - ``ipc->host``: the same into host memory (CPU consumers on a GPU host);
   - ``nixl``: ``EmbeddingConsumer.pull`` forced through NIXL with UCX defaults, VRAM->VRAM;
   - ``cuda-ipc copy``: a bare device-to-device copy out of the IPC mapping (the limit).

    python -m clients.bench.gpu [--quick] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

PEAK_TFLOPS = 791.0  # bf16 dense matmul measured on the H200 (torch.matmul, 8192^3)
PATCH_DIM = 3 * 2 * 14 * 14


def qwen25_7b_tower(dtype=torch.bfloat16, depth: int = 32):
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    cfg = Qwen2_5_VLVisionConfig(depth=depth, hidden_size=1280, intermediate_size=3420, num_heads=16,
                                 out_hidden_size=3584, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
                                 patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    return random_tower(Qwen2_5_VisionTransformerPretrainedModel, cfg, dtype), cfg


def random_tower(model_class, cfg, dtype=torch.bfloat16):
    """``model_class`` built from ``cfg`` with sdpa attention and seeded random weights (matrices scaled by their
    fan-in), on CUDA in ``dtype``, for eval."""
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    tower = model_class._from_config(cfg)
    with torch.no_grad():
        for p in tower.parameters():
            if p.dim() > 1:
                p.normal_(0, p.shape[-1] ** -0.5 if p.dim() == 2 else 0.02)
    return tower.to("cuda", dtype).eval()


def tower_flops(cfg, grid) -> float:
    """Matmul FLOPs of one forward (linear layers + attention scores and values); ``cfg`` in Qwen2.5-VL's terms
    (``gated_mlp: False``: an MLP of two matmuls, as Qwen2-VL's)."""
    e, i, out, m2 = cfg.hidden_size, cfg.intermediate_size, cfg.out_hidden_size, cfg.spatial_merge_size ** 2
    tokens = sum(t * h * w for t, h, w in grid)
    mlp = 3 if getattr(cfg, "gated_mlp", True) else 2  # gate, up and down (Qwen2.5-VL); fc1 and fc2 (Qwen2-VL)
    per_block = 2 * tokens * (e * 3 * e + e * e + mlp * e * i)
    window = (cfg.window_size // 14) ** 2
    attn = 0
    for index in range(cfg.depth):
        for t, h, w in grid:
            n = h * w
            span = n if index in cfg.fullatt_block_indexes else min(window, n)
            attn += t * 4 * n * span * e
    merger = 2 * (tokens // m2) * (4 * e * 4 * e + 4 * e * out)
    return cfg.depth * per_block + attn + merger + 2 * tokens * PATCH_DIM * e


def _time(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / iters


def bench_encoder(quick: bool) -> list[dict]:
    from backend.encode.packed_tower import PackedTower

    tower, cfg = qwen25_7b_tower()
    params = sum(p.numel() for p in tower.parameters())
    print(f"tower: {params / 1e6:.0f}M parameters, bf16", flush=True)
    impls = {"transformers": lambda px, g: tower(px, grid_thw=g).pooler_output,
             "packed": PackedTower(tower, cfg),
             "packed+compile": PackedTower(tower, cfg, compile=True)}
    rows = []
    cases = [(448, 1), (448, 8), (448, 32), (896, 1), (896, 8), (896, 32)]
    if quick:
        cases = [(448, 1), (448, 8)]
    for size, batch in cases:
        side = size // 14
        grid = [(1, side, side)] * batch
        grid_t = torch.tensor(grid, device="cuda")
        pixels = torch.randn(batch * side * side, PATCH_DIM, device="cuda", dtype=torch.bfloat16)
        flops = tower_flops(cfg, grid)
        row = {"size": size, "batch": batch}
        for name, fn in impls.items():
            with torch.inference_mode():
                if name == "packed+compile":
                    fn(pixels, grid_t)  # compile outside the timing (dynamic shapes: once for all cases)
                iters = max(2, min(20, int(8 / batch) + 2))
                seconds = _time(lambda: fn(pixels, grid_t), iters)
            row[name] = {"img_s": batch / seconds, "ms": seconds * 1000,
                         "pct_peak": 100 * flops / seconds / 1e12 / PEAK_TFLOPS}
        rows.append(row)
        print(json.dumps(row), flush=True)
    rows.append({"accuracy": encoder_accuracy(tower, cfg)})
    return rows


def encoder_accuracy(tower, cfg) -> dict:
    """Each implementation against transformers in fp32 (TF32 off), same weights: 2 images of 448 px and
    one of 224 x 336."""
    from backend.encode.packed_tower import PackedTower

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    grid = [(1, 32, 32), (1, 32, 32), (1, 16, 24)]
    grid_t = torch.tensor(grid, device="cuda")
    pixels = torch.randn(sum(t * h * w for t, h, w in grid), PATCH_DIM, device="cuda")
    result = {}
    with torch.inference_mode():
        tower32 = tower.float()
        reference = tower32(pixels, grid_thw=grid_t).pooler_output
        scale = reference.abs().max().item()
        result["packed fp32"] = (PackedTower(tower32, cfg)(pixels, grid_t) - reference).abs().max().item() / scale
        tower16 = tower32.to(torch.bfloat16)
        px16 = pixels.to(torch.bfloat16)
        result["transformers bf16"] = (tower16(px16, grid_thw=grid_t).pooler_output.float() - reference).abs().max().item() / scale
        result["packed bf16"] = (PackedTower(tower16, cfg)(px16, grid_t).float() - reference).abs().max().item() / scale
        result["packed+compile bf16"] = (PackedTower(tower16, cfg, compile=True)(px16, grid_t).float()
                                         - reference).abs().max().item() / scale
    print(json.dumps({"accuracy (max abs error / max abs of the fp32 reference)": result}), flush=True)
    return result


def bench_handoff(quick: bool) -> list[dict]:
    from backend.transfer.consumer import EmbeddingConsumer
    from devtools.diagnostics.pool_process import ProducerProcess, make_layout

    sizes = [64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20]
    if quick:
        sizes = [64 << 10, 16 << 20]
    consumers = {"ipc": EmbeddingConsumer(device="cuda"), "ipc->host": EmbeddingConsumer(device="cpu"),
                 "nixl": EmbeddingConsumer(device="cuda", cuda_ipc=False)}
    rows = []
    with ProducerProcess(pool_bytes=(512 << 20) + (1 << 20), device="cuda", alloc_timeout=5) as producer:
        for nbytes in sizes:
            tensor = torch.randn(nbytes // 4 // 256, 256)
            row = {"bytes": nbytes}
            for name, consumer in consumers.items():
                # leases published first, then pulled back to back (the producer idle meanwhile, as for
                # the bare copy below: two processes busy on one GPU time-slice it, see docs/results/gpu.md)
                count = max(2, min(12 if name != "nixl" else 4, (512 << 20) // nbytes - 1))
                times = []
                while len(times) < (10 if name != "nixl" else 3):  # rounds of leases until enough samples
                    docs = producer.call("publish_many", tensor, count)
                    out = None
                    for i, doc in enumerate(docs):
                        layout = make_layout(doc, tensor)
                        out = None  # the caching allocator reuses its block, as the bare copy reuses dst
                        started = time.perf_counter()
                        out = consumer.pull(layout)  # returns once the data is in place (its stream waited)
                        if i:  # the first pull after the publish pays the wake-up of an idle process
                            times.append(time.perf_counter() - started)
                    assert torch.equal(out.cpu(), tensor), name
                    for doc in docs:
                        producer.wait_state(doc["lease_id"], None)
                seconds = statistics.median(times)
                row[name] = {"GBps": nbytes / seconds / 1e9, "us": seconds * 1e6, "samples": len(times)}
            if nbytes <= (64 << 20):  # four items of one request in one pull_many: one wait, one notification
                row["ipc x4"] = _pull_many_x4(producer, consumers["ipc"], tensor, nbytes)
            row["cuda-ipc copy"] = _bare_copy(producer, tensor, nbytes)
            rows.append(row)
            print(json.dumps(row), flush=True)
    for consumer in consumers.values():
        consumer.close()
    return rows


def _pull_many_x4(producer, consumer, tensor, nbytes: int) -> dict:
    """Per item of ``pull_many`` of four items (a request's four images: one wait, one notification)."""
    from devtools.diagnostics.pool_process import make_layout

    groups = 2 if nbytes > (16 << 20) else 3
    per_item = []
    while len(per_item) < 6:
        layouts = [make_layout(doc, tensor) for doc in producer.call("publish_many", tensor, 4 * groups)]
        outs = []
        for g in range(groups):
            started = time.perf_counter()
            outs.append(consumer.pull_many(layouts[4 * g: 4 * g + 4]))
            if g:  # the first call after the publish pays the wake-up of an idle process: not timed
                per_item.append((time.perf_counter() - started) / 4)
        assert all(torch.equal(out[-1].cpu(), tensor) for out in outs)
        del outs
        for layout in layouts:
            producer.wait_state(layout.handle.lease_id, None)
    seconds = statistics.median(per_item)
    return {"GBps": nbytes / seconds / 1e9, "us": seconds * 1e6}


def _bare_copy(producer, tensor, nbytes: int) -> dict:
    """The limit: a bare copy out of the IPC mapping, no lease, tags or notification (one copy + wait as a pull
    does, four copies + one wait as pull_many of four does, and copies back to back)."""
    from backend.transfer.cuda_ipc import open_allocation
    from devtools.diagnostics.pool_process import make_layout

    layout = make_layout(producer.call("publish", tensor), tensor)
    opened = open_allocation(layout.handle.ipc_handle, layout.handle.pool_bytes, torch.device("cuda"))
    src = opened.tensor[layout.handle.offset + 16: layout.handle.offset + 16 + nbytes]
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    seconds = _time(lambda src=src: dst.copy_(src), 20)
    per_copy = []
    for _ in range(20):
        started = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        per_copy.append(time.perf_counter() - started)
    per_copy_x4 = []
    for _ in range(10):
        started = time.perf_counter()
        for _ in range(4):
            dst.copy_(src)
        torch.cuda.synchronize()
        per_copy_x4.append((time.perf_counter() - started) / 4)
    out = {"GBps": nbytes / statistics.median(per_copy) / 1e9, "us": statistics.median(per_copy) * 1e6,
           "GBps_x4": nbytes / statistics.median(per_copy_x4) / 1e9, "GBps_back_to_back": nbytes / seconds / 1e9}
    del src
    opened.close()
    producer.call("release", layout.handle.lease_id)
    return out


def handoff_breakdown(quick: bool) -> list[dict]:
    """Where a pull's time goes: the bare copy, then one piece of ``EmbeddingConsumer.pull`` added at a
    time (host microseconds per operation, median; ``gpu_us``: the copy alone, CUDA events)."""
    from backend.transfer import cuda_ipc
    from backend.transfer.consumer import EmbeddingConsumer
    from backend.transfer.producer import HEADER
    from devtools.diagnostics.pool_process import ProducerProcess, make_layout

    memcpy, sync = cuda_ipc._hot_calls()  # the calls a pull makes
    sizes = [1 << 20, 16 << 20, 64 << 20, 256 << 20] if not quick else [16 << 20]
    rows = []
    with ProducerProcess(pool_bytes=(512 << 20) + (1 << 20), device="cuda", alloc_timeout=5) as producer:
        consumer = EmbeddingConsumer(device="cuda")
        quiet = EmbeddingConsumer(device="cuda")
        quiet._notify = lambda peer, lease_ids: None  # no release: the producer never touches the GPU meanwhile
        stream = torch.cuda.Stream()
        tags = torch.empty(1, dtype=torch.int64, pin_memory=True)
        for nbytes in sizes:
            tensor = torch.randn(nbytes // 4 // 256, 256)
            count = max(2, min(12, (512 << 20) // nbytes - 1))
            layouts = [make_layout(doc, tensor) for doc in producer.call("publish_many", tensor, count)]
            opened = cuda_ipc.open_allocation(layouts[0].handle.ipc_handle, layouts[0].handle.pool_bytes,
                                              torch.device("cuda"))
            base = opened.tensor.data_ptr()
            srcs = [base + layout.handle.offset + HEADER for layout in layouts]
            dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            row = {"bytes": nbytes}

            def measure(name, op, regions, gpu=False):
                row[name] = _measure(op, regions, stream, sync, gpu)

            def copy(src):
                memcpy(dst.data_ptr(), src, nbytes, 3, stream.cuda_stream)

            def copy_tag(src):  # what a consumer without the producer's tag table does
                copy(src)
                memcpy(tags.data_ptr(), src + nbytes, 8, 2, stream.cuda_stream)

            def copy_alloc(src):  # what a consumer with the tag table does, but for its checks
                out = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
                memcpy(out.data_ptr(), src, nbytes, 3, stream.cuda_stream)

            src0 = opened.tensor[layouts[0].handle.offset + HEADER: layouts[0].handle.offset + HEADER + nbytes]
            measure("torch copy, one region", lambda _src, src0=src0: (dst.copy_(src0), torch.cuda.synchronize()), srcs[:1] * count)
            measure("copy, one region", copy, srcs[:1] * count, gpu=True)
            measure("copy, fresh regions", copy, srcs, gpu=True)
            measure("copy + trailer tag", copy_tag, srcs, gpu=True)
            measure("copy + output alloc", copy_alloc, srcs)
            by_src = dict(zip(srcs, layouts))
            measure("pull, no release", lambda src: quiet.pull(by_src[src]), srcs)
            del src0
            opened.close()
            for layout in layouts:
                producer.call("release", layout.handle.lease_id)
            row["pull"] = {"us": _pull_us(producer, consumer, tensor, count), "gpu_us": None}
            rows.append(row)
            print(json.dumps(row), flush=True)
        for each in (consumer, quiet):
            each.close()
    _print_breakdown(rows)
    return rows


def _measure(op, regions, stream, sync, gpu: bool) -> dict:
    """Median host us (and, with ``gpu``, CUDA-event us) of ``op(src)`` over ``regions``, three rounds, the first
    operation left out."""
    times, gpu_times = [], []
    for _ in range(3):
        for src in regions:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            started = time.perf_counter()
            if gpu:
                start.record(stream)
            op(src)
            if gpu:
                end.record(stream)
            sync(stream.cuda_stream)
            times.append(time.perf_counter() - started)
            if gpu:
                gpu_times.append(start.elapsed_time(end) * 1e3)
    return {"us": statistics.median(times[1:]) * 1e6, "gpu_us": statistics.median(gpu_times[1:]) if gpu else None}


def _pull_us(producer, consumer, tensor, count: int) -> float:
    """Median us of a whole ``EmbeddingConsumer.pull`` (release included) of fresh leases, three rounds of
    ``count``, each round's first pull left out."""
    from devtools.diagnostics.pool_process import make_layout

    times = []
    for _ in range(3):
        layouts = [make_layout(doc, tensor) for doc in producer.call("publish_many", tensor, count)]
        for i, layout in enumerate(layouts):
            started = time.perf_counter()
            consumer.pull(layout)
            if i:
                times.append(time.perf_counter() - started)
        for layout in layouts:
            producer.wait_state(layout.handle.lease_id, None)
    return statistics.median(times) * 1e6


def _print_breakdown(rows: list[dict]) -> None:
    steps = [k for k in rows[0] if k != "bytes"]
    print("\n| size | " + " | ".join(steps) + " |")
    print("|---|" + "---|" * len(steps))
    for row in rows:
        cells = [f"{row[k]['us']:.0f}" + (f" ({row[k]['gpu_us']:.0f})" if row[k]["gpu_us"] is not None else "")
                 for k in steps]
        print(f"| {row['bytes'] >> 20} MiB | " + " | ".join(cells) + " |")


def print_tables(encoder_rows: list[dict], handoff_rows: list[dict]) -> None:
    impls = ["transformers", "packed", "packed+compile"]
    if encoder_rows:
        print("\n| image | batch | " + " | ".join(f"{i} img/s (% peak)" for i in impls) + " | packed+compile / transformers |")
        print("|---|---|" + "---|" * (len(impls) + 1))
        for row in encoder_rows:
            if "accuracy" in row:
                continue
            cells = [f"{row[i]['img_s']:.1f} ({row[i]['pct_peak']:.1f}%)" for i in impls]
            ratio = row["packed+compile"]["img_s"] / row["transformers"]["img_s"]
            print(f"| {row['size']} px | {row['batch']} | " + " | ".join(cells) + f" | {ratio:.1f}x |")
    if handoff_rows:
        paths = ["ipc", "ipc x4", "ipc->host", "nixl", "cuda-ipc copy"]
        print("\n| size | " + " | ".join(f"{p} GB/s (us)" for p in paths)
              + " | cuda-ipc copy x4 GB/s | ipc / cuda-ipc copy | ipc x4 / cuda-ipc copy x4 |")
        print("|---|" + "---|" * (len(paths) + 3))
        for row in handoff_rows:
            cells = [f"{row[p]['GBps']:.1f} ({row[p]['us']:.0f})" if p in row else "-" for p in paths]
            limits = {"ipc": row["cuda-ipc copy"]["GBps"], "ipc x4": row["cuda-ipc copy"]["GBps_x4"]}
            ratios = [f"{100 * row[p]['GBps'] / limits[p]:.0f}%" if p in row else "-" for p in ("ipc", "ipc x4")]
            size = row["bytes"]
            label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
            print(f"| {label} | " + " | ".join(cells + [f"{row['cuda-ipc copy']['GBps_x4']:.1f}"] + ratios) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="two cases each (a smoke run)")
    parser.add_argument("--skip", choices=["encoder", "handoff"], action="append", default=[])
    parser.add_argument("--json", help="write all rows here")
    parser.add_argument("--breakdown", action="store_true", help="only where a pull's time goes (handoff_breakdown)")
    args = parser.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    if args.breakdown:
        handoff_breakdown(args.quick)
        return
    handoff = bench_handoff(args.quick) if "handoff" not in args.skip else []
    encoder = bench_encoder(args.quick) if "encoder" not in args.skip else []
    print_tables(encoder, handoff)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"encoder": encoder, "handoff": handoff}, fh, indent=1)


if __name__ == "__main__":
    main()
