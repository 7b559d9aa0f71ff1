"""Audio items in the request stage: decoding and validating audio files (WAV, FLAC, OGG, ... bytes, their base64 text,
or what a URL names), registered as the audio modality's ``MediaHandler`` (``backend.request.media``).

Files are decoded by vLLM's own soundfile loader (``vllm.multimodal.media.audio.load_audio_soundfile``: libsndfile,
float32, channels averaged to mono as vLLM's Qwen2-Audio parser does), then resampled with vLLM's scipy resampler
(``resample_audio_scipy``, polyphase) to the checkpoint's feature-extractor rate (``MediaLimits.audio_sampling_rate``,
16 kHz for Qwen2-Audio). vLLM's default resampler is torchaudio, which is not usable beside this CPU torch, so the
request stage resamples and hands vLLM a waveform already at that rate: the ``llm`` engine and the encoder both decode
with ``decode_audio`` and see the same samples.

Limits, checked on the file's header before any sample is decoded: bytes (``max_item_bytes``), seconds
(``max_audio_seconds``, also what a WAV's data chunk declares, so a header claiming hours is refused before the rest
is looked at), decoded size (``MAX_DECODED_BYTES``), sample rate (``MIN_SAMPLE_RATE``..``MAX_SAMPLE_RATE``) and
channels (at most ``MAX_CHANNELS``). A file that
cannot be opened, holds no samples or fewer than ``MIN_AUDIO_SECONDS``, a WAV whose samples stop before its header
says, and samples that are not finite are InvalidInput naming the item (``audio[0]``,
``messages[0].content[1].input_audio.data``).
"""
from __future__ import annotations

import base64
import binascii
import functools
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend.protocol.errors import InvalidInput
from backend.protocol.modality import AUDIO
from backend.request.media import MediaHandler, MediaLimits, check_encoded, decode_counter, read_url, register_handler

MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 1_000, 384_000  # Hz: what a file may declare
MAX_CHANNELS = 16
MIN_AUDIO_SECONDS = 0.05  # shorter: no token out of a Whisper-style encoder (3 mel frames of 10 ms at least)
MAX_DECODED_BYTES = 256 << 20  # float32 samples of all channels a file may decode to (vLLM's VLLM_MAX_AUDIO_DECODE_BYTES)
# Leading bytes of the files libsndfile reads (RIFF/RF64 WAV, FLAC, Ogg, AIFF, AU, CAF, W64): anything else is tried
# as base64 of one.
_MAGIC = (b"RIFF", b"RF64", b"fLaC", b"OggS", b"FORM", b".snd", b"caff", b"riff", b"ID3", b"\xff\xfb", b"\xff\xf3")
_UNKNOWN_LENGTH = 0xFFFFFFFF  # a streaming writer's data chunk size: the length is not known


@dataclass(frozen=True)
class DecodedAudio:
    """An audio item as an engine given media takes it: mono float32 samples at ``sampling_rate`` (the checkpoint's
    feature-extractor rate; the file's own where the checkpoint has none)."""

    samples: Any
    sampling_rate: int

    @property
    def seconds(self) -> float:
        return len(self.samples) / self.sampling_rate

    def engine_item(self):
        """The form of vLLM's ``multi_modal_data["audio"]`` items: the waveform, already at the model's rate (a bare
        array: vLLM resamples nothing)."""
        return self.samples


@functools.lru_cache(maxsize=8)
def sampling_rate_for(model_dir: str | Path) -> int:
    """The sampling rate of the checkpoint's HF feature extractor (Qwen2-Audio's Whisper one: 16000), 0 where it has
    none: what audio items are resampled to (``MediaLimits.audio_sampling_rate``)."""
    from transformers import AutoFeatureExtractor

    try:
        return int(getattr(AutoFeatureExtractor.from_pretrained(str(model_dir)), "sampling_rate", 0) or 0)
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def _file(data: bytes, field: str) -> bytes:
    if data.startswith(_MAGIC):
        return data
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInput(field, "not an audio file (WAV/FLAC/OGG/...), nor base64 of one") from None


def _wav_data_chunk(data: bytes) -> tuple[int, int, int] | None:
    """(declared bytes, bytes present, byte rate) of a RIFF/WAVE file's ``data`` chunk; None: not a WAV, or no ``fmt ``
    before its ``data`` chunk (libsndfile then refuses it)."""
    if not (data[:4] == b"RIFF" and data[8:12] == b"WAVE"):
        return None
    pos, byte_rate = 12, 0
    while pos + 8 <= len(data):
        chunk, size = data[pos:pos + 4], int.from_bytes(data[pos + 4:pos + 8], "little")
        if chunk == b"fmt " and pos + 20 <= len(data):
            byte_rate = int.from_bytes(data[pos + 16:pos + 20], "little")
        if chunk == b"data":
            return (size, len(data) - pos - 8, byte_rate) if byte_rate else None
        pos += 8 + size + (size & 1)
    return None


def _check_header(data: bytes, field: str, limits: MediaLimits) -> None:
    """The file's own claims against the limits, before a sample is decoded."""
    import soundfile

    declared = _wav_data_chunk(data)
    if declared is not None and declared[0] != _UNKNOWN_LENGTH:
        size, present, byte_rate = declared
        if size / byte_rate > limits.max_audio_seconds:
            raise InvalidInput(field, f"audio header declares {size / byte_rate:.1f} s, over the "
                                      f"{limits.max_audio_seconds:g}-second limit")
        if size > present:
            raise InvalidInput(field, f"cannot decode audio (truncated: the header declares {size} bytes of samples, "
                                      f"{present} are present)")
    try:
        sound = soundfile.SoundFile(io.BytesIO(data))
    except (soundfile.LibsndfileError, RuntimeError, ValueError, TypeError) as exc:
        raise InvalidInput(field, f"cannot decode audio ({_reason(exc)})") from None
    rate, channels, frames = sound.samplerate, sound.channels, sound.frames
    sound.close()
    if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        raise InvalidInput(field, f"audio sample rate {rate} Hz is outside {MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE} Hz")
    if not 1 <= channels <= MAX_CHANNELS:
        raise InvalidInput(field, f"audio has {channels} channels, over the {MAX_CHANNELS}-channel limit")
    if frames <= 0:
        raise InvalidInput(field, "audio has no samples")
    if frames * channels * 4 > MAX_DECODED_BYTES:
        raise InvalidInput(field, f"audio would decode to {frames * channels * 4 >> 20} MiB of samples, over the "
                                  f"{MAX_DECODED_BYTES >> 20} MiB limit")
    if frames / rate > limits.max_audio_seconds:
        raise InvalidInput(field, f"audio is {frames / rate:.1f} s long, over the {limits.max_audio_seconds:g}-second "
                                  "limit")
    if frames / rate < MIN_AUDIO_SECONDS:
        raise InvalidInput(field, f"audio is {frames / rate * 1000:.1f} ms long, under the "
                                  f"{MIN_AUDIO_SECONDS * 1000:g} ms minimum")


def _reason(exc: Exception) -> str:
    """libsndfile's reason, without the in-memory file object it names (``Error opening <_io.BytesIO ...>: ``)."""
    text = str(exc)
    return text.split(">: ", 1)[1] if text.startswith("Error opening <") and ">: " in text else text


def decode_audio(data: bytes, field: str, limits: MediaLimits) -> DecodedAudio:
    """Decode an audio file's bytes (or their base64 text) to mono samples at the checkpoint's rate, as the ``llm``
    engine's vLLM takes them."""
    import numpy as np
    import soundfile
    from vllm.multimodal.audio import resample_audio_scipy
    from vllm.multimodal.media.audio import load_audio_soundfile

    decode_counter.add()
    data = _file(check_encoded(data, field, limits, AUDIO), field)
    _check_header(data, field, limits)
    try:
        samples, rate = load_audio_soundfile(io.BytesIO(data), sr=None, mono=True,
                                             max_duration_s=limits.max_audio_seconds, max_decode_bytes=MAX_DECODED_BYTES)
    except (soundfile.LibsndfileError, RuntimeError, ValueError, TypeError) as exc:
        raise InvalidInput(field, f"cannot decode audio ({_reason(exc)})") from None
    if len(samples) == 0:
        raise InvalidInput(field, "audio has no decodable samples")
    if not np.isfinite(samples).all():
        raise InvalidInput(field, "audio has samples that are not finite numbers (NaN or infinity)")
    target = limits.audio_sampling_rate or rate
    samples = resample_audio_scipy(samples, orig_sr=rate, target_sr=target)
    return DecodedAudio(np.ascontiguousarray(samples, dtype=np.float32), int(target))


def read_audio_url(url: str, field: str, limits: MediaLimits) -> bytes:
    """The encoded bytes named by a ``data:audio/...`` URL, an allowed ``file://`` path or ``http(s)://`` URL."""
    return read_url(url, field, limits, AUDIO)


def sample_audio(seconds: float = 0.5, rate: int = 16000) -> bytes:
    """Half a second of silence as a 16-bit mono WAV file (the handler's ``sample``)."""
    import wave

    out = io.BytesIO()
    with wave.open(out, "wb") as file:
        file.setnchannels(1)
        file.setsampwidth(2)
        file.setframerate(rate)
        file.writeframes(bytes(2 * int(seconds * rate)))
    return out.getvalue()


register_handler(AUDIO, MediaHandler(decode_audio, read_audio_url, DecodedAudio, sample_audio))

__all__ = ["DecodedAudio", "decode_audio", "read_audio_url", "sample_audio", "sampling_rate_for"]
