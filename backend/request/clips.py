"""H.264 MP4 clips made here (PyAV's libx264): the video handler's sample (``backend.request.video``), NVDEC's warm-up
clip (``backend.request.nvdec``), and the clients' and tests' generated videos."""
from __future__ import annotations

import io


def h264_mp4(frames, width: int, height: int, fps: int = 30, options: dict[str, str] | None = None) -> bytes:
    """An H.264 MP4 (PyAV's libx264, yuv420p) of ``frames`` (RGB uint8 ``[H, W, 3]`` arrays); ``options``: libx264's
    (``{"crf": "18"}``)."""
    import av  # PyAV: loaded when a clip is made, not with the video handler

    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = dict(options or {})
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, "rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def sample_video(size: int = 64, frames: int = 2) -> bytes:
    """An H.264 MP4 of ``frames`` grey ``size`` x ``size`` frames at 30 fps (the video handler's ``sample``; NVDEC's
    warm-up decodes it too)."""
    import numpy as np

    return h264_mp4([np.full((size, size, 3), 128, np.uint8)] * frames, size, size)
