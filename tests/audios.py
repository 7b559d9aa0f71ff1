"""Test audio (the synthetic WAV files of clients/audios.py, shared with the benchmarks)."""
from clients.audios import make_audio

__all__ = ["make_audio"]
