"""Image items in the request stage: decoding and validating images (bytes, their base64 text, or what a URL
names), registered as the image modality's ``MediaHandler`` (``backend.request.media``).
"""
from __future__ import annotations

import base64
import binascii
import io

from PIL import Image, UnidentifiedImageError

from backend.protocol.errors import InvalidInput
from backend.protocol.modality import IMAGE
from backend.request.media import MediaHandler, MediaLimits, check_encoded, decode_counter, read_url, register_handler

# Leading bytes of the formats PIL is asked to open; anything else is tried as base64.
_MAGIC = (b"\x89PNG", b"\xff\xd8\xff", b"GIF8", b"BM", b"RIFF", b"II*\x00", b"MM\x00*")
_FORMATS = ("PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF")


def decode_image(data: bytes, field: str, limits: MediaLimits) -> Image.Image:
    """Decode encoded image bytes (or their base64 text) into an RGB PIL image."""
    decode_counter.add()
    data = check_encoded(data, field, limits, IMAGE)
    if not data.startswith(_MAGIC):
        try:
            data = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidInput(field, "not a PNG/JPEG/GIF/BMP/WEBP/TIFF image, nor base64 of one") from None
    try:
        with Image.open(io.BytesIO(data), formats=_FORMATS) as probe:
            width, height = probe.size
            if width * height > limits.max_image_pixels:
                raise InvalidInput(field, f"image is {width}x{height}, over the {limits.max_image_pixels}-pixel limit")
            probe.load()
            return probe.convert("RGB")
    except InvalidInput:
        raise
    except UnidentifiedImageError:
        raise InvalidInput(field, "cannot decode image (not a recognised image format)") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise InvalidInput(field, f"cannot decode image ({exc})") from None


def load_image_url(url: str, field: str, limits: MediaLimits) -> Image.Image:
    """Load an image named by a ``data:`` URL or an allowed ``file://`` path."""
    return decode_image(read_image_url(url, field, limits), field, limits)


def read_image_url(url: str, field: str, limits: MediaLimits) -> bytes:
    """The encoded bytes named by a ``data:image/...`` URL, an allowed ``file://`` path or ``http(s)://`` URL."""
    return read_url(url, field, limits, IMAGE)


def sample_image() -> bytes:
    """A 32x32 grey PNG (the handler's ``sample``)."""
    out = io.BytesIO()
    Image.new("RGB", (32, 32), (127, 127, 127)).save(out, "PNG")
    return out.getvalue()


register_handler(IMAGE, MediaHandler(decode_image, read_image_url, Image.Image, sample_image))

__all__ = ["decode_image", "load_image_url", "read_image_url", "sample_image"]
