"""Test videos (the synthetic clips of clients/videos.py, shared with the benchmarks)."""
from clients.videos import make_video

__all__ = ["make_video"]
