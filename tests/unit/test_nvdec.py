"""The GPU video decode's logic on the CPU (``backend.request.nvdec``): its RGB conversion against the CPU path's
frames (OpenCV's FFmpeg, what vLLM's loader reads), the streams it takes, and ``decode_video``'s sampling and
fall-back with NVDEC's part played by PyAV's planes (the real decoder is tested on the GPU: tests/component/test_gpu.py).
"""
from __future__ import annotations

import io
from dataclasses import replace

import av
import numpy as np
import pytest
import torch

from backend.request import nvdec, video
from backend.request.media import MediaLimits
from clients.videos import make_h264_video, make_video, opencv_frames

BT709 = "colormatrix=bt709:colorprim=bt709:transfer=bt709"
BT601 = "colormatrix=smpte170m:colorprim=smpte170m:transfer=smpte170m"
LIMITS = MediaLimits(video_processor="Qwen2VLVideoProcessor")


def planes(data: bytes) -> torch.Tensor:
    """Every frame's decoded 4:2:0 planes as NV12 ``[T, H * 3 / 2, W]``, as NVDEC hands them out (PyAV decodes
    them here: H.264 decoding is exact, so they are NVDEC's)."""
    frames = []
    with av.open(io.BytesIO(data)) as container:
        for frame in container.decode(video=0):
            yuv = frame.to_ndarray(format="yuv420p")
            height, width = frame.height, frame.width
            u = yuv[height:height + height // 4].reshape(height // 2, width // 2)
            v = yuv[height + height // 4:].reshape(height // 2, width // 2)
            frames.append(np.concatenate([yuv[:height], np.stack([u, v], -1).reshape(height // 2, width)]))
    return torch.from_numpy(np.stack(frames))


@pytest.mark.parametrize("width,height,tags,noise", [(448, 448, "", True), (1280, 720, "", True),
                                                     (1280, 720, BT709, True), (640, 360, BT601, True),
                                                     (1280, 720, BT709, False)])
def test_nv12_converted_here_is_the_cpu_path_s_frames_bit_for_bit(width, height, tags, noise):
    data = make_h264_video(width, height, frames=6, tags=tags, noise=noise)
    want = opencv_frames(data)
    got = nvdec.rgb_from_nv12(planes(data), height, width, nvdec.stream_matrix(data)).numpy()
    assert got.shape == want.shape
    diff = np.abs(got.astype(int) - want.astype(int))
    assert diff.max() == 0, (diff.max(), diff.mean())


def test_the_other_matrix_would_be_levels_off_so_the_stream_s_tag_matters():
    data = make_h264_video(1280, 720, frames=2, tags=BT709)
    wrong = nvdec.rgb_from_nv12(planes(data), 720, 1280, nvdec.MATRICES[2]).numpy()
    assert np.abs(wrong.astype(int) - opencv_frames(data).astype(int)).max() > 20


def _encoded(pix_fmt: str, **options) -> bytes:
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=30)
        stream.width, stream.height, stream.pix_fmt = 64, 64, pix_fmt
        stream.options = options
        for _ in range(2):
            frame = av.VideoFrame.from_ndarray(np.full((64, 64, 3), 90, np.uint8), "rgb24").reformat(format=pix_fmt)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


@pytest.mark.parametrize("data,reason", [
    (lambda: make_video(64, 48, frames=2), "codec mpeg4"),
    (lambda: _encoded("yuv444p"), "pixel format yuv444p"),
    (lambda: _encoded("yuvj420p"), "pixel format yuvj420p"),
    (lambda: _encoded("yuv420p", **{"x264-params": "fullrange=on"}), "pixel format yuvj420p"),  # FFmpeg's name
    (lambda: _encoded("yuv420p", **{"x264-params": "colormatrix=bt2020nc"}), "colour matrix 9"),
])
def test_streams_the_exact_path_does_not_take_say_why(data, reason):
    with pytest.raises(nvdec.Unsupported, match=reason):
        nvdec.stream_matrix(data())


class PlanesDecoder:
    """NVDEC's part: the NV12 planes of the asked frames, from PyAV."""

    def __init__(self):
        self.asked = []

    def frames(self, data, indices, matrix, height, width):
        self.asked.append(list(indices))
        return nvdec.rgb_from_nv12(planes(data)[indices], height, width, matrix)


@pytest.mark.parametrize("options", [{}, {"fps": 1}, {"fps": 6}])
def test_decode_video_on_nvdec_samples_and_gives_the_cpu_path_s_frames(monkeypatch, options):
    fake = PlanesDecoder()
    monkeypatch.setattr(nvdec, "decoder", lambda device: fake)
    data = make_h264_video(320, 240, frames=40, fps=10, noise=False)
    want = video.decode_video(data, "video[0]", LIMITS, **options)
    before = dict(video.VIDEO_DECODES)
    got = video.decode_video(data, "video[0]", replace(LIMITS, nvdec_device=0), **options)
    assert video.VIDEO_DECODES["nvdec"] == before.get("nvdec", 0) + 1
    assert fake.asked == [want.metadata["frames_indices"]] and len(got.frames) == len(want.frames)
    assert np.array_equal(got.frames, want.frames)
    assert {k: v for k, v in got.metadata.items() if k != "video_backend"} == \
        {k: v for k, v in want.metadata.items() if k != "video_backend"}
    assert got.metadata["video_backend"] == "nvdec"


def test_a_stream_nvdec_cannot_take_is_decoded_on_the_cpu_and_counted(monkeypatch):
    def refuse(*args):
        raise nvdec.Unsupported("NVDEC: no decoder for this codec")

    monkeypatch.setattr(nvdec, "decoder", lambda device: type("Refusing", (), {"frames": staticmethod(refuse)})())
    data = make_h264_video(128, 96, frames=8, fps=8, noise=False)
    before = dict(video.VIDEO_DECODES)
    got = video.decode_video(data, "video[0]", replace(LIMITS, nvdec_device=0))
    assert video.VIDEO_DECODES["cpu"] == before.get("cpu", 0) + 1
    assert video.VIDEO_DECODES["nvdec"] == before.get("nvdec", 0)
    assert np.array_equal(got.frames, video.decode_video(data, "video[0]", LIMITS).frames)
    assert got.metadata["video_backend"] != "nvdec"


def test_a_container_pyav_cannot_read_on_the_nvdec_path_gets_the_cpu_path_s_clear_error(monkeypatch):
    """Bad input on an nvdec encoder is InvalidInput naming the item, as on the CPU: never an internal error."""
    from backend.protocol.errors import InvalidInput

    monkeypatch.setattr(nvdec, "stream_matrix", lambda data: (_ for _ in ()).throw(av.error.InvalidDataError(1, "x")))
    data = make_h264_video(64, 48, frames=4, fps=4, noise=False)
    got = video.decode_video(data, "video[0]", replace(LIMITS, nvdec_device=0))  # falls back: decoded on the CPU
    assert np.array_equal(got.frames, video.decode_video(data, "video[0]", LIMITS).frames)
    with pytest.raises(InvalidInput, match=r"video\[0\]"):
        video.decode_video(data[:200], "video[0]", replace(LIMITS, nvdec_device=0))
