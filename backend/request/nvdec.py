"""Video frames decoded on the GPU (NVDEC, through NVIDIA's PyNvVideoCodec) for an encoder with
``video_decoder: nvdec`` (``KIND_GPU``): the same frames, bit for bit, as the CPU path (vLLM's loader over OpenCV's
FFmpeg, ``backend.request.video``), so a GPU-decoded video gives ``llm``'s tokens and its embeddings may be shared
with CPU encoders (the content key does not name the decoder).

H.264/HEVC/VP9/AV1 decoding is exact by the standards (integer transforms; not MPEG-4 Part 2's IDCT): NVDEC's NV12 planes are FFmpeg's yuv420p planes. The RGB
conversion is where decoders part: PyNvVideoCodec's own converts an untagged HD stream with BT.709 where FFmpeg takes
BT.601 (up to 40 levels apart), and rounds otherwise (docs/results/gpu.md). So frames come out of NVDEC as NV12 and
are converted here, on the GPU, with the arithmetic of FFmpeg's x86 converter (libswscale's SIMD yuv2rgb: every
term in 16-bit fixed point, ``(x * 8 * round(k * 8192)) >> 16``, truncated, summed, saturated): 0 levels from
OpenCV's frames on every clip measured (``tests/unit/test_nvdec.py`` on CPU tensors against PyAV's planes, and on
the H200 against OpenCV there).

What takes the exact path: H.264, HEVC, VP9 or AV1 (``EXACT_CODECS``) in 8-bit 4:2:0 (``yuv420p``) in limited range with even sides, matrix BT.601 (untagged, as
FFmpeg assumes, SMPTE 170M, BT.470BG) or BT.709, read from the stream's parameters with PyAV (no frame decoded).
Anything else (10-bit, 4:2:2, full range, BT.2020, ...), a codec NVDEC refuses, or a decode that returns another
number of frames than asked is decoded on the CPU as without this option (counted: ``video.VIDEO_DECODES``).

Frame sampling stays vLLM's: the loader's own ``compute_frames_index_to_sample`` on the source metadata OpenCV
reports (what the CPU path samples from). Decoders are kept (``SLOTS`` per process, each with its CUDA stream) and
reconfigured per video: a new decoder costs ~70 ms of session set-up against ~24 ms for a 30-frame 720p clip.
"""
from __future__ import annotations

import io
import logging
import os
import queue
import tempfile
import threading
from dataclasses import dataclass

import torch

from backend.request.clips import sample_video

# codecs whose decoding the standard makes bit-exact (integer transforms); MPEG-1/2/4 Part 2 and VC-1 allow an IDCT
# within a tolerance: NVDEC's frames of an mp4v clip differ from FFmpeg's (measured on the H200)
EXACT_CODECS = ("h264", "hevc", "vp9", "av1")
SLOTS = 2  # decoders kept per process (vLLM's PyNvVideoCodec backend keeps 2 too)
# FFmpeg's AVColorSpace values -> (Kr, Kb): unspecified is BT.601 to FFmpeg (libswscale's default table)
MATRICES = {1: (0.2126, 0.0722), 2: (0.299, 0.114), 5: (0.299, 0.114), 6: (0.299, 0.114)}
LOG = logging.getLogger(__name__)
_REASONS: set[str] = set()  # the fall-back reasons logged (once each, at most 32)


class Unsupported(Exception):
    """A stream the exact GPU path does not take: it is decoded on the CPU."""


def fell_back(reason: str) -> None:
    """Log the reason a video is decoded on the CPU instead, the first time."""
    if reason not in _REASONS and len(_REASONS) < 32:
        _REASONS.add(reason)
        LOG.warning("video decoded on the CPU, not NVDEC: %s (logged once per reason)", reason)


@dataclass(frozen=True)
class Coefficients:
    """libswscale's 16-bit SIMD coefficients (``round(k * 8192)``) of a matrix, limited range."""

    y: int
    vr: int
    ug: int
    vg: int
    ub: int

    @classmethod
    def of(cls, kr: float, kb: float) -> "Coefficients":
        kg = 1 - kr - kb
        luma, chroma = 255 / 219, 255 / 224
        return cls(*(round(k * 8192) for k in (luma, 2 * (1 - kr) * chroma, -2 * kb * (1 - kb) / kg * chroma,
                                                -2 * kr * (1 - kr) / kg * chroma, 2 * (1 - kb) * chroma)))


def rgb_from_yuv420(y: torch.Tensor, u: torch.Tensor, v: torch.Tensor, matrix: tuple[float, float]) -> torch.Tensor:
    """RGB uint8 ``[..., H, W, 3]`` from 8-bit planes ``y [..., H, W]``, ``u``, ``v [..., H/2, W/2]`` (limited
    range), as FFmpeg's x86 converter computes it (each chroma sample for its 2x2 pixels), on the planes' device."""
    c = Coefficients.of(*matrix)

    def term(plane: torch.Tensor, offset: int, k: int) -> torch.Tensor:
        return ((plane.to(torch.int32) - offset) * 8 * k) >> 16

    def full(plane: torch.Tensor) -> torch.Tensor:
        return plane.repeat_interleave(2, -2).repeat_interleave(2, -1)

    luma = term(y, 16, c.y)
    red = luma + full(term(v, 128, c.vr))
    green = luma + full(term(u, 128, c.ug) + term(v, 128, c.vg))
    blue = luma + full(term(u, 128, c.ub))
    return torch.stack([red, green, blue], -1).clamp_(0, 255).to(torch.uint8)


def rgb_from_nv12(frames: torch.Tensor, height: int, width: int, matrix: tuple[float, float]) -> torch.Tensor:
    """RGB uint8 ``[T, H, W, 3]`` from NV12 frames ``[T, H * 3 / 2, >= W]`` (luma rows, then interleaved U, V rows)."""
    luma = frames[:, :height, :width]
    chroma = frames[:, height:height + height // 2, :width].unflatten(-1, (width // 2, 2))
    return rgb_from_yuv420(luma, chroma[..., 0], chroma[..., 1], matrix)


def stream_matrix(data: bytes) -> tuple[float, float]:
    """The (Kr, Kb) of the video's stream if the exact path takes it (PyAV reads the parameters, decodes nothing);
    ``Unsupported`` naming why not."""
    try:
        import av  # noqa: PLC0415 - only an nvdec encoder needs it
    except ImportError as exc:
        raise Unsupported("no PyAV to read the stream's colour parameters") from exc
    with av.open(io.BytesIO(data)) as container:
        if not container.streams.video:
            raise Unsupported("no video stream")
        context = container.streams.video[0].codec_context
        codec, pixels, space, full = context.name, context.pix_fmt, int(context.colorspace), int(context.color_range) == 2
        width, height = context.width, context.height
    if codec not in EXACT_CODECS:
        raise Unsupported(f"codec {codec} (its decoders may differ within the standard's IDCT tolerance)")
    if pixels != "yuv420p":
        raise Unsupported(f"pixel format {pixels}")
    if full:
        raise Unsupported("full range")
    if space not in MATRICES:
        raise Unsupported(f"colour matrix {space}")
    if width % 2 or height % 2:
        raise Unsupported("odd frame size")
    return MATRICES[space]


class _Slot:
    """One kept decoder and the CUDA stream it decodes and converts on."""

    def __init__(self, device: int):
        self.device, self.stream, self.decoder = device, torch.cuda.Stream(device=device), None

    def open(self, path: str):
        import PyNvVideoCodec as nvc  # noqa: PLC0415

        if self.decoder is not None:
            try:
                self.decoder.reconfigure_decoder(path)
                return self.decoder
            except Exception:  # noqa: BLE001 - another codec or a larger size: a new decoder
                self.decoder = None
        self.decoder = nvc.SimpleDecoder(path, gpu_id=self.device, use_device_memory=True,
                                         output_color_type=nvc.OutputColorType.NATIVE,
                                         cuda_stream=self.stream.cuda_stream)
        return self.decoder


class NvdecDecoder:
    """The process's NVDEC decoders of one GPU: ``frames(data, indices, matrix)`` -> RGB uint8 ``[T, H, W, 3]``."""

    def __init__(self, device: int = 0, slots: int = SLOTS):
        import PyNvVideoCodec  # noqa: F401, PLC0415 - fail at load, not at the first video

        self.device = device
        self._free: queue.LifoQueue = queue.LifoQueue()
        self._made, self._slots, self._lock = 0, slots, threading.Lock()

    def warm_up(self) -> None:
        """Make every kept decoder now, on a 2-frame clip: a decoder's session costs ~70 ms, a process's first ~290
        ms (CUDA set-up; measured on the H200), which no request should pay."""
        clip = sample_video(64, 2)
        slots = [self._borrow() for _ in range(self._slots)]
        try:
            for slot in slots:
                self._decode(slot, clip, [0, 1], MATRICES[2], 64, 64)
        finally:
            for slot in slots:
                self._free.put(slot)

    def _borrow(self) -> _Slot:
        with self._lock:
            if self._free.empty() and self._made < self._slots:
                self._made += 1
                return _Slot(self.device)
        return self._free.get()

    def frames(self, data: bytes, indices: list[int], matrix: tuple[float, float], height: int,
               width: int) -> torch.Tensor:
        """The frames ``indices`` of the video, on this decoder's GPU (``Unsupported`` where NVDEC cannot)."""
        slot = self._borrow()
        try:
            return self._decode(slot, data, indices, matrix, height, width)
        finally:
            self._free.put(slot)

    def _decode(self, slot: _Slot, data: bytes, indices: list[int], matrix: tuple[float, float], height: int,
                width: int) -> torch.Tensor:
        import PyNvVideoCodec as nvc  # noqa: PLC0415

        handle, path = tempfile.mkstemp(suffix=".video")
        try:
            with os.fdopen(handle, "wb") as file:
                file.write(data)
            with torch.cuda.stream(slot.stream):
                try:
                    decoded = slot.open(path).get_batch_frames_by_index(indices)
                except (nvc.PyNvVCException, IndexError, RuntimeError, ValueError) as exc:
                    slot.decoder = None
                    raise Unsupported(f"NVDEC: {exc}") from None
                if len(decoded) != len(indices):
                    raise Unsupported(f"NVDEC gave {len(decoded)} of {len(indices)} frames")
                nv12 = torch.stack([torch.from_dlpack(frame) for frame in decoded])
                rgb = rgb_from_nv12(nv12, height, width, matrix)
            slot.stream.synchronize()  # the decoder's surfaces are reused by its next video
            # the frames are read next on the device's default stream (the video processor): their memory must not
            # go back to this slot's stream before that work is done
            rgb.record_stream(torch.cuda.default_stream(self.device))
            return rgb
        finally:
            os.unlink(path)


_DECODERS: dict[int, NvdecDecoder] = {}
_DECODERS_LOCK = threading.Lock()


def decoder(device: int) -> NvdecDecoder:
    """The process's decoder of GPU ``device`` (made and warmed up at the first call: ``ImportError`` without
    PyNvVideoCodec)."""
    with _DECODERS_LOCK:
        if device not in _DECODERS:
            _DECODERS[device] = NvdecDecoder(device)
            try:
                _DECODERS[device].warm_up()
            except Exception as exc:  # noqa: BLE001 - not warmed: the first videos pay the set-up, none fails for it
                LOG.warning("NVDEC decoders not warmed up at load (%s: %s)", type(exc).__name__, exc)
        return _DECODERS[device]


__all__ = ["MATRICES", "NvdecDecoder", "Unsupported", "decoder", "fell_back", "rgb_from_nv12", "rgb_from_yuv420",
           "stream_matrix"]
