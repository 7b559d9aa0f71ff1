"""Test audio: the synthetic files of clients/audios.py (shared with the benchmarks), and hostile ones."""
from __future__ import annotations

import io
import struct

import numpy as np

from clients.audios import make_audio


def _patched(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    """``data`` with the little-endian field at ``offset`` (of a canonical 44-byte WAV header) set to ``value``."""
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


def hostile_audio() -> dict[str, tuple[bytes, str]]:
    """Kind -> (audio bytes, a fragment of the refusal), for a limit of 120 seconds."""
    import soundfile

    good = make_audio(1.0, 16_000, seed=7)
    nan = io.BytesIO()
    soundfile.write(nan, np.full(16_000, np.nan, np.float32), 16_000, subtype="FLOAT", format="WAV")
    return {
        "corrupt": (good[:12] + bytes(range(256)) * 8, "cannot decode audio"),
        "truncated": (good[: len(good) // 2], "truncated"),
        "zero_samples": (make_audio(0.0, 16_000), "no samples"),
        "too_short": (make_audio(0.01, 16_000), "under the 50 ms minimum"),
        "header_claiming_hours": (_patched(good, 40, "<I", 16_000 * 2 * 3 * 3600), "over the 120-second limit"),
        "absurd_sample_rate": (_patched(good, 24, "<I", 1), "sample rate 1 Hz"),
        "absurd_channels": (_patched(good, 22, "<H", 1000), "1000 channels"),
        "not_finite": (nan.getvalue(), "not finite"),
    }


__all__ = ["hostile_audio", "make_audio"]
