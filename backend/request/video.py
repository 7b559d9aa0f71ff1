"""Video items in the request stage: decoding and validating videos (container bytes, their base64 text, or what a
URL names), registered as the video modality's ``MediaHandler`` (``backend.request.media``).

Frames are decoded and sampled by vLLM's own video loader (``vllm.multimodal.video.VIDEO_LOADER_REGISTRY``), the
one vLLM's OpenAI server picks for the checkpoint's video processor (``video_loader``: ``qwen2_vl`` for
Qwen2-VL, fps-based sampling), with the loader's defaults (``num_frames=32``, as vLLM's ``VideoMediaIO``). The
``llm`` engine and the encoder both decode with ``decode_video``, so they see the same frames.

An encoder with ``video_decoder: nvdec`` (``MediaLimits.nvdec_device``, a GPU index) decodes on that GPU instead,
with the same sampling and frames bit for bit (``backend.request.nvdec``); a stream that path does not take is
decoded here on the CPU.

Limits, checked on the container's header before any frame is decoded: bytes (``max_item_bytes``), frame size
(``max_image_pixels``, per frame), frames in the container (``max_video_frames``) and seconds
(``max_video_seconds``). A container that cannot be opened, holds no frames, or yields none is InvalidInput
naming the item (``video[0]``, ``messages[0].content[1].video_url``).
"""
from __future__ import annotations

import base64
import binascii
import functools
import inspect
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend.protocol.errors import InvalidInput
from backend.protocol.modality import VIDEO
from backend.request.clips import sample_video
from backend.request.media import MediaHandler, MediaLimits, check_encoded, decode_counter, read_url, register_handler

VIDEO_DECODES: Counter = Counter()  # videos decoded in this process, by decoder: "nvdec" (the GPU) or "cpu"
NUM_FRAMES = 32  # vLLM's VideoMediaIO default (the qwen2_vl loader samples by fps and ignores it)
# Leading bytes of containers (ISO BMFF's "ftyp" box at offset 4, Matroska/WebM, AVI, MPEG-PS, FLV, Ogg):
# anything else is tried as base64 of one.
_MAGIC = (b"\x1a\x45\xdf\xa3", b"RIFF", b"\x00\x00\x01\xba", b"FLV", b"OggS")


@dataclass(frozen=True)
class DecodedVideo:
    """A video as an engine given media takes it: sampled RGB frames [frames, height, width, 3] (uint8: a numpy
    array, or a CUDA tensor where NVDEC decoded them) and the loader's metadata (fps, frames_indices, ...: what HF
    video processors call ``VideoMetadata``)."""

    frames: Any
    metadata: dict[str, Any]

    def engine_item(self) -> tuple[Any, dict[str, Any]]:
        """The form of vLLM's ``multi_modal_data["video"]`` items."""
        return self.frames, self.metadata


@functools.lru_cache(maxsize=8)
def video_processor_for(model_dir: str | Path) -> str:
    """The class name of the checkpoint's HF video processor (Qwen2-VL: ``Qwen2VLVideoProcessor``), "" where it has
    none: what vLLM's OpenAI server picks its video loader by (``MediaLimits.video_processor``)."""
    from transformers import AutoVideoProcessor

    try:
        return type(AutoVideoProcessor.from_pretrained(str(model_dir))).__name__
    except (OSError, ValueError):
        return ""


def video_loader(limits: MediaLimits):
    """vLLM's video loader for ``limits.video_processor`` (``qwen2_vl`` for Qwen2-VL), else vLLM's default
    (``VLLM_VIDEO_LOADER_BACKEND``), as vLLM's media connector chooses."""
    import vllm.envs as envs
    from vllm.multimodal.video import VIDEO_LOADER_REGISTRY, get_video_loader_backend_for_processor

    name = get_video_loader_backend_for_processor(limits.video_processor or None) or envs.VLLM_VIDEO_LOADER_BACKEND
    return VIDEO_LOADER_REGISTRY.load(name)


def _container(data: bytes, field: str) -> bytes:
    if data[4:8] == b"ftyp" or data.startswith(_MAGIC):
        return data
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInput(field, "not a video container (MP4/WebM/MKV/AVI/...), nor base64 of one") from None


def _opencv_mixin():
    """vLLM's OpenCV helpers: ``vllm.multimodal.video_decoders.opencv`` from 0.32 (checked on 0.32), in
    ``vllm.multimodal.video`` before (checked on 0.26)."""
    try:
        from vllm.multimodal.video_decoders.opencv import OpenCVVideoBackendMixin
    except ImportError:
        from vllm.multimodal.video import OpenCVVideoBackendMixin
    return OpenCVVideoBackendMixin


@dataclass(frozen=True)
class Header:
    """What the container says: frame size, and (where asked) vLLM's source metadata, which sampling is computed on."""

    width: int
    height: int
    source: Any = None


def _check_header(data: bytes, field: str, limits: MediaLimits, source: bool = False) -> Header:
    """The container's own claims against the limits, before a frame is decoded; ``source``: with the metadata
    vLLM's OpenCV path samples from."""
    import io

    import cv2

    mixin = _opencv_mixin()
    stream = io.BytesIO(data)  # the capture reads it until released: it must outlive the capture
    try:
        cap = cv2.VideoCapture(stream, mixin.get_cv2_video_api(), [])
    except (cv2.error, SystemError) as exc:
        raise InvalidInput(field, f"cannot decode video ({exc})") from None
    if not cap.isOpened():
        raise InvalidInput(field, "cannot decode video (OpenCV's FFmpeg cannot open the container, or has no "
                                  "decoder for its codec)")
    try:
        width, height = int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)), int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT))
        frames, fps = int(cap.get(cv2.CAP_PROP_FRAME_COUNT)), float(cap.get(cv2.CAP_PROP_FPS))
        metadata = mixin.get_video_metadata(cap) if source and frames > 0 and fps > 0 else None
    finally:
        cap.release()
    if width * height > limits.max_image_pixels:
        raise InvalidInput(field, f"video frames are {width}x{height}, over the {limits.max_image_pixels}-pixel limit")
    if frames <= 0 or width <= 0 or height <= 0:
        raise InvalidInput(field, "video has no frames")
    if frames > limits.max_video_frames:
        raise InvalidInput(field, f"video has {frames} frames, over the {limits.max_video_frames}-frame limit")
    if fps <= 0:
        raise InvalidInput(field, "video has no known frame rate")
    if frames / fps > limits.max_video_seconds:
        raise InvalidInput(field, f"video is {frames / fps:.1f} s long, over the {limits.max_video_seconds:g}-second "
                                  "limit")
    return Header(width, height, metadata)


def decode_video(data: bytes, field: str, limits: MediaLimits, num_frames: int = NUM_FRAMES,
                 **options) -> DecodedVideo:
    """Decode and sample encoded video bytes (or their base64 text) as the ``llm`` engine's vLLM would; ``num_frames``
    and ``options`` (``fps``): the request's ``media_io_kwargs.video``, passed to the loader as vLLM's
    ``VideoMediaIO`` passes them (``backend.protocol.media_options``)."""
    import cv2

    decode_counter.add()
    data = _container(check_encoded(data, field, limits, VIDEO), field)
    header = _check_header(data, field, limits, source=limits.nvdec_device >= 0)
    loader = video_loader(limits)
    if limits.nvdec_device >= 0:
        decoded = _decode_on_gpu(loader, data, header, limits.nvdec_device, num_frames, options)
        if decoded is not None:
            decode_counter.tally(VIDEO_DECODES, "nvdec")
            return decoded
    decode_counter.tally(VIDEO_DECODES, "cpu")
    try:
        frames, metadata = loader.load_bytes(data, num_frames=num_frames, **options)
    except ZeroDivisionError:  # vLLM's qwen2_vl loader samples whole temporal patches: none from a 1-frame clip
        raise InvalidInput(field, "video has too few frames: the checkpoint's video loader samples none from it "
                                  "(Qwen2-VL and Qwen2.5-VL take 2 frames or more)") from None
    except (ValueError, RuntimeError, cv2.error, SystemError) as exc:
        raise InvalidInput(field, f"cannot decode video ({exc})") from None
    if frames is None or len(frames) == 0:
        raise InvalidInput(field, "video has no decodable frames")
    return DecodedVideo(frames, metadata)


def _decode_on_gpu(loader, data: bytes, header: Header, device: int, num_frames: int, options: dict):
    """The video decoded by NVDEC on GPU ``device``, sampled as ``loader.load_bytes`` samples (its own index
    computation and defaults on the source metadata OpenCV reports); None where that path does not take the stream
    (decoded on the CPU then, its reason logged once)."""
    from vllm.multimodal.video import VideoTargetMetadata

    from backend.request import nvdec  # torch and PyNvVideoCodec: loaded only where a GPU decodes

    defaults = inspect.signature(loader.load_bytes).parameters
    target = VideoTargetMetadata(num_frames, options.get("fps", defaults["fps"].default),
                                 defaults["max_duration"].default)
    try:
        if header.source is None:
            raise nvdec.Unsupported("no source metadata")
        matrix = nvdec.stream_matrix(data)
        source = loader._prepare_source(header.source)
        indices = loader.compute_frames_index_to_sample(source=source, target=target)
        frames = nvdec.decoder(device).frames(data, indices, matrix, header.height, header.width)
    except nvdec.Unsupported as exc:
        nvdec.fell_back(str(exc))
        return None
    except Exception as exc:  # noqa: BLE001 - a stream PyAV or the sampling cannot take: the CPU path names the error
        nvdec.fell_back(f"{type(exc).__name__} before decoding")
        return None
    metadata = loader.create_hf_metadata(source=source, valid_frame_indices=indices, video_backend="nvdec")
    return DecodedVideo(frames, metadata)  # in VRAM: the encoder preprocesses them there


def read_video_url(url: str, field: str, limits: MediaLimits) -> bytes:
    """The encoded bytes named by a ``data:video/...`` URL, an allowed ``file://`` path or ``http(s)://`` URL."""
    return read_url(url, field, limits, VIDEO)


register_handler(VIDEO, MediaHandler(decode_video, read_video_url, DecodedVideo, sample_video))

__all__ = ["VIDEO_DECODES", "DecodedVideo", "decode_video", "read_video_url",
           "video_loader", "video_processor_for"]
