"""The shared embedding tier's logic (``backend.encode.tier``) on an in-memory store with Mooncake's semantics (the
first value put under a key stays): entries round-trip, a stale, wrong-model, wrong-options, truncated or corrupted
entry is dropped and counted, a failing or hanging store is skipped without failing anything, and the
``EncoderService`` of two instances sharing the store encodes an item once (the real tiny-model encoder)."""
from __future__ import annotations

import io
import threading
import time

import pytest
import torch
from PIL import Image

from backend.encode.checkpoint import processing_options
from backend.encode.encoder import EncodedItem, VisionEncoder
from backend.encode.service import EncodeJob, EncoderService
from backend.encode.tier import CLAIM_PREFIX, EmbeddingTier, TierExpect, decode_entry, encode_entry
from backend.protocol.layout import content_key
from backend.request.media import MediaLimits
from tests.unit.test_encoder_cache import MODEL, CountingEncoder, RecordingPool, _png

EXPECT = TierExpect("qwen2_vl:abc", '{"patch_size":14}', "float32", 8)


class MemoryStore:
    """Mooncake's put semantics (a key keeps its first value), in a dict; ``fail``: every call raises;
    ``hang``: every call sleeps that long first."""

    def __init__(self):
        self.data: dict[str, bytes] = {}
        self.fail, self.hang, self.calls = False, 0.0, 0

    def _enter(self):
        self.calls += 1
        if self.hang:
            time.sleep(self.hang)
        if self.fail:
            raise ConnectionError("master unreachable")

    def get_bytes(self, key):
        self._enter()
        return self.data.get(key)

    def put_bytes(self, key, blob):
        self._enter()
        self.data.setdefault(key, blob)

    def exists(self, key):
        self._enter()
        return key in self.data

    def remove(self, key):
        self._enter()
        self.data.pop(key, None)


def _item(rows=3, width=8, dtype=torch.float32, **extra) -> EncodedItem:
    return EncodedItem(torch.arange(rows * width, dtype=dtype).reshape(rows, width), (1, 2, 6), **extra)


def test_an_entry_round_trips_with_its_layout_members():
    video = _item(modality="video", part=(1, 4), timing=(("timestamps", (0.5, 1.5)),))
    back = decode_entry(encode_entry("k", video, EXPECT), "k", EXPECT)
    assert torch.equal(back.embeddings, video.embeddings) and back == EncodedItem(back.embeddings, (1, 2, 6), "video",
                                                                                 (1, 4), (("timestamps", (0.5, 1.5)),))
    bf16 = TierExpect(EXPECT.model, EXPECT.processing, "bfloat16", 8)
    assert torch.equal(decode_entry(encode_entry("k", _item(dtype=torch.bfloat16), bf16), "k", bf16).embeddings,
                       _item(dtype=torch.bfloat16).embeddings)


def _corrupt(blob: bytes) -> bytes:
    return blob[:-1] + bytes([blob[-1] ^ 1])


@pytest.mark.parametrize("reason, blob", [
    ("model", lambda: encode_entry("k", _item(), TierExpect("qwen2_vl:other", EXPECT.processing, "float32", 8))),
    ("processing", lambda: encode_entry("k", _item(), TierExpect(EXPECT.model, "{}", "float32", 8))),
    ("dtype", lambda: encode_entry("k", _item(dtype=torch.float16), EXPECT)),
    ("shape", lambda: encode_entry("k", _item(width=16), EXPECT)),
    ("key", lambda: encode_entry("another item", _item(), EXPECT)),
    ("truncated", lambda: encode_entry("k", _item(), EXPECT)[:-4]),
    ("integrity", lambda: _corrupt(encode_entry("k", _item(), EXPECT))),
    ("format", lambda: b"not an entry at all"),
])
def test_a_bad_entry_is_never_served_it_is_dropped_and_counted(reason, blob):
    store = MemoryStore()
    store.data["k"] = blob()
    tier = EmbeddingTier(store)
    assert tier.get("k", EXPECT) is None
    assert tier.stats.bad == {reason: 1} and tier.stats.hits == 0 and "k" not in store.data  # dropped
    tier.put("k", _item(), EXPECT)  # encoded again: the new entry takes its place
    tier.flush()
    assert torch.equal(tier.get("k", EXPECT).embeddings, _item().embeddings) and tier.stats.hits == 1


def test_a_failing_store_is_skipped_for_a_while_then_tried_again():
    store = MemoryStore()
    tier = EmbeddingTier(store, retry_seconds=0.3)
    store.fail = True
    assert tier.get("k", EXPECT) is None and tier.stats.errors == 1
    calls = store.calls
    assert tier.get("k", EXPECT) is None and tier.claim("k") is True  # down: no store call, encode here
    tier.put("k", _item(), EXPECT)
    assert store.calls == calls and tier.stats.skipped >= 2 and tier.stats.dropped_writes == 1
    store.fail = False
    time.sleep(0.35)
    tier.put("k", _item(), EXPECT)
    tier.flush()
    assert tier.get("k", EXPECT) is not None and tier.stats.errors == 1


def test_a_hanging_store_costs_one_call_timeout_then_nothing():
    store = MemoryStore()
    store.hang = 2.0
    tier = EmbeddingTier(store, call_timeout=0.1, retry_seconds=30)
    started = time.perf_counter()
    assert tier.get("k", EXPECT) is None and tier.get("j", EXPECT) is None
    assert time.perf_counter() - started < 0.5 and tier.stats.errors == 1 and tier.stats.skipped == 1


def test_a_claim_is_won_once_and_a_dead_owners_claim_is_taken_over():
    store = MemoryStore()
    first, second = EmbeddingTier(store, claim_seconds=0.3), EmbeddingTier(store, claim_seconds=0.3)
    assert first.claim("k") is True and second.claim("k") is False
    time.sleep(0.35)  # the owner never published: its claim expires
    assert second.claim("k") is True and store.data[CLAIM_PREFIX + "k"]
    second.put("k", _item(), EXPECT, release_claim=True)
    second.flush()
    assert CLAIM_PREFIX + "k" not in store.data and "k" in store.data


def test_a_claim_whose_rival_put_is_still_in_flight_is_lost_not_taken_for_a_tier_down():
    """Mooncake: while another instance's put of the claim key is in flight, ours keeps nothing and a read answers
    nothing; the claim is read again until the rival's value is there (the benchmark's race: both encoded)."""
    store = MemoryStore()
    rival = f"rival-token {time.time()}".encode()
    reads = []

    def get_bytes(key):
        reads.append(key)
        if len(reads) < 3:  # the rival's put completes after two reads
            return b""
        store.data[key] = rival
        return rival

    store.put_bytes = lambda key, blob: None  # the key is the rival's in-flight put's
    store.get_bytes = get_bytes
    tier = EmbeddingTier(store, claim_seconds=5.0, poll_seconds=0.001)
    assert tier.claim("k") is False and len(reads) == 3 and tier.stats.claims_lost == 1 and tier.stats.errors == 0


def test_a_claim_won_after_the_entry_appeared_is_given_back_and_the_entry_read():
    """The entry was published (and its claim released) between this caller's lookup and its claim: no encode."""
    store = MemoryStore()
    writer, late = EmbeddingTier(store), EmbeddingTier(store)
    writer.put("k", _item(), EXPECT, release_claim=True)
    writer.flush()
    assert late.claim("k") is False and CLAIM_PREFIX + "k" not in store.data
    assert late.wait(["k"], EXPECT)["k"].embeddings.equal(_item().embeddings) and late.stats.waits_served == 1


def test_a_claim_whose_rival_published_and_released_meanwhile_is_lost_and_the_entry_read():
    """CI's race (2 encodes of 16 cold requests): our put of the claim found the rival's still there (kept nothing);
    before our read the rival published its entry and released its claim, so the read is empty. Not a tier down:
    no encode, the entry is read."""
    store = MemoryStore()
    rival_tier = EmbeddingTier(store)
    real_put = store.put_bytes

    def put_bytes(key, blob):
        if key.startswith(CLAIM_PREFIX):  # the rival's claim is there: ours keeps nothing; then the rival finishes
            rival_tier.put("k", _item(), EXPECT, release_claim=True)
            rival_tier.flush()
            return None
        return real_put(key, blob)

    store.put_bytes = put_bytes
    tier = EmbeddingTier(store, claim_seconds=5.0, poll_seconds=0.05)
    started = time.monotonic()
    assert tier.claim("k") is False and tier.stats.claims_lost == 1 and tier.stats.claims_won == 0
    assert time.monotonic() - started < 0.05  # stopped reading at once: the entry is there
    assert tier.wait(["k"], EXPECT)["k"].embeddings.equal(_item().embeddings)


def test_a_claim_whose_rival_went_without_an_entry_is_claimed_again():
    """The rival's claim vanished and no entry came (its encode failed, its claim was removed): claim again, win."""
    store = MemoryStore()
    puts = []
    real_put = store.put_bytes

    def put_bytes(key, blob):
        puts.append(key)
        if len(puts) == 1:
            return None  # the rival's claim was there, then went
        return real_put(key, blob)

    store.put_bytes = put_bytes
    tier = EmbeddingTier(store, claim_seconds=5.0, poll_seconds=0.001)
    assert tier.claim("k") is True and len(puts) == 2 and tier.stats.claims_won == 1


# -- EncoderService with a tier: the real tiny encoder ------------------------------------------------------------

class Counting(CountingEncoder):
    def __init__(self, encoder):
        super().__init__(encoder)
        self.dtype, self.width = encoder.dtype, encoder.width

    def temporal_patches(self, video):
        return self.encoder.temporal_patches(video)


@pytest.fixture(scope="module")
def encoder():
    return VisionEncoder.load(MODEL)


def _instance(encoder, tier, cache_bytes=1 << 20):
    counting = Counting(encoder)
    return EncoderService(counting, RecordingPool(), MediaLimits(), processing_options(MODEL), cache_bytes, tier), counting


def test_an_item_encoded_by_one_instance_is_served_to_another_from_the_tier(encoder):
    store = MemoryStore()
    a, counting_a = _instance(encoder, EmbeddingTier(store))
    b, counting_b = _instance(encoder, EmbeddingTier(store))
    image = _png(64, 48, 1)
    a.run([EncodeJob(0, image, "k")], 1)
    a.tier.flush()
    b.run([EncodeJob(0, image, "k")], 1)
    assert counting_a.calls == [1] and counting_b.calls == [] and b.tier_hits == 1
    assert torch.equal(a.pool.published[0], b.pool.published[0])
    b.run([EncodeJob(0, image, "k")], 1)  # now in b's own cache: the tier is not asked
    assert b.cache_hits == 1 and b.tier.stats.hits == 1


def test_sixteen_requests_for_one_new_item_in_one_batch_encode_it_once(encoder):
    service, counting = _instance(encoder, EmbeddingTier(MemoryStore()), cache_bytes=0)
    image = _png(64, 48, 2)
    results = service.run([EncodeJob(i, image, "k") for i in range(16)], 16)
    assert counting.calls == [1] and all(len(r) == 1 for r in results) and len(service.pool.published) == 16


def test_an_item_another_instance_is_encoding_is_waited_for_not_encoded(encoder):
    store = MemoryStore()
    owner, waiter = EmbeddingTier(store), EmbeddingTier(store, claim_seconds=5.0)
    b, counting_b = _instance(encoder, waiter)
    image = _png(64, 48, 3)
    key = content_key(image, b.processing, encoder.identity)
    assert owner.claim(key)  # instance A is encoding it, and publishes it 0.3 s later
    item = encoder.encode([Image.open(io.BytesIO(image)).convert("RGB")])[0]
    threading.Timer(0.3, owner.put, (key, item, b.expect()), {"release_claim": True}).start()
    started = time.perf_counter()
    results = b.run([EncodeJob(0, image, "k")], 1)
    assert counting_b.calls == [] and waiter.stats.waits_served == 1 and 0.25 < time.perf_counter() - started < 3
    assert len(results[0]) == 1 and torch.equal(b.pool.published[0], item.embeddings)


def test_the_tier_failing_fails_no_request(encoder):
    store = MemoryStore()
    store.fail = True
    service, counting = _instance(encoder, EmbeddingTier(store))
    results = service.run([EncodeJob(0, _png(64, 48, 4), "k"), EncodeJob(1, _png(64, 48, 5), "j")], 2)
    assert all(isinstance(r, list) and len(r) == 1 for r in results) and counting.calls == [2]
    assert service.tier.stats.errors == 1


def test_the_mooncake_venv_is_found_beside_the_project_or_where_named(tmp_path, monkeypatch):
    """``tier_service.mooncake_paths``: the venv's site-packages, its master binary and the private library
    directories (those holding a library), from ``EPD_MOONCAKE_VENV`` or ``.venv-mooncake``; None without mooncake."""
    from backend.deploy import tier_service

    site = tmp_path / "lib" / "python3.11" / "site-packages"
    (site / "mooncake").mkdir(parents=True)
    (site / "mooncake" / "mooncake_master").write_bytes(b"")
    for lib in ("usr/lib/x86_64-linux-gnu/libibverbs.so.1", "lib/x86_64-linux-gnu/libnl-3.so.200"):
        (tmp_path / "private-libs" / lib).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "private-libs" / lib).write_bytes(b"")
    (tmp_path / "private-libs" / "etc").mkdir()
    monkeypatch.setenv(tier_service.VENV_ENV, str(tmp_path))
    monkeypatch.delenv(tier_service.LIBS_ENV, raising=False)
    assert tier_service.mooncake_paths() == (site, site / "mooncake" / "mooncake_master",
                                             f"{tmp_path}/private-libs/lib/x86_64-linux-gnu:"
                                             f"{tmp_path}/private-libs/usr/lib/x86_64-linux-gnu")
    monkeypatch.setenv(tier_service.LIBS_ENV, "/opt/ibv")
    assert tier_service.mooncake_paths()[2] == "/opt/ibv"
    monkeypatch.setenv(tier_service.VENV_ENV, str(tmp_path / "none"))
    assert tier_service.mooncake_paths() is None
    monkeypatch.delenv(tier_service.VENV_ENV)
    monkeypatch.setattr(tier_service, "DEFAULT_VENV", tmp_path)
    assert tier_service.mooncake_paths()[0] == site
