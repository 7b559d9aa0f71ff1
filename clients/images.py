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


def screenshot(width: int, height: int, seed: int = 0) -> Image.Image:
    """A desktop-like screenshot drawn from ``seed``: a title bar, a sidebar, panels, buttons and lines of "text" (dark
    bars), on flat colours; compresses as real screenshots do (tens of KiB as PNG at 1280x720, random pixels: MiB)."""
    from PIL import ImageDraw

    rng = np.random.default_rng(seed)
    between = lambda low, high: int(rng.integers(low, max(low + 1, high)))  # noqa: E731  (any size: never empty)
    colour = lambda low, high: tuple(int(v) for v in rng.integers(low, high, 3))  # noqa: E731
    image = Image.new("RGB", (width, height), colour(200, 256))
    draw = ImageDraw.Draw(image)
    bar = max(8, height // 24)
    draw.rectangle((0, 0, width, bar), fill=colour(20, 90))
    side = int(width * rng.uniform(0.12, 0.25))
    draw.rectangle((0, bar, side, height), fill=colour(150, 220))
    for _ in range(between(4, 10)):  # panels, each with a button and lines of text
        x0, y0 = between(side, width - 40), between(bar, height - 30)
        x1, y1 = min(width - 1, x0 + between(60, width // 2)), min(height - 1, y0 + between(30, height // 3))
        draw.rectangle((x0, y0, x1, y1), fill=colour(225, 256), outline=colour(0, 120))
        draw.rectangle((x0 + 4, y1 - 14, x0 + 60, y1 - 4), fill=colour(30, 200))
        for line in range(y0 + 6, y1 - 20, 9):
            draw.rectangle((x0 + 6, line, x0 + 6 + between(10, x1 - x0 - 12), line + 4), fill=colour(0, 80))
    return image


def screenshot_bytes(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    screenshot(width, height, seed).save(buf, fmt)
    return buf.getvalue()
