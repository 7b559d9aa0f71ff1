"""Synthetic test and benchmark videos: small clips written with OpenCV's ``mp4v`` encoder (deterministic for the same
arguments): a coloured background per ``seed`` and a disc moving across it, so frames differ in time and videos between
seeds."""
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


__all__ = ["make_video"]
