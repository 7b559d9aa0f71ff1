"""Synthetic test and benchmark videos: small clips written with OpenCV's ``mp4v`` encoder (deterministic for the same
arguments): a coloured background per ``seed`` and a disc moving across it, so frames differ in time and videos between
seeds; and H.264 clips (``make_h264_video``, PyAV's libx264), the codec NVDEC decodes."""
from __future__ import annotations

import os
import tempfile

import numpy as np


def make_video(width: int = 128, height: int = 96, frames: int = 20, fps: float = 10.0, seed: int = 0,
               fourcc: str = "mp4v", suffix: str = ".mp4") -> bytes:
    """An MP4 (mp4v) of ``frames`` frames of ``width`` x ``height`` at ``fps``; ``fourcc`` and ``suffix`` pick
    another codec and container OpenCV writes (``"MJPG"``, ``".avi"``)."""
    import cv2

    rng = np.random.default_rng(seed)
    background = rng.integers(0, 256, 3).tolist()
    disc = rng.integers(0, 256, 3).tolist()
    fd, path = tempfile.mkstemp(suffix=suffix)
    os.close(fd)
    try:
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*fourcc), fps, (width, height))
        for i in range(frames):
            frame = np.empty((height, width, 3), np.uint8)
            frame[:] = background
            cv2.circle(frame, ((i * 7) % width, height // 2), max(4, height // 6), disc, -1)
            writer.write(frame)
        writer.release()
        with open(path, "rb") as fh:
            return fh.read()
    finally:
        os.unlink(path)


def make_h264_video(width: int = 448, height: int = 448, frames: int = 30, fps: int = 30, seed: int = 0,
                    tags: str = "", noise: bool = True) -> bytes:
    """An H.264 MP4 (PyAV's libx264, crf 18, yuv420p) of ``frames`` frames: random pixels (``noise``: every level of
    every plane, what a converter can get wrong) or smooth moving gradients (phase by ``seed``); ``tags``: x264 VUI colour parameters
    (``"colormatrix=bt709:colorprim=bt709:transfer=bt709"``; "" untagged)."""
    from backend.request.clips import h264_mp4

    rng = np.random.default_rng(seed)
    shift = rng.integers(0, 256, 3)  # the gradients' phase: another seed, another video
    y, x = np.mgrid[0:height, 0:width]

    def frame(index: int) -> np.ndarray:
        if noise:
            return rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        return np.stack([(x + 4 * index + shift[0]) % 256, (y + 2 * index + shift[1]) % 256,
                         ((x + y) // 2 + 8 * index + shift[2]) % 256], -1).astype(np.uint8)

    return h264_mp4((frame(i) for i in range(frames)), width, height, fps,
                    {"crf": "18", **({"x264-params": tags} if tags else {})})


def opencv_frames(data: bytes) -> np.ndarray:
    """Every frame of an encoded video as OpenCV's FFmpeg decodes it (RGB ``[T, H, W, 3]``), as vLLM's ``opencv``
    loader reads frames: the CPU path's frames."""
    import io

    import cv2

    stream = io.BytesIO(data)  # read by the capture until released: it must outlive it
    capture = cv2.VideoCapture(stream, cv2.CAP_FFMPEG, [])
    frames = []
    while True:
        ok, frame = capture.read()
        if not ok:
            break
        frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
    capture.release()
    return np.stack(frames)


__all__ = ["make_h264_video", "make_video", "opencv_frames"]
