"""Loading and validating media items, the part every modality shares: per-item limits, reading the bytes a URL
names (``data:``, ``file://``, allowed ``http(s)://``), the request stage's per-modality handlers.

Who calls it: the request parser, once per media item, before anything is sent to an engine; each modality's own
module (``backend.request.image``) decodes its items and registers its ``MediaHandler`` here. Every failure is an
``InvalidInput`` naming the field (``image[0]``, ``messages[1].content[0]``).
"""
from __future__ import annotations

import base64
import binascii
import contextlib
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from backend.protocol.errors import InvalidInput
from backend.protocol.modality import Modality


@dataclass(frozen=True)
class MediaLimits:
    """Per-item limits. ``allowed_local_media_path`` empty: ``file://`` URLs are refused. ``allowed_media_domains``
    empty: ``http(s)://`` URLs are refused; else only those hosts (exact names, as vLLM's engine argument of
    that name), no redirects, at most ``max_item_bytes``, ``url_timeout`` seconds. ``max_image_pixels`` bounds every
    video frame too; ``max_video_frames`` / ``max_video_seconds`` what a video's container may hold; ``video_processor``:
    the checkpoint's HF video processor's class name, which picks vLLM's video loader (``backend.request.video``);
    ``max_audio_seconds`` what an audio file may hold; ``audio_sampling_rate``: the checkpoint's feature extractor's
    rate, which audio items are resampled to (0: none, the file's own; ``backend.request.audio``)."""

    max_image_pixels: int = 16_000_000
    max_item_bytes: int = 32 << 20
    max_video_frames: int = 18_000
    max_video_seconds: float = 600.0
    max_audio_seconds: float = 600.0
    video_processor: str = ""
    audio_sampling_rate: int = 0
    nvdec_device: int = -1  # >= 0: videos decoded by NVDEC on that GPU (an encoder's ``video_decoder: nvdec``)
    # an encoder's ``image_preprocess`` (backend.request.image.decode_image): "" (the default) gives PIL images; a torch
    # device ("cuda:0"; "cpu" in tests) [3, H, W] uint8 tensors there, decoded on the host, JPEGs by nvJPEG with nvjpeg
    image_device: str = ""
    nvjpeg: bool = False
    allowed_local_media_path: str = ""
    allowed_media_domains: tuple[str, ...] = ()
    url_timeout: float = 5.0


SETTINGS_LIMITS = ("max_image_pixels", "max_item_bytes", "max_video_frames", "max_video_seconds", "max_audio_seconds")


def media_limits(settings) -> dict[str, Any]:
    """The ``MediaLimits`` fields a model's settings (``backend.protocol.settings.MediaSettings``) give."""
    return {name: getattr(settings, name) for name in SETTINGS_LIMITS}


class _DecodeCounter:
    """Media decodes performed in this process (models export it as ``epd_media_decodes_total``); ``add`` may be
    called from several threads (the encoder decodes a batch's items at once). Decodes in an ``uncounted()`` block
    of the calling thread (a stage's warm-up at load) are not counted."""

    count = 0
    _lock = threading.Lock()
    _local = threading.local()

    def add(self) -> None:
        if getattr(self._local, "off", False):
            return
        with self._lock:
            self.count += 1

    def tally(self, counts: Counter, key: str) -> None:
        """``counts[key] += 1`` under the same lock (e.g. ``video.VIDEO_DECODES["nvdec"]``)."""
        if getattr(self._local, "off", False):
            return
        with self._lock:
            counts[key] += 1

    @contextlib.contextmanager
    def uncounted(self):
        """Decodes made by this thread inside the block count nowhere."""
        self._local.off = True
        try:
            yield
        finally:
            self._local.off = False


decode_counter = _DecodeCounter()


@dataclass(frozen=True)
class MediaHandler:
    """A modality's item handling in the request stage: ``decode(data, field, limits, **options)`` makes what an
    engine given media takes (an RGB image; ``options``: the request's for the modality, ``MediaOptions.kwargs``); ``read_url(url, field, limits)`` the encoded bytes a URL names; ``decoded``: the
    class of what ``decode`` makes (how an engine tells a decoded item's modality, ``modality_of``); ``sample()``:
    the encoded bytes of a small valid item, which a stage decodes at load so that no request pays what the first
    decode costs (vLLM's video and audio modules imported on first use: 2-3 s on 2 cores, 8.7 s for a GPU encoder's
    first video on the H200)."""

    decode: Callable[[bytes, str, MediaLimits], Any]
    read_url: Callable[[str, str, MediaLimits], bytes]
    decoded: type = object
    sample: Callable[[], bytes] | None = None


_HANDLERS: dict[str, MediaHandler] = {}


def register_handler(modality: Modality, handler: MediaHandler) -> None:
    _HANDLERS[modality.name] = handler


def handler(modality: Modality) -> MediaHandler:
    return _HANDLERS[modality.name]


def modality_of(item: Any) -> str:
    """The modality name of a decoded item (what a handler's ``decode`` made)."""
    for name, items in _HANDLERS.items():
        if isinstance(item, items.decoded) and items.decoded is not object:
            return name
    raise TypeError(f"no modality decodes to {type(item).__name__}")


def check_encoded(data: bytes, field: str, limits: MediaLimits, modality: Modality) -> bytes:
    """Encoded item bytes as given (not decoded), refused when empty or over ``max_item_bytes``."""
    if not data:
        raise InvalidInput(field, f"empty {modality.name}")
    if len(data) > limits.max_item_bytes:
        raise InvalidInput(field, f"{modality.name} is {len(data)} bytes, over the {limits.max_item_bytes}-byte limit")
    return bytes(data)


def read_url(url: str, field: str, limits: MediaLimits, modality: Modality) -> bytes:
    """The encoded bytes of a ``modality`` item named by a ``data:`` URL (of its media type), an allowed ``file://``
    path or an allowed ``http(s)://`` URL (not decoded)."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        header, sep, payload = url.partition(",")
        if not sep or ";base64" not in header:
            raise InvalidInput(field, f"data URL must be base64: data:{modality.media_type}<type>;base64,<data>")
        if not header[5:].startswith(modality.media_type):
            raise InvalidInput(field, f"unsupported media type {header[5:].split(';')[0]!r}")
        try:
            raw = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidInput(field, "data URL payload is not valid base64") from None
        if not raw:
            raise InvalidInput(field, f"empty {modality.name}")
        return raw
    if scheme == "file":
        return _read_local_file(url, field, limits)
    if scheme in ("http", "https"):
        return _read_remote(url, field, limits, modality)
    raise InvalidInput(field, f"unsupported URL scheme {scheme!r}; use data:, file:// or http(s)://")


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise urllib.error.HTTPError(req.full_url, code, f"redirect to {newurl} refused", headers, fp)


def _read_remote(url: str, field: str, limits: MediaLimits, modality: Modality) -> bytes:
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
        raise InvalidInput(field, f"empty {modality.name}")
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


__all__ = ["MediaHandler", "MediaLimits", "check_encoded", "decode_counter", "handler", "media_limits", "modality_of", "read_url",
           "register_handler"]
