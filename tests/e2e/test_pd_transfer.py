"""E2E: ``pd`` pulls embeddings through NIXL from a producer it has never seen: this test process.

The test runs the project's real encoder runner and a real NIXL producer pool, hands ``pd`` only the
layout metadata, and checks that ``pd``'s output is the baseline's for that image (so the embeddings
did arrive), that corrupting the producer's buffer before the pull changes the output (so they came
through the NIXL read, not from anywhere else), and that a released lease fails only that request.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from backend.deploy.local_server import ROOT
from backend.encode.encoder import VisionEncoder
from backend.protocol.generate import GenerateInputs
from backend.protocol.layout import ImageLayout, LayoutMetadata
from backend.transfer.producer import EmbeddingPool, HEADER
from clients.triton_client import GenerateError, generate
from tests.images import image_bytes, make_image

pytestmark = pytest.mark.e2e

PROMPT = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n<|im_start|>assistant\n"
GREEDY = {"temperature": 0.0, "max_tokens": 16}
SIZE, SEED = (72, 56), 7


@pytest.fixture(scope="module")
def producer():
    encoder = VisionEncoder.load(ROOT / "models" / "tiny-qwen2-vl")
    pool = EmbeddingPool(8 << 20, lease_seconds=60)
    yield encoder, pool
    pool.close()


def publish(producer, seed: int = SEED) -> LayoutMetadata:
    encoder, pool = producer
    item = encoder.encode([make_image(*SIZE, seed=seed)])[0]
    return LayoutMetadata(content_key=f"test-{seed}", model=encoder.identity, dtype="float32",
                          shape=tuple(item.embeddings.shape), handle=pool.publish(item.embeddings),
                          media=ImageLayout(item.image_grid_thw))


def ask(server, model, protocol="grpc", **inputs):
    url = server.grpc_url if protocol == "grpc" else server.http_url
    return generate(url, model, GenerateInputs(**{"sampling": GREEDY, **inputs}), protocol=protocol, timeout=120)


def ask_pd(server, layout: LayoutMetadata, protocol="grpc"):
    return ask(server, "pd", protocol, prompt=PROMPT, image_layouts=[layout.to_json()])


@pytest.fixture(scope="module")
def baseline(server):
    return ask(server, "llm", prompt=PROMPT, images=[image_bytes(*SIZE, seed=SEED)]).text


def test_pd_output_comes_from_the_pulled_embeddings(server, producer, baseline):
    layout = publish(producer)
    assert ask_pd(server, layout).text == baseline
    assert ask_pd(server, publish(producer, seed=SEED + 1)).text != baseline  # sensitivity


def test_corrupting_the_producer_buffer_before_the_pull_changes_the_output(server, producer, baseline):
    # under a content key of its own: vLLM takes an item's content key for its id (multi_modal_uuids) and answers a
    # key it has seen from its own caches (prefix, encoder), whatever embeddings come with it
    layout = replace(publish(producer), content_key="test-corrupted")
    _, pool = producer
    lease = pool._leases[layout.handle.lease_id]
    pool.buffer[lease.offset + HEADER: lease.offset + HEADER + layout.handle.nbytes].bitwise_xor_(0x21)
    assert ask_pd(server, layout).text != baseline


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_released_lease_fails_that_request_only(server, producer, baseline, protocol):
    layout = publish(producer)
    assert producer[1].release(layout.handle.lease_id)
    with pytest.raises(GenerateError) as info:
        ask_pd(server, layout, protocol)
    assert "released or expired before the read" in info.value.message  # sent as UNAVAILABLE (see README)
    assert ask_pd(server, publish(producer)).text == baseline  # pd keeps serving


def test_an_expired_lease_is_refused_before_any_read(server, producer):
    layout = publish(producer)
    expired = replace(layout, handle=replace(layout.handle, expires_at=layout.handle.expires_at - 3600))
    with pytest.raises(GenerateError, match="expired before it was read"):
        ask_pd(server, expired)


def test_layouts_of_another_model_are_invalid(server, producer):
    layout = replace(publish(producer), model="qwen2_vl:someothermodel")
    with pytest.raises(GenerateError) as info:
        ask_pd(server, layout, "http")
    assert info.value.message.startswith("image_layouts[0].model:")


def test_decode_needs_only_the_layout_when_the_kv_covers_the_media(server, producer, baseline):
    """prefill gets image A's embeddings (by handle) and hands its KV to decode through NIXL; decode gets
    image B's layout (same size, different pixels) and pulls no embeddings: the output is still A's."""
    layout_a, layout_b = publish(producer), publish(producer, seed=SEED + 1)
    assert layout_a.media.grid_thw == layout_b.media.grid_thw and layout_a.content_key != layout_b.content_key
    first = ask(server, "prefill", prompt=PROMPT, image_layouts=[layout_a.to_json()], stream=False,
                sampling={"temperature": 0.0, "max_tokens": 1}, kv_transfer_params={"do_remote_decode": True})
    params = first.kv_transfer_params
    assert params and params["do_remote_prefill"] and params["remote_block_ids"]
    assert producer[1].release(layout_b.handle.lease_id)  # decode must not need B's embeddings at all
    got = ask(server, "decode", prompt=PROMPT, image_layouts=[layout_b.to_json()], kv_transfer_params=params)
    assert got.text == baseline
    assert got.timings is None  # decode pulled no embeddings (pd/prefill report transfer_ms)
    without_kv = ask(server, "pd", prompt=PROMPT, image_layouts=[publish(producer, seed=SEED + 1).to_json()])
    assert without_kv.text != baseline  # B's own output differs: the KV made the difference


def test_a_decode_whose_kv_cannot_be_loaded_fails_that_request_only(server, producer, baseline):
    """decode handed KV parameters that point nowhere: that request fails (UNAVAILABLE, never a
    recompute without embeddings), and decode keeps serving the next one."""
    layout = publish(producer)
    first = ask(server, "prefill", prompt=PROMPT, image_layouts=[layout.to_json()], stream=False,
                sampling={"temperature": 0.0, "max_tokens": 1}, kv_transfer_params={"do_remote_decode": True})
    bogus = dict(first.kv_transfer_params, remote_engine_id="no-such-engine", remote_port=1,
                 remote_request_id="no-such-request")
    with pytest.raises(GenerateError) as info:
        ask(server, "decode", prompt=PROMPT, image_layouts=[layout.to_json()], kv_transfer_params=bogus)
    assert "finish_reason=error" in info.value.message, info.value.message
    assert ask(server, "decode", prompt=PROMPT, image_layouts=[layout.to_json()],
               kv_transfer_params=first.kv_transfer_params).text == baseline
