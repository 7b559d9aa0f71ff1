"""``backend.encode.gpu_image`` on the CPU (its ops are device-agnostic: the GPU runs the same integer and float32
element-wise arithmetic; tests/component/test_gpu_image_gpu.py checks it there): the resize equals the host's
fixed-point antialiased bicubic bit for bit, grids and pixel values equal the processor ``llm`` uses for every family,
and an encoder given uint8 tensors (``image_preprocess: gpu``) gives the embeddings it gives PIL images."""
from __future__ import annotations

import io
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms.v2 import functional as F

from backend.encode import gpu_image

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ("tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl")


def _processor(name: str):
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(ROOT / "models" / name)


def _sizes(count: int, seed: int, most: int = 700) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    fixed = [(28, 28), (1, 1), (5, 900), (900, 5), (448, 448), (896, 672), (601, 17)]
    return fixed + [(rng.randint(2, most), rng.randint(2, most)) for _ in range(count)]


def _host_resize(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    return F.resize(image, [height, width], interpolation=F.InterpolationMode.BICUBIC, antialias=True)


@pytest.mark.parametrize("seed", [0, 1])
def test_resize_is_the_host_kernel_bit_for_bit(seed):
    """Down- and upscales, one axis or both, extreme ratios: every output pixel equal to torch's CPU uint8 kernel."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    cases = [(300, 200, 308, 196), (64, 48, 56, 56), (17, 600, 28, 588), (640, 480, 640, 240), (50, 50, 50, 50)]
    cases += [(rng.randint(3, 500), rng.randint(3, 500), rng.randint(2, 400), rng.randint(2, 400)) for _ in range(12)]
    for h, w, oh, ow in cases:
        image = torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=gen)
        got = gpu_image.resize(image, oh, ow)
        assert got.dtype == torch.uint8 and got.shape == (3, oh, ow)
        assert torch.equal(got, _host_resize(image, oh, ow)), (h, w, oh, ow)


def test_resize_of_smooth_content_is_exact_too():
    """Gradients (values near the clip and rounding boundaries, unlike noise) and saturated edges."""
    y, x = torch.meshgrid(torch.arange(333), torch.arange(517), indexing="ij")
    image = torch.stack([(x * 255 // 516), (y * 255 // 332), ((x + y) % 2) * 255]).to(torch.uint8)
    for oh, ow in ((112, 168), (400, 620), (333, 200), (29, 517)):
        assert torch.equal(gpu_image.resize(image, oh, ow), _host_resize(image, oh, ow)), (oh, ow)


def test_taps_sum_to_one_in_fixed_point_and_stay_in_range():
    for in_size, out_size in ((1000, 3), (7, 900), (448, 448), (1, 28)):
        index, weights, precision = gpu_image.taps(in_size, out_size)
        assert index.min() >= 0 and index.max() < in_size
        assert np.all(np.abs(weights.sum(1) - (1 << precision)) <= weights.shape[1])  # rounding of each tap only


@pytest.mark.parametrize("name", FAMILIES)
def test_grids_are_the_processor_s_for_many_sizes(name):
    """``grid`` (the family's smart_resize) against the processor's own image_grid_thw, one size at a time."""
    processor = _processor(name)
    assert gpu_image.supported(processor)
    for h, w in _sizes(40, seed=len(name)):
        image = np.zeros((h, w, 3), np.uint8)
        expected = processor(images=[image], input_data_format="channels_last", return_tensors="pt")["image_grid_thw"]
        expected = expected[0].tolist()
        assert list(gpu_image.grid(processor, h, w)) == expected, (name, h, w)


@pytest.mark.parametrize("name", FAMILIES)
def test_pixel_values_equal_the_processor_s(name):
    """One batch of mixed sizes: the same grids and pixel values (bound 0) as the processor on the PIL images."""
    processor = _processor(name)
    rng = np.random.default_rng(7)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in _sizes(5, 3, most=500)]
    expected = processor(images=images, return_tensors="pt")
    tensors = [torch.from_numpy(np.array(image)).permute(2, 0, 1) for image in images]
    pixels, grid = gpu_image.preprocess(processor, tensors)
    assert torch.equal(grid, expected["image_grid_thw"])
    assert pixels.dtype == expected["pixel_values"].dtype
    assert torch.equal(pixels, expected["pixel_values"])


def test_a_processor_it_does_not_reproduce_is_refused():
    processor = _processor("tiny-qwen2-vl")
    other = type(processor)(**{**processor.to_dict(), "resample": 2})  # bilinear
    assert not gpu_image.supported(other)
    assert not gpu_image.supported(type(processor)(**{**processor.to_dict(), "do_resize": False}))
    with pytest.raises(TypeError):
        gpu_image.resize(torch.zeros(3, 4, 4), 2, 2)


def _png(image: Image.Image, kind: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, kind)
    return out.getvalue()


def test_decode_gives_the_host_pixels_as_a_tensor_where_asked():
    """``image_device`` set: the [3, H, W] uint8 tensor of PIL's RGB pixels there (nvjpeg asked on a CPU device:
    the host's decode); unset: the PIL image as before."""
    from backend.request import image as image_module
    from backend.request.media import MediaLimits

    rng = np.random.default_rng(1)
    picture = Image.fromarray(rng.integers(0, 256, (37, 53, 3), dtype=np.uint8))
    for kind in ("PNG", "JPEG"):
        data = _png(picture, kind)
        plain = image_module.decode_image(data, "image[0]", MediaLimits())
        before = image_module.IMAGE_DECODES["cpu"]
        got = image_module.decode_image(data, "image[0]", MediaLimits(image_device="cpu", nvjpeg=True))
        assert isinstance(plain, Image.Image) and got.shape == (3, 37, 53) and got.dtype == torch.uint8
        assert torch.equal(got, torch.from_numpy(np.array(plain)).permute(2, 0, 1))
        assert image_module.IMAGE_DECODES["cpu"] == before + 1
    grey = _png(Image.new("L", (8, 6), 77))
    assert torch.equal(image_module.decode_image(grey, "image[0]", MediaLimits(image_device="cpu")),
                       torch.full((3, 6, 8), 77, dtype=torch.uint8))


def test_encoder_gives_tensor_images_the_embeddings_of_pil_images():
    """Tensor images (any mix with PIL ones and a video in one batch) encode to the same embeddings and grids."""
    from backend.encode.encoder import VisionEncoder, is_image
    from tests.images import make_image

    encoder = VisionEncoder.load(ROOT / "models" / "tiny-qwen2-vl", device="cpu", dtype=torch.float32)
    images = [make_image(64, 48, 1), make_image(300, 200, 3), make_image(112, 112, 2)]
    tensors = [torch.from_numpy(np.array(image)).permute(2, 0, 1).contiguous() for image in images]
    assert all(is_image(t) for t in tensors)
    expected = encoder.encode(images)
    got = encoder.encode([tensors[0], images[1], tensors[2]])
    for a, b in zip(expected, got):
        assert a.image_grid_thw == b.image_grid_thw and a.modality == b.modality
        assert torch.equal(a.embeddings, b.embeddings)


def test_topology_takes_image_preprocess_on_a_gpu_encoder_only(tmp_path):
    from backend.deploy.render import render
    from backend.deploy.topology import load
    from tests.topology_errors import assert_refused

    topology = load(ROOT / "topologies" / "checkpoint-gpu.yaml", machine="gpu",
                    checkpoint=ROOT / "models" / "tiny-qwen2-vl")
    assert topology.stages["encoder"].image_preprocess == "cpu"  # the default: unchanged
    for value in ("gpu", "nvjpeg"):
        spec = replace(topology.stages["encoder"], image_preprocess=value)
        render(replace(topology, stages={**topology.stages, "encoder": spec}), tmp_path / value)
        config = (tmp_path / value / "encoder" / "config.pbtxt").read_text()
        assert 'key: "image_preprocess"' in config and f'string_value: "{value}"' in config
    text = (ROOT / "topologies" / "checkpoint-gpu.yaml").read_text()
    assert_refused(tmp_path, ((text.replace("encoder: {", "encoder: {image_preprocess: tpu, ", 1), "expected one of"),
                              (text.replace("pd: {", "pd: {image_preprocess: gpu, ", 1), "only the encoder"),
                              (text.replace("encoder: {", "encoder: {image_preprocess: gpu, ", 1)
                               .replace("device: gpu, gpus: [0]}   #", "device: cpu}   #", 1), "needs device: gpu")),
                   machine="gpu", checkpoint=ROOT / "models" / "tiny-qwen2-vl")


def test_blocking_waits_are_refused_quietly_without_a_driver(monkeypatch):
    import ctypes

    from backend.encode import cuda_wait

    def missing(name, *args, **kwargs):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", missing)
    assert cuda_wait.block_on_waits(0) is False


def test_encoder_settings_parse_image_preprocess():
    from backend.protocol.settings import EncoderSettings, ImagePreprocess

    assert EncoderSettings().image_preprocess == ImagePreprocess.CPU
    assert [v.value for v in ImagePreprocess] == ["cpu", "gpu", "nvjpeg"]
