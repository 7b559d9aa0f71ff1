"""NVDEC against the CPU decoder on the same H.264 clips: do the frames agree, and how much faster is the GPU?

The encoder decodes videos on the CPU (vLLM's loader, OpenCV's FFmpeg: ``backend.request.video``). Before a GPU path
goes into it (issue 21, item 5), this measures what NVDEC through PyNvVideoCodec (NVIDIA's maintained binding, a wheel
on PyPI) gives on the lent H200: every frame against OpenCV's, and the decode time of 30-frame clips on both.

  python -m clients.tools.nvdec_probe make --out DIR   here: H.264 clips (PyAV's libx264: ``pip install av`` in any
                                                       venv; OpenCV's wheel encodes no H.264) and OpenCV's frames of
                                                       each (``reference.npz``)
  python -m clients.tools.nvdec_probe run --clips DIR  on the GPU machine (PyNvVideoCodec and torch importable; OpenCV
                                                       too, if there, for the CPU time on the same host): JSON per clip
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

# name -> (width, height, x264 colour tags); 30 frames each, 30 fps. Untagged, FFmpeg (OpenCV) converts with BT.601
# whatever the size; the tagged clip says so in its stream, for decoders that pick the matrix by size otherwise
CLIPS = {"448x448": (448, 448, ""), "1280x720": (1280, 720, ""),
         "1280x720-bt601-tagged": (1280, 720, "colormatrix=smpte170m:colorprim=smpte170m:transfer=smpte170m")}
FRAMES = 30
CHECKED = [0, 7, 15, 22, 29]  # the frames compared (all 30 of both clips would not fit the 64 MiB a device call carries)


def _pattern(width: int, height: int, index: int) -> np.ndarray:
    """A moving gradient with a bright square: detail and motion a decoder can get wrong."""
    y, x = np.mgrid[0:height, 0:width]
    frame = np.stack([(x + 4 * index) % 256, (y + 2 * index) % 256, ((x + y) // 2 + 8 * index) % 256], -1)
    side = max(16, min(width, height) // 6)
    top, left = (7 * index) % (height - side), (11 * index) % (width - side)
    frame[top:top + side, left:left + side] = 250
    return frame.astype(np.uint8)


def make(out: Path) -> None:
    import av  # noqa: PLC0415 - only this subcommand needs it

    out.mkdir(parents=True, exist_ok=True)
    reference = {}
    for name, (width, height, tags) in CLIPS.items():
        path = out / f"{name}.mp4"
        with av.open(str(path), "w") as container:
            stream = container.add_stream("libx264", rate=30)
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            stream.options = {"crf": "18", **({"x264-params": tags} if tags else {})}
            for index in range(FRAMES):
                for packet in stream.encode(av.VideoFrame.from_ndarray(_pattern(width, height, index), "rgb24")):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
        reference[name] = _cpu_frames(path)[CHECKED]
    np.savez_compressed(out / "reference.npz", **reference)
    print(json.dumps({name: list(frames.shape) for name, frames in reference.items()}))


def _cpu_frames(path: Path) -> np.ndarray:
    """Every frame as OpenCV's FFmpeg decodes it (RGB), as vLLM's ``opencv`` backend reads frames."""
    from clients.videos import opencv_frames  # noqa: PLC0415

    return opencv_frames(path.read_bytes())


def _gpu_frames(path: Path, decoder=None):
    """Every frame NVDEC decodes (PyNvVideoCodec, RGB, in device memory) as one uint8 CUDA tensor [frames, h, w, 3]:
    by a new decoder, or by ``decoder`` reconfigured for ``path`` (a cached one: no session set-up per clip)."""
    import PyNvVideoCodec as nvc  # noqa: PLC0415
    import torch  # noqa: PLC0415

    if decoder is None:
        decoder = nvc.SimpleDecoder(str(path), gpu_id=0, use_device_memory=True,
                                    output_color_type=nvc.OutputColorType.RGB)
    else:
        decoder.reconfigure_decoder(str(path))
    frames = decoder.get_batch_frames(len(decoder))
    return torch.stack([torch.from_dlpack(frame) for frame in frames])


def median_seconds(decode, repeats: int = 5) -> float:
    """The median seconds of ``decode()`` after one warm-up call."""
    decode()
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        decode()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def run(clips: Path) -> None:
    import PyNvVideoCodec as nvc  # noqa: PLC0415
    import torch  # noqa: PLC0415

    cached = nvc.SimpleDecoder(str(clips / f"{next(iter(CLIPS))}.mp4"), gpu_id=0, use_device_memory=True,
                               output_color_type=nvc.OutputColorType.RGB, max_width=1920, max_height=1080)

    reference = np.load(clips / "reference.npz")
    report = {}
    for name in CLIPS:
        path = clips / f"{name}.mp4"
        decoded = _gpu_frames(path)
        gpu = decoded[CHECKED] if len(decoded) == FRAMES else decoded
        want = torch.from_numpy(reference[name]).to(gpu.device)
        diff = (gpu.to(torch.int16) - want.to(torch.int16)).abs() if gpu.shape == want.shape else None
        row = {"frames": list(decoded.shape), "compared": list(want.shape)}
        if diff is not None:
            row.update(max_abs_diff=int(diff.max()), mean_abs_diff=round(float(diff.float().mean()), 3),
                       over_4_levels=round(float((diff > 4).float().mean()), 5))

        def decode_on_gpu():
            _gpu_frames(path)
            torch.cuda.synchronize()

        def decode_cached():
            _gpu_frames(path, cached)
            torch.cuda.synchronize()

        row["nvdec_ms"] = round(median_seconds(decode_on_gpu) * 1000, 2)
        row["nvdec_cached_ms"] = round(median_seconds(decode_cached) * 1000, 2)
        try:
            row["cpu_ms"] = round(median_seconds(lambda: _cpu_frames(path)) * 1000, 2)
            row["speedup"] = round(row["cpu_ms"] / row["nvdec_ms"], 2)
            row["speedup_cached"] = round(row["cpu_ms"] / row["nvdec_cached_ms"], 2)
        except ImportError as exc:
            row["cpu_ms"] = f"no OpenCV here ({exc})"
        report[name] = row
    print(json.dumps(report, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("make").add_argument("--out", type=Path, required=True)
    sub.add_parser("run").add_argument("--clips", type=Path, required=True)
    args = parser.parse_args()
    make(args.out) if args.command == "make" else run(args.clips)


if __name__ == "__main__":
    main()
