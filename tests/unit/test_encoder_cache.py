"""The encoder's embedding cache (``EncoderService`` with ``cache_bytes``): the real tiny-model encoder on
CPU, a fake pool that records what is published."""
from __future__ import annotations

import io
import secrets
from pathlib import Path

import pytest
import torch
from PIL import Image

from backend.encode.checkpoint import processing_options
from backend.encode.encoder import VisionEncoder
from backend.encode.service import EncodeJob, EncoderService
from backend.protocol.layout import LayoutMetadata, NixlHandle
from backend.request.media import MediaLimits
from tests.images import make_image

MODEL = Path(__file__).resolve().parents[2] / "models" / "tiny-qwen2-vl"


class RecordingPool:
    alloc_timeout = 0.0

    def __init__(self):
        self.published: list[torch.Tensor] = []

    def publish(self, tensor, timeout=None):
        self.published.append(tensor.clone())
        return NixlHandle(agent_name="fake", agent_metadata=b"", descriptors=b"", lease_id=secrets.token_hex(7),
                          nbytes=tensor.numel() * tensor.element_size(), expires_at=1e12)

    def release(self, lease_id):
        pass


class CountingEncoder:
    def __init__(self, encoder):
        self.encoder, self.identity, self.calls = encoder, encoder.identity, []
        self.modalities = encoder.modalities

    def encode(self, images):
        self.calls.append(len(images))
        return self.encoder.encode(images)


@pytest.fixture(scope="module")
def encoder():
    return VisionEncoder.load(MODEL)


def _png(width, height, seed) -> bytes:
    buf = io.BytesIO()
    make_image(width, height, seed).save(buf, format="PNG")
    return buf.getvalue()


def _service(encoder, cache_bytes):
    counting = CountingEncoder(encoder)
    pool = RecordingPool()
    return EncoderService(counting, pool, MediaLimits(), processing_options(MODEL), cache_bytes=cache_bytes), counting, pool


def test_a_repeated_item_is_published_from_the_cache_with_the_same_embeddings(encoder):
    service, counting, pool = _service(encoder, 1 << 20)
    a, b = _png(64, 48, 1), _png(112, 112, 2)
    first = service.run([EncodeJob(0, a, "ka"), EncodeJob(1, b, "kb")], 2)
    second = service.run([EncodeJob(0, b, "kb"), EncodeJob(0, a, "ka")], 1)
    assert counting.calls == [2] and service.items_encoded == 2 and service.cache_hits == 2
    assert torch.equal(pool.published[2], pool.published[1]) and torch.equal(pool.published[3], pool.published[0])
    layouts = [LayoutMetadata.from_json(doc, "layout") for doc in first[0] + first[1] + second[0]]
    assert len({layout.handle.lease_id for layout in layouts}) == 4  # a lease per item, cached or not
    assert layouts[2].media.grid_thw == layouts[1].media.grid_thw and layouts[2].content_key == "kb"


def test_the_cache_key_comes_from_the_bytes_not_from_the_caller(encoder):
    service, counting, pool = _service(encoder, 1 << 20)
    a, b = _png(64, 48, 1), _png(64, 48, 2)
    service.run([EncodeJob(0, a, "key-the-caller-claims-for-b")], 1)
    service.run([EncodeJob(0, b, "key-the-caller-claims-for-b")], 1)
    assert counting.calls == [1, 1] and service.cache_hits == 0  # b encoded: a did not answer for it
    assert not torch.equal(pool.published[0], pool.published[1])


def test_the_cache_keeps_to_its_budget_and_can_be_off(encoder):
    images = [_png(112, 112, seed) for seed in range(4)]  # 16 embeddings x 128 floats = 8 KiB each
    service, counting, _ = _service(encoder, 20 << 10)  # room for two
    for data in images:
        service.run([EncodeJob(0, data, "")], 1)
    assert service.cache.bytes <= 20 << 10 and len(service.cache) == 2
    service.run([EncodeJob(0, images[3], "")], 1)  # the most recent: kept
    service.run([EncodeJob(0, images[0], "")], 1)  # the oldest: evicted, encoded again
    assert service.cache_hits == 1 and counting.calls == [1, 1, 1, 1, 1]
    off, counting_off, _ = _service(encoder, 0)
    off.run([EncodeJob(0, images[0], "")], 1)
    off.run([EncodeJob(0, images[0], "")], 1)
    assert off.cache_hits == 0 and counting_off.calls == [1, 1]


def test_a_bad_item_fails_its_request_only_even_beside_cached_items(encoder):
    service, counting, _ = _service(encoder, 1 << 20)
    good = _png(64, 48, 1)
    service.run([EncodeJob(0, good, "")], 1)
    results = service.run([EncodeJob(0, good, ""), EncodeJob(0, b"not an image", ""), EncodeJob(1, good, "")], 2)
    assert isinstance(results[0], Exception) and "image" in str(results[0])
    assert isinstance(results[1], list) and len(results[1]) == 1


def test_a_key_computed_by_the_model_is_not_computed_again(encoder, monkeypatch):
    import backend.encode.service

    real, calls = backend.encode.service.content_key, []
    monkeypatch.setattr(backend.encode.service, "content_key", lambda *args: calls.append(args) or real(*args))
    service, counting, _ = _service(encoder, 1 << 20)
    a = _png(64, 48, 1)
    own = real(a, service.processing, service.encoder.identity)
    service.run([EncodeJob(0, a, own, own_key=own)], 1)
    assert calls == []  # the model hashed the bytes already
    service.run([EncodeJob(0, a, "caller-key")], 1)  # a caller's key: hashed here, and the cache answers
    assert len(calls) == 1 and service.cache_hits == 1 and counting.calls == [1]


def test_warm_up_reaches_the_compiled_tower_whatever_the_processor_caps(encoder, monkeypatch):
    """With a compiled tower on CUDA, ``warm_up`` feeds the tower at least ``COMPILE_MIN_TOKENS`` patches, once as
    one attention sequence (an image) and once as two longer ones (a video's frames: the graph's second compile makes
    the longest sequence an input, ``packed_tower._token_dynamic``), so its blocks compile at load (else each
    instance compiles in its first large batch: 6-7 s TTFT outliers on the H200). The tiny checkpoint's processor
    caps an image at 12,544 pixels (64 patches): a warm-up through the processor never got there, and the first
    batch of 8 videos compiled at 5-9 s on the H200."""
    import backend.encode.packed_tower as packed
    from backend.encode.packed_tower import COMPILE_MIN_TOKENS

    calls = []

    def recording(x, cos, sin, cu, max_len, lengths, *rest):
        calls.append((x.shape[0], cu.numel() - 1, max_len))
        return packed._block_eager(x, cos, sin, cu, max_len, lengths, *rest)

    monkeypatch.setattr(encoder, "device", torch.device("cuda"))
    monkeypatch.setattr(encoder.forward, "compile", True, raising=False)
    monkeypatch.setattr(encoder.forward, "_block", lambda: recording)
    encoder.warm_up()
    blocks = len(encoder.forward.tower.blocks)
    assert len(calls) == 2 * blocks
    (tokens, sequences, longest), (tokens2, sequences2, longest2) = calls[0], calls[blocks]
    assert tokens >= COMPILE_MIN_TOKENS and sequences == 1 and longest == tokens
    assert sequences2 == 2 and longest2 > longest and tokens2 == 2 * longest2
    monkeypatch.setattr(encoder.forward, "compile", False, raising=False)
    calls.clear()
    encoder.warm_up()
    assert calls == []  # nothing to compile: check_width at load paid the first calls


def test_a_batch_s_items_are_decoded_at_once_and_keep_their_order(encoder, monkeypatch):
    """``EncoderService`` decodes a batch's distinct items on its decode threads (``DECODE_THREADS``), not one
    after another; each request's layouts stay in its items' order, and a bad item fails only its request."""
    import threading
    import time as clock

    import backend.encode.service as service_module

    real, lock, running, most = service_module._decode, threading.Lock(), [0], [0]

    def slow(job, limits, enc):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        clock.sleep(0.3)
        with lock:
            running[0] -= 1
        return real(job, limits, enc)

    monkeypatch.setattr(service_module, "_decode", slow)
    service, counting, pool = _service(encoder, 0)
    sizes = [(64, 48), (112, 112), (56, 84), (84, 56)]
    images = [_png(w, h, seed) for seed, (w, h) in enumerate(sizes)]
    jobs = [EncodeJob(0, images[0], ""), EncodeJob(1, images[1], ""), EncodeJob(0, images[2], ""),
            EncodeJob(1, b"not an image", ""), EncodeJob(2, images[3], ""), EncodeJob(2, images[0], "")]
    started = clock.perf_counter()
    results = service.run(jobs, 3)
    wall = clock.perf_counter() - started
    assert most[0] >= 2, "the decodes ran one after another"
    assert wall < 5 * 0.3  # five distinct items (the repeated one is decoded once), at least two at a time
    assert isinstance(results[1], Exception) and "image" in str(results[1])
    grids = [[LayoutMetadata.from_json(doc, "layout").media.grid_thw for doc in results[r]] for r in (0, 2)]
    want = [[encoder.encode([Image.open(io.BytesIO(images[i])).convert("RGB")])[0].image_grid_thw for i in items]
            for items in ((0, 2), (3, 0))]
    assert grids == want


class PoisonedEncoder(CountingEncoder):
    """Raises for any batch holding an image of ``size`` (an item its processor or tower cannot take)."""

    def __init__(self, encoder, size):
        super().__init__(encoder)
        self.size = size

    def encode(self, images):
        self.calls.append(len(images))
        if any(getattr(item, "size", None) == self.size for item in images):
            raise IndexError("index 5 is out of bounds for axis 0 with size 4")
        return self.encoder.encode(images)


def test_an_item_that_fails_the_batch_fails_only_its_own_request(encoder):
    poisoned = PoisonedEncoder(encoder, (30, 30))
    service = EncoderService(poisoned, RecordingPool(), MediaLimits(), processing_options(MODEL))
    jobs = [EncodeJob(0, _png(64, 48, 1), "a"), EncodeJob(1, _png(30, 30, 2), "b"), EncodeJob(2, _png(56, 56, 3), "c")]
    results = service.run(jobs, 3)
    assert isinstance(results[1], IndexError)
    assert [len(r) for r in (results[0], results[2])] == [1, 1]
    assert poisoned.calls == [3, 1, 1, 1] and service.batch_retries == 1 and service.items_encoded == 2
    alone = encoder.encode([make_image(56, 56, 3)])[0]
    assert LayoutMetadata.from_json(results[2][0], "layout").media.grid_thw == alone.image_grid_thw
