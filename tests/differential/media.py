"""The differential cases' media, built from their specs (plain dicts, so a case prints and replays as it is): every
builder is deterministic for the same spec, and cheap for the small sizes the generator favours.

Specs:
- image ``{"w", "h", "fmt": PNG|JPEG|WEBP|GIF|BMP, "mode": RGB|L|RGBA|P|LA, "seed"}``: a coarse random mosaic over a
  gradient (compresses well at 1,024 px, differs between seeds), saved in ``mode`` (JPEG: RGB or L only).
- video ``{"w", "h", "frames", "fps", "codec": mp4v|h264, "seed"}``: ``clients.videos.make_video`` (OpenCV's mp4v)
  or ``backend.request.clips.h264_mp4`` (PyAV's libx264) of moving gradients; h264 needs even sizes and an integer
  fps, which the generator gives.
- audio ``{"seconds", "rate", "channels", "fmt": WAV|FLAC, "seed"}``: ``clients.audios.make_audio``.

``broken(data, how)`` spoils an item's bytes the ways the invalid cases need.
"""
from __future__ import annotations

import base64
import functools
import io

import numpy as np

MIME = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif", "BMP": "image/bmp",
        "WAV": "audio/wav", "FLAC": "audio/flac"}


def image(spec: dict) -> bytes:
    """The encoded image of ``spec``."""
    from PIL import Image

    rng = np.random.default_rng(spec["seed"])
    w, h = spec["w"], spec["h"]
    cells = rng.integers(0, 256, (max(1, h // 16), max(1, w // 16), 3), dtype=np.uint8)
    mosaic = np.asarray(Image.fromarray(cells).resize((w, h), Image.NEAREST), dtype=np.int32)
    ramp = (np.arange(w)[None, :, None] * 97 // max(1, w) + np.arange(h)[:, None, None] * 61 // max(1, h))
    pixels = ((mosaic + ramp) % 256).astype(np.uint8)
    picture = Image.fromarray(pixels)
    if spec["mode"] in ("RGBA", "LA"):
        alpha = Image.fromarray(rng.integers(64, 256, (h, w), dtype=np.uint8))
        picture = picture.convert(spec["mode"][:-1])
        picture.putalpha(alpha)
    elif spec["mode"] == "P":
        picture = picture.quantize(colors=int(rng.integers(8, 256)))
    else:
        picture = picture.convert(spec["mode"])
    out = io.BytesIO()
    picture.save(out, spec["fmt"])
    return out.getvalue()


def video(spec: dict) -> bytes:
    """The encoded video of ``spec``."""
    if spec["codec"] == "mp4v":
        from clients.videos import make_video

        return make_video(spec["w"], spec["h"], frames=spec["frames"], fps=spec["fps"], seed=spec["seed"])
    from backend.request.clips import h264_mp4

    w, h = spec["w"], spec["h"]
    shift = np.random.default_rng(spec["seed"]).integers(0, 256, 3)
    y, x = np.mgrid[0:h, 0:w]

    def frame(i: int) -> np.ndarray:
        return np.stack([(x * 3 + 5 * i + shift[0]) % 256, (y * 2 + 3 * i + shift[1]) % 256,
                         ((x + y) + 9 * i + shift[2]) % 256], -1).astype(np.uint8)

    return h264_mp4((frame(i) for i in range(spec["frames"])), w, h, int(spec["fps"]), {"crf": "23"})


def audio(spec: dict) -> bytes:
    """The encoded audio file of ``spec``."""
    from clients.audios import make_audio

    return make_audio(spec["seconds"], spec["rate"], spec["channels"], seed=spec["seed"], file_format=spec["fmt"])


BUILDERS = {"image": image, "video": video, "audio": audio}


@functools.lru_cache(maxsize=256)
def _built(modality: str, frozen: tuple) -> bytes:
    return BUILDERS[modality](dict(frozen))


def build(modality: str, spec: dict) -> bytes:
    """``spec``'s bytes (cached: a case's requests through every deployment and route share them)."""
    return _built(modality, tuple(sorted(spec.items())))


def mime(modality: str, spec: dict) -> str:
    """The MIME type a data URL of the item carries."""
    return "video/mp4" if modality == "video" else MIME[spec["fmt"]]


def broken(data: bytes, how: str) -> bytes:
    """``data`` spoilt: ``truncated`` (its first third), ``garbage`` (its first 16 bytes, then noise), ``empty``."""
    if how == "truncated":
        return data[: max(1, len(data) // 3)]
    if how == "garbage":
        return data[:16] + bytes(np.random.default_rng(len(data)).integers(0, 256, 2048, dtype=np.uint8))
    if how == "empty":
        return b""
    raise ValueError(f"unknown breakage {how!r}")


def data_url(mime_type: str, data: bytes) -> str:
    return f"data:{mime_type};base64," + base64.b64encode(data).decode()
