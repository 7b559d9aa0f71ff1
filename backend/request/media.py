"""Loading and validating media items (images) from request bytes and URLs.

Who calls it: the request parser, once per media item, before anything is sent to an engine.
Every failure is an ``InvalidInput`` naming the field (``image[0]``, ``messages[1].content[0]``).
"""
from __future__ import annotations

import base64
import binascii
import io
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from backend.protocol.errors import InvalidInput

# Leading bytes of the formats PIL is asked to open; anything else is tried as base64.
_MAGIC = (b"\x89PNG", b"\xff\xd8\xff", b"GIF8", b"BM", b"RIFF", b"II*\x00", b"MM\x00*")
_FORMATS = ("PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF")


@dataclass(frozen=True)
class MediaLimits:
    """Per-item limits. ``allowed_local_media_path`` empty: ``file://`` URLs are refused. ``allowed_media_domains``
    empty: ``http(s)://`` URLs are refused; else only those hosts (exact names, as vLLM's engine argument of
    that name), no redirects, at most ``max_item_bytes``, ``url_timeout`` seconds."""

    max_image_pixels: int = 16_000_000
    max_item_bytes: int = 32 << 20
    allowed_local_media_path: str = ""
    allowed_media_domains: tuple[str, ...] = ()
    url_timeout: float = 5.0


class _DecodeCounter:
    """Media decodes performed in this process (models export it as ``epd_media_decodes_total``)."""

    count = 0


decode_counter = _DecodeCounter()


def decode_image(data: bytes, field: str, limits: MediaLimits) -> Image.Image:
    """Decode encoded image bytes (or their base64 text) into an RGB PIL image."""
    decode_counter.count += 1
    if not data:
        raise InvalidInput(field, "empty image")
    if len(data) > limits.max_item_bytes:
        raise InvalidInput(field, f"image is {len(data)} bytes, over the {limits.max_item_bytes}-byte limit")
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
    """The encoded bytes named by a ``data:`` URL or an allowed ``file://`` path (not decoded)."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        header, sep, payload = url.partition(",")
        if not sep or ";base64" not in header:
            raise InvalidInput(field, "data URL must be base64: data:image/<type>;base64,<data>")
        if not header[5:].startswith("image/"):
            raise InvalidInput(field, f"unsupported media type {header[5:].split(';')[0]!r}")
        try:
            raw = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidInput(field, "data URL payload is not valid base64") from None
        if not raw:
            raise InvalidInput(field, "empty image")
        return raw
    if scheme == "file":
        return _read_local_file(url, field, limits)
    if scheme in ("http", "https"):
        return _read_remote(url, field, limits)
    raise InvalidInput(field, f"unsupported URL scheme {scheme!r}; use data:, file:// or http(s)://")


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise urllib.error.HTTPError(req.full_url, code, f"redirect to {newurl} refused", headers, fp)


def _read_remote(url: str, field: str, limits: MediaLimits) -> bytes:
    host = (urllib.parse.urlparse(url).hostname or "").lower()
    if not limits.allowed_media_domains:
        raise InvalidInput(field, "http(s) media URLs are disabled (no allowed_media_domains configured)")
    if host not in limits.allowed_media_domains:
        raise InvalidInput(field, f"media host {host!r} is not in allowed_media_domains")
    opener = urllib.request.build_opener(_NoRedirects)
    try:
        with opener.open(url, timeout=limits.url_timeout) as response:
            data = response.read(limits.max_item_bytes + 1)
    except urllib.error.HTTPError as exc:
        raise InvalidInput(field, f"cannot fetch {url}: HTTP {exc.code} {exc.msg}") from None
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise InvalidInput(field, f"cannot fetch {url} within {limits.url_timeout:g} s: {reason}") from None
    if len(data) > limits.max_item_bytes:
        raise InvalidInput(field, f"media at {url} is over the {limits.max_item_bytes}-byte limit")
    if not data:
        raise InvalidInput(field, "empty image")
    return data


def _read_local_file(url: str, field: str, limits: MediaLimits) -> bytes:
    if not limits.allowed_local_media_path:
        raise InvalidInput(field, "file:// URLs are disabled (no allowed_local_media_path configured)")
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise InvalidInput(field, f"file:// URL names a remote host {parsed.netloc!r}")
    root = Path(limits.allowed_local_media_path).resolve()
    path = Path(urllib.parse.unquote(parsed.path)).resolve()  # resolves symlinks too
    if not path.is_relative_to(root):
        raise InvalidInput(field, f"path is outside the allowed media directory {str(root)!r}")
    try:
        size = path.stat().st_size
        if size > limits.max_item_bytes:
            raise InvalidInput(field, f"file is {size} bytes, over the {limits.max_item_bytes}-byte limit")
        with open(path, "rb") as fh:
            return fh.read(limits.max_item_bytes + 1)
    except (FileNotFoundError, IsADirectoryError, PermissionError, NotADirectoryError) as exc:
        raise InvalidInput(field, f"cannot read {str(path)!r} ({exc.strerror or exc})") from None


__all__ = ["MediaLimits", "decode_image", "load_image_url", "read_image_url"]
