"""Synthetic test and benchmark images: deterministic random pixels, encoded as real PNG/JPEG bytes."""
from __future__ import annotations

import io

import numpy as np
from PIL import Image


def make_image(width: int, height: int, seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def image_bytes(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    make_image(width, height, seed).save(buf, fmt)
    return buf.getvalue()
