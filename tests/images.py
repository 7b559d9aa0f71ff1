"""Test images (the synthetic images of clients/images.py, shared with the benchmarks)."""
from clients.images import image_bytes, make_image

__all__ = ["image_bytes", "make_image"]
