"""Batch invariance of the encoder, every family and modality: an item's embeddings and layout are the same alone, in
any batch composition and in any order (Triton's dynamic batcher puts items of different requests in one ``encode``
call, so a request's answer must not depend on its neighbours).

What is exact and what is bounded (fp32, the tiny checkpoints, 2 CPU threads):
- the layout (grid, modality, video part, video timing) and the processors' pixels: bitwise;
- the embeddings: within ``tests.bounds.BATCH_BOUND`` (a few float32 ulps: the tower's matrix products sum in an order
  that oneDNN / MKL choose by the number of rows in the batch).

Videos of different frame counts, sizes and frame rates in one call, sampled by the loader or left to the processor
(``do_sample_frames``: Qwen3-VL), and video parts: one Qwen3-VL processor call for several videos once sampled an
already sampled video with another's setting (IndexError, or other frames than ``llm``'s; issue 35).
"""
from __future__ import annotations

import random

import pytest
import torch

from backend.deploy.local_server import ROOT
from backend.encode.encoder import VideoPart, load_encoder
from backend.request.audio import decode_audio
from backend.request.media import MediaLimits
from backend.request.video import decode_video, video_processor_for
from clients.audios import make_audio
from clients.images import make_image
from devtools.tiny.families import DEFAULT_OUT, FAMILIES, build_family
from tests.bounds import BATCH_BOUND as BOUND
from tests.videos import make_video

VISION = ("qwen2_vl", *FAMILIES)
IMAGES = [(64, 48), (28, 560), (200, 150), (30, 30), (560, 28)]  # (width, height): strips and the smallest
# (width, height, frames, fps): sampled by the loader (6 of 45), or all kept (the first: 4 frames at 4 fps, and
# 8 frames at 1 fps, which Qwen3-VL's loader leaves to the processor)
CLIPS = [(64, 48, 4, 4), (48, 64, 6, 4), (64, 64, 8, 1), (160, 120, 45, 15), (96, 160, 30, 12)]
AUDIO = [(0.3, 8_000, 1), (2.0, 16_000, 2), (1.1, 44_100, 1), (0.1, 48_000, 2)]  # (seconds, rate, channels)


def _model(family: str):
    path = ROOT / DEFAULT_OUT.get(family, "models/tiny-qwen2-vl")
    if family in FAMILIES:
        build_family(family, path)  # idempotent: a no-op when setup built it
    return path


@pytest.fixture(scope="module", params=VISION)
def vision(request):
    """(encoder, items) of a vision family: images, whole videos and the parts of two of them."""
    model = _model(request.param)
    limits = MediaLimits(video_processor=video_processor_for(model))
    videos = [decode_video(make_video(w, h, frames=n, fps=fps, seed=10 + i), f"video[{i}]", limits)
              for i, (w, h, n, fps) in enumerate(CLIPS)]
    parts = [VideoPart(videos[i], (k, 2)) for i in (2, 4) for k in range(2)]
    images = [make_image(w, h, seed=i) for i, (w, h) in enumerate(IMAGES)]
    return load_encoder(model), [*images, *videos, *parts]


@pytest.fixture(scope="module")
def audio():
    model = ROOT / "models" / "tiny-qwen2-audio"
    limits = MediaLimits(audio_sampling_rate=16_000, max_audio_seconds=120)
    clips = [decode_audio(make_audio(s, rate, channels, seed=i), f"audio[{i}]", limits)
             for i, (s, rate, channels) in enumerate(AUDIO)]
    return load_encoder(model), clips


def _layout(item) -> tuple:
    return tuple(getattr(item, name, None) for name in ("image_grid_thw", "modality", "part", "timing",
                                                         "feature_length"))


def _compositions(count: int, seed: int = 0):
    """Batches of item indices: all in order, reversed, and seeded shuffles of random subsets with a repeat."""
    rng = random.Random(seed)
    yield list(range(count))
    yield list(reversed(range(count)))
    for _ in range(4):
        order = rng.sample(range(count), rng.randint(2, count))
        yield order + [rng.choice(order)]


def _assert_invariant(encoder, items) -> None:
    alone = [encoder.encode([item])[0] for item in items]
    for batch in _compositions(len(items)):
        for index, got in zip(batch, encoder.encode([items[i] for i in batch])):
            assert _layout(got) == _layout(alone[index]), (batch, index)
            torch.testing.assert_close(got.embeddings, alone[index].embeddings, **BOUND,
                                       msg=lambda m: f"item {index} in batch {batch}: {m}")


def test_vision_items_encode_the_same_alone_and_in_any_batch(vision):
    _assert_invariant(*vision)


def test_audio_items_encode_the_same_alone_and_in_any_batch(audio):
    _assert_invariant(*audio)


def test_a_video_part_is_the_rows_of_its_whole_video(vision):
    encoder, items = vision
    parts = [item for item in items if isinstance(item, VideoPart)]
    for whole in {id(p.video): p.video for p in parts}.values():
        rows = encoder.encode([whole])[0].embeddings
        got = torch.cat([e.embeddings for e in encoder.encode([p for p in parts if p.video is whole])])
        torch.testing.assert_close(got, rows, **BOUND)


def test_the_video_processor_s_pixels_are_the_same_for_one_video_or_many(vision):
    """The pixels of several videos of different frame counts, sizes and rates in one processor call are, bitwise,
    those of each video alone; for Qwen3-VL this is the call that failed before the per-video sampling (issue 35)."""
    encoder, items = vision
    videos = [item for item in items if type(item).__name__ == "DecodedVideo"]
    alone = [encoder._preprocess_videos([encoder._sampled(v)]) for v in videos]
    pixels, grid = encoder._preprocess_videos([encoder._sampled(v) for v in videos])
    assert torch.equal(grid, torch.cat([g for _, g in alone]))
    assert torch.equal(pixels, torch.cat([p for p, _ in alone]))
