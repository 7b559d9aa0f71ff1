"""The encoder's host CPU per image, by ``image_preprocess`` mode: one process set up as an encoder instance is
(``prepare_process``: one intra-op thread; the service's decode threads), batches of images encoded through
``EncoderService.run`` (decode, preprocess, tower forward, publish into a pool), CPU seconds of the whole process
(``time.process_time``: every thread) over the images.

    python -m clients.tools.image_cpu MODEL --device cuda:0 --size 896 --batch 8 --repeats 5 \
        --max-pixels 12845056

``--max-pixels``: the processor's pixel cap replaced (a copy of MODEL's folder with its preprocessor config changed,
the rest linked): the tiny checkpoint's 12,544 would resize an 896 px image to 112 px, where a real Qwen2-VL-2B's
12,845,056 keeps it at 896 (the host cost the issue measured); the tower's own cost is the model's, in every mode.

Prints one row per (mode, format): CPU ms per image and wall ms per batch (median of the repeats, after two
warm-up batches), and the threads that spent it (``/proc/self/task``, by thread name, ms per image over the timed
batches: which of the main thread, the decode threads, CUDA's, NIXL/UCX's); ``--json PATH`` writes them. On a host
without CUDA only ``cpu`` runs (``--device cpu``).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import time
from dataclasses import dataclass

MODES = ("cpu", "gpu", "nvjpeg")


@dataclass(frozen=True)
class Row:
    mode: str
    fmt: str
    cpu_ms_per_image: float
    wall_ms_per_batch: float
    images: int
    threads: dict  # thread name -> CPU ms per image over the timed batches (the largest few)


def thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's threads by name (``/proc/self/task``, Linux; threads of one name summed; {} where
    there is no /proc)."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return out
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as fh:
                name = fh.read().strip()
            with open(f"/proc/self/task/{task}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return out


def _images(size: int, count: int, fmt: str) -> list[bytes]:
    """``count`` distinct synthetic images (clients.images: random pixels, the benchmark's) of ``size`` px square."""
    from clients.images import make_image

    out = []
    for seed in range(count):
        data = io.BytesIO()
        make_image(size, size, seed).save(data, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
        out.append(data.getvalue())
    return out


def with_max_pixels(model: str, max_pixels: int, where: str) -> str:
    """A folder ``where`` with ``model``'s files linked and its preprocessor config's longest edge (pixel cap)
    set to ``max_pixels``."""
    from pathlib import Path

    source, target = Path(model).resolve(), Path(where)
    target.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.name != "preprocessor_config.json" and not (target / path.name).exists():
            (target / path.name).symlink_to(path)
    config = json.loads((source / "preprocessor_config.json").read_text())
    config.setdefault("size", {})["longest_edge"] = max_pixels
    if "max_pixels" in config:
        config["max_pixels"] = max_pixels
    (target / "preprocessor_config.json").write_text(json.dumps(config))
    return str(target)


def _service(encoder, device: str, mode: str):
    from backend.encode.service import EncoderService
    from backend.request.generate import checkpoint_media  # noqa: F401 - registers the modalities
    from backend.request.media import MediaLimits
    from backend.transfer.producer import EmbeddingPool

    image = {} if mode == "cpu" else {"image_device": device, "nvjpeg": mode == "nvjpeg"}
    limits = MediaLimits(max_item_bytes=64 << 20, **image)
    pool = EmbeddingPool(512 << 20, lease_seconds=30, device=device)
    return EncoderService(encoder, pool, limits, cache_bytes=0), pool


def measure(encoder, device: str, mode: str, fmt: str, size: int, batch: int, repeats: int) -> Row:
    """CPU ms per image and wall ms per batch (medians) of ``repeats`` batches of ``batch`` distinct images."""
    import torch

    from backend.encode.service import EncodeJob

    service, pool = _service(encoder, device, mode)
    cpu, wall, threads = [], [], {}
    try:
        for index in range(repeats + 2):
            datas = _images(size, batch, fmt)  # made outside the timed part
            jobs = [EncodeJob(0, data, f"{mode}-{fmt}-{index}-{k}", modality="image") for k, data in enumerate(datas)]
            before = thread_cpu()
            started, clock = time.process_time(), time.perf_counter()
            (layouts,) = service.run(jobs, 1)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            cpu_s, wall_s = time.process_time() - started, time.perf_counter() - clock
            if index >= 2:
                for name, seconds in thread_cpu().items():
                    threads[name] = threads.get(name, 0.0) + max(0.0, seconds - before.get(name, 0.0))
            if isinstance(layouts, BaseException):
                raise layouts
            for doc in layouts:
                pool.release(json.loads(doc)["handle"]["lease_id"])
            if index >= 2:
                cpu.append(cpu_s * 1000 / batch)
                wall.append(wall_s * 1000)
    finally:
        pool.close()
    top = sorted(threads.items(), key=lambda kv: -kv[1])[:4]
    per_image = {name: round(seconds * 1000 / (batch * repeats), 1) for name, seconds in top if seconds > 0}
    return Row(mode, fmt, statistics.median(cpu), statistics.median(wall), batch, per_image)


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--size", type=int, default=896)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--formats", default="PNG,JPEG")
    parser.add_argument("--max-pixels", type=int, default=0, help="the processor's pixel cap (0: the checkpoint's)")
    parser.add_argument("--blocking-sync", action="store_true",
                        help="the process's waits for the GPU sleep instead of spin (backend.encode.cuda_wait)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    from backend.engine.host import prepare_process

    prepare_process()
    blocking = False
    if args.blocking_sync and args.device.startswith("cuda"):
        from backend.encode.cuda_wait import block_on_waits
        blocking = block_on_waits(int(args.device.partition(":")[2] or 0))
    import torch

    from backend.encode.encoder import load_encoder

    import tempfile

    with tempfile.TemporaryDirectory(prefix="epd-image-cpu-") as capped:  # removed after the load (it left one)
        model = with_max_pixels(args.model, args.max_pixels, capped) if args.max_pixels else args.model
        encoder = load_encoder(model, device=args.device, dtype=getattr(torch, args.dtype))
    encoder.warm_up()
    modes = [m for m in args.modes.split(",") if m == "cpu" or args.device.startswith("cuda")]
    rows = [measure(encoder, args.device, mode, fmt, args.size, args.batch, args.repeats)
            for fmt in args.formats.split(",") for mode in modes]
    print(f"encoder host CPU per image, {args.size}x{args.size} random-pixel images, batches of {args.batch}, "
          f"{args.dtype} tower on {args.device}, waits for the GPU {'sleep' if blocking else 'spin'}")
    print("| mode | format | CPU ms / image | wall ms / batch | threads, CPU ms / image |\n|---|---|---|---|---|")
    for row in rows:
        threads = ", ".join(f"{name} {ms}" for name, ms in row.threads.items())
        print(f"| {row.mode} | {row.fmt} | {row.cpu_ms_per_image:.1f} | {row.wall_ms_per_batch:.1f} | {threads} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([row.__dict__ for row in rows], fh, indent=1)
    return rows


if __name__ == "__main__":
    main()
