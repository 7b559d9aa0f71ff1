"""Synthetic test and benchmark audio: WAV files written with soundfile (deterministic for the same arguments): a
chord of sine tones whose pitches come from ``seed``, under a little noise, so items differ between seeds and
lengths."""
from __future__ import annotations

import io

import numpy as np


def make_audio(seconds: float = 2.0, rate: int = 16_000, channels: int = 1, seed: int = 0, subtype: str = "PCM_16",
               file_format: str = "WAV") -> bytes:
    """A ``file_format`` file (WAV, FLAC, OGG) of ``seconds`` at ``rate`` Hz, ``channels`` channels (each its own
    tones), samples as ``subtype`` (PCM_16, FLOAT, ...)."""
    import soundfile

    rng = np.random.default_rng(seed)
    t = np.arange(int(round(seconds * rate))) / rate
    tones = [sum(np.sin(2 * np.pi * f * t) for f in rng.uniform(110, 2000, 3)) / 4 for _ in range(channels)]
    samples = np.stack(tones, axis=-1) + rng.normal(0, 0.02, (len(t), channels))
    buf = io.BytesIO()
    soundfile.write(buf, samples.astype(np.float32), rate, subtype=subtype, format=file_format)
    return buf.getvalue()


__all__ = ["make_audio"]
