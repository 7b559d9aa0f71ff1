"""Image items in the request stage: decoding and validating images (bytes, their base64 text, or what a URL
names), registered as the image modality's ``MediaHandler`` (``backend.request.media``).

An encoder with ``image_preprocess: gpu`` or ``nvjpeg`` (``MediaLimits.image_device``) gets each image as a [3, H, W]
uint8 tensor on its GPU, which ``backend.encode.gpu_image`` preprocesses there: decoded on the host as below (the same
pixels) and copied over, or, with ``nvjpeg``, a baseline or progressive RGB/greyscale JPEG decoded by nvJPEG
(torchvision's CUDA ``decode_jpeg``). Measured on the H200 against PIL (libjpeg-turbo; docs/gpu.md): the same pixels
without chroma subsampling (4:4:4, greyscale); with it (4:2:0, 4:2:2: most JPEGs) another chroma upsampling, 2-3
levels apart on smooth content and up to 142 (mean 14) where chroma changes from pixel to pixel, enough to change a
greedy token now and then. A JPEG nvJPEG refuses falls back to the host, its reason logged once; ``IMAGE_DECODES``
counts both.
"""
from __future__ import annotations

import base64
import binascii
import io
import logging
import warnings
from collections import Counter

import numpy as np
from PIL import Image, UnidentifiedImageError

from backend.protocol.errors import InvalidInput
from backend.protocol.modality import IMAGE
from backend.request.media import MediaHandler, MediaLimits, check_encoded, decode_counter, read_url, register_handler

# Leading bytes of the formats PIL is asked to open; anything else is tried as base64.
_MAGIC = (b"\x89PNG", b"\xff\xd8\xff", b"GIF8", b"BM", b"RIFF", b"II*\x00", b"MM\x00*")
_FORMATS = ("PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF")
IMAGE_DECODES: Counter = Counter()  # images decoded to tensors in this process, by decoder: "nvjpeg" or "cpu"
_NVJPEG_MODES = ("RGB", "L")  # what nvJPEG's RGB output gives as PIL's convert("RGB") does (not CMYK/YCCK)
_FELL_BACK: set[str] = set()
LOG = logging.getLogger(__name__)
# PIL's array view is read-only; the tensor made from it is only ever copied (to the device, or by contiguous())
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


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
            if limits.image_device:
                return _image_tensor(data, probe, limits)
            probe.load()
            return probe.convert("RGB")
    except InvalidInput:
        raise
    except UnidentifiedImageError:
        raise InvalidInput(field, "cannot decode image (not a recognised image format)") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise InvalidInput(field, f"cannot decode image ({exc})") from None


def _image_tensor(data: bytes, probe: Image.Image, limits: MediaLimits):
    """The image as a [3, H, W] uint8 tensor on ``limits.image_device``: nvJPEG's decode where ``limits.nvjpeg`` and
    the image is a JPEG nvJPEG takes, else PIL's RGB pixels copied there."""
    import torch

    device = torch.device(limits.image_device)
    if limits.nvjpeg and device.type == "cuda" and probe.format == "JPEG" and probe.mode in _NVJPEG_MODES:
        try:
            pixels = nvjpeg_decode(data, device)
            decode_counter.tally(IMAGE_DECODES, "nvjpeg")
            return pixels
        except RuntimeError as exc:
            _fell_back(f"{type(exc).__name__}: {exc}")
    probe.load()
    rgb = np.asarray(probe.convert("RGB"))  # [H, W, 3], read-only (PIL's bytes)
    decode_counter.tally(IMAGE_DECODES, "cpu")
    with warnings.catch_warnings():  # torch warns of a read-only array; the tensor is only read (copied just below)
        warnings.simplefilter("ignore", UserWarning)
        pixels = torch.from_numpy(rgb)
    return pixels.to(device).permute(2, 0, 1).contiguous()


def nvjpeg_decode(data: bytes, device):
    """A JPEG's RGB pixels decoded by nvJPEG on ``device`` (torchvision's CUDA ``decode_jpeg``), [3, H, W] uint8 there;
    RuntimeError where it cannot."""
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    encoded = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)


def _fell_back(reason: str) -> None:
    if reason not in _FELL_BACK:
        _FELL_BACK.add(reason)
        LOG.warning("nvjpeg: a JPEG decoded on the host instead (%s)", reason)


def sample_jpeg() -> bytes:
    """A 64x48 JPEG of a colour gradient (what a nvjpeg encoder decodes at load: nvJPEG's first decode pays its set-up)."""
    out = io.BytesIO()
    ramp = np.linspace(0, 255, 64 * 48 * 3).reshape(48, 64, 3).astype(np.uint8)
    Image.fromarray(ramp).save(out, "JPEG", quality=90)
    return out.getvalue()


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

__all__ = ["IMAGE_DECODES", "decode_image", "load_image_url", "nvjpeg_decode", "read_image_url", "sample_image",
           "sample_jpeg"]
