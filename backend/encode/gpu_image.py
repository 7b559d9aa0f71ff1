"""Images preprocessed on the encoder's GPU (``stages.encoder.image_preprocess: gpu`` or ``nvjpeg``), with the grids
and pixels of the host's image processor.

The processor ``llm`` uses (transformers 5's ``Qwen2VLImageProcessor``, a ``TorchvisionBackend``, for Qwen2-VL,
Qwen2.5-VL and Qwen3-VL alike) resizes a uint8 image with torch's antialiased bicubic resample, which on the host has a
fixed-point uint8 kernel (Pillow's algorithm: int16 taps, one horizontal then one vertical pass, each rounded and
clipped to uint8) and on CUDA computes in float (1-6 levels apart, measured on video frames, docs/gpu.md). So the
resize here is the project's own integer implementation of that fixed-point resample, run with int32 tensor ops on
any device: its output equals the host kernel's **bit for bit** (``tests/unit/test_gpu_image.py`` checks many sizes
and aspect ratios). The size is the processor's own ``smart_resize`` (the family module's function, with the
processor's factor and pixel bounds), so grids and token counts are the processor's by construction; rescale,
normalise and patchify are the processor's own call (``do_resize=False``) on the resized tensors, on their device
(the same float32 element-wise ops as on the host).

What this module does not do: decode. ``backend.request.image.decode_image_tensor`` gives the [3, H, W] uint8 tensor
(JPEG through nvJPEG with ``nvjpeg``: PIL's pixels without chroma subsampling, within a measured bound with it; every
other format, and every image with ``gpu``, decoded on the host as the CPU path decodes it).
"""
from __future__ import annotations

import sys
import threading
from functools import lru_cache

import numpy as np
import torch

BICUBIC_A = -0.5  # the antialiased bicubic's Keys parameter (Pillow's; torch's antialiased kernel uses it too)
BICUBIC_SUPPORT = 2.0  # the filter's half-width, in input pixels at scale 1
MAX_PRECISION = 22  # fixed-point bits at most; int16 taps: the largest tap times 2**bits stays under 2**15


def _bicubic(x: np.ndarray) -> np.ndarray:
    """Keys' cubic convolution kernel (a = -0.5) at ``x``, in float64, in the order the host kernel evaluates it."""
    a = BICUBIC_A
    x = np.abs(x)
    inner = ((a + 2) * x - (a + 3)) * x * x + 1
    outer = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1.0, inner, np.where(x < 2.0, outer, 0.0))


@lru_cache(maxsize=512)
def taps(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The fixed-point taps of resampling one axis from ``in_size`` to ``out_size`` pixels: (first input index per
    output pixel + tap offset, [out, K] int64, clamped into range), (int16-valued weights, [out, K] int32; 0 past a
    pixel's own taps), and the precision in bits. Computed in float64 as the host kernel computes them (scale,
    support, each pixel's window, weights normalised by their sequential sum), then rounded half away from zero."""
    scale = in_size / out_size
    support = BICUBIC_SUPPORT * scale if scale >= 1.0 else BICUBIC_SUPPORT
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    center = scale * (np.arange(out_size, dtype=np.float64) + 0.5)
    first = np.maximum(np.trunc(center - support + 0.5), 0).astype(np.int64)
    size = np.minimum(np.trunc(center + support + 0.5).astype(np.int64), in_size) - first
    k = int(size.max())
    j = np.arange(k, dtype=np.int64)[None, :]
    inside = j < size[:, None]
    weights = np.where(inside, _bicubic(((j + first[:, None]) - center[:, None] + 0.5) * invscale), 0.0)
    total = np.zeros(out_size)
    for column in range(k):  # sequential, as the host sums them (NumPy's sum is pairwise)
        total = total + weights[:, column]
    weights = np.where(total[:, None] != 0.0, weights / np.where(total == 0.0, 1.0, total)[:, None], weights)
    top = float(weights.max()) if total.any() else 0.0
    precision = 0
    while precision < MAX_PRECISION and int(0.5 + top * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    scaled = weights * (1 << precision)
    fixed = np.trunc(np.where(scaled < 0, scaled - 0.5, scaled + 0.5)).astype(np.int32)
    index = np.minimum(first[:, None] + j, in_size - 1)
    return index, fixed, precision


class _DeviceTaps:
    """``taps`` as tensors on one device, per (in, out) size, kept while the process runs (a few KiB each)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._held: dict[tuple, tuple[torch.Tensor, torch.Tensor, int]] = {}

    def get(self, in_size: int, out_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
        key = (in_size, out_size, str(device))
        with self._lock:
            found = self._held.get(key)
        if found is None:
            index, weights, precision = taps(in_size, out_size)
            found = (torch.from_numpy(index.T.copy()).to(device), torch.from_numpy(weights.T.copy()).to(device),
                     precision)
            with self._lock:
                self._held[key] = found
        return found


DEVICE_TAPS = _DeviceTaps()


def _resample(image: torch.Tensor, dim: int, out_size: int) -> torch.Tensor:
    """One axis (``dim`` of a [..., H, W] uint8 tensor) resampled to ``out_size`` in int32 fixed point, rounded
    (half up, ``1 << (precision - 1)`` added before the shift) and clipped to uint8."""
    index, weights, precision = DEVICE_TAPS.get(image.shape[dim], out_size, image.device)
    shape = [1] * image.dim()
    shape[dim] = out_size
    acc = torch.full((), 1 << (precision - 1) if precision else 0, dtype=torch.int32, device=image.device)
    for k in range(index.shape[0]):
        acc = acc + image.index_select(dim, index[k]).to(torch.int32) * weights[k].view(shape)
    return torch.bitwise_right_shift(acc, precision).clamp_(0, 255).to(torch.uint8)


def resize(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """A [C, H, W] (or [N, C, H, W]) uint8 image resized to ``height`` x ``width`` with the antialiased bicubic
    resample of the host's fixed-point kernel, on the image's device: horizontal pass first, then vertical, each
    only where that axis changes (the unchanged image itself where neither does)."""
    if image.dtype != torch.uint8:
        raise TypeError(f"resize takes uint8 images, not {image.dtype}")
    if image.shape[-1] != width:
        image = _resample(image, image.dim() - 1, width)
    if image.shape[-2] != height:
        image = _resample(image, image.dim() - 2, height)
    return image


def target_size(processor, height: int, width: int) -> tuple[int, int]:
    """The (height, width) the processor resizes a ``height`` x ``width`` image to: its family module's own
    ``smart_resize`` with its factor (patch x merge) and pixel bounds (``size``'s shortest and longest edge), as its
    ``resize`` computes it."""
    module = sys.modules[type(processor).__module__]
    size = processor.size
    shortest = size["shortest_edge"] if isinstance(size, dict) else size.shortest_edge
    longest = size["longest_edge"] if isinstance(size, dict) else size.longest_edge
    return module.smart_resize(height, width, factor=processor.patch_size * processor.merge_size,
                               min_pixels=shortest, max_pixels=longest)


def grid(processor, height: int, width: int) -> tuple[int, int, int]:
    """The image's patch grid (t, h, w) as the processor gives it (``image_grid_thw``)."""
    h, w = target_size(processor, height, width)
    return 1, h // processor.patch_size, w // processor.patch_size


def preprocess(processor, images: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``pixel_values`` [patches, dim] (float32, on the images' device) and ``image_grid_thw`` [n, 3] (int64, host)
    of [3, H, W] uint8 ``images`` (all on one device): each resized to the processor's size by ``resize``, then the
    processor's own rescale, normalise and patchify there. Equal to the processor's output on the host images."""
    if not getattr(processor, "do_resize", True):
        raise ValueError("this processor does not resize; preprocess it on the host")
    resized = [resize(image, *target_size(processor, *image.shape[-2:])) for image in images]
    batch = processor(images=resized, do_resize=False, input_data_format="channels_first", return_tensors="pt")
    return batch["pixel_values"], batch["image_grid_thw"]


def supported(processor) -> bool:
    """Whether ``preprocess`` gives this processor's output: a torchvision-backed processor that resizes, with a family
    ``smart_resize``, antialiased bicubic resample, and the Qwen-VL patch attributes."""
    module = sys.modules.get(type(processor).__module__)
    resample = getattr(processor, "resample", None)
    return (getattr(processor, "backend", None) == "torchvision" and hasattr(module, "smart_resize")
            and getattr(processor, "do_resize", True)
            and int(resample if resample is not None else -1) == 3
            and all(hasattr(processor, a) for a in ("patch_size", "merge_size", "temporal_patch_size")))


__all__ = ["grid", "preprocess", "resize", "supported", "target_size", "taps"]
