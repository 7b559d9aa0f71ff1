"""GPU paths: the encoder on CUDA and a VRAM producer pool read by a host-memory consumer through NIXL.

Skipped where no GPU exists (CI); run on the lent GPU machine (see docs/epd.md for the command)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.component,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[2]


def test_vram_pool_is_read_into_host_memory_through_nixl():
    from backend.transfer.consumer import EmbeddingConsumer
    from backend.transfer.process import ProducerProcess, make_layout

    consumer = EmbeddingConsumer()
    with ProducerProcess(pool_bytes=64 << 20, device="cuda") as producer:
        for rows in (4, 1000, 32768):  # 2 KiB .. 16 MiB
            tensor = torch.randn(rows, 128)
            doc = producer.call("publish", tensor)
            assert doc["shm_path"] == ""  # VRAM: no same-host memfd path, a NIXL READ
            layout = make_layout(doc, tensor)
            assert torch.equal(consumer.pull(layout), tensor)
            assert producer.wait_state(layout.handle.lease_id, None) is None  # released by the notification
        tensor = torch.randn(64, 128)
        layout = make_layout(producer.call("publish", tensor), tensor)
        producer.call("release", layout.handle.lease_id)
        from backend.errors import Unavailable
        with pytest.raises(Unavailable, match="released or expired"):
            consumer.pull(layout)


def test_encoder_on_gpu_matches_cpu_and_publishes_from_vram():
    from backend.encoder import VisionEncoder
    from backend.layout import LayoutMetadata
    from backend.transfer.consumer import EmbeddingConsumer
    from backend.transfer.producer import EmbeddingPool
    from tests.images import make_image

    model = ROOT / "models" / "tiny-qwen2-vl"
    images = [make_image(64, 48, 1), make_image(112, 112, 2), make_image(300, 200, 3)]
    cpu = VisionEncoder.load(model, device="cpu").encode(images)
    gpu = VisionEncoder.load(model, device="cuda").encode(images)
    for a, b in zip(cpu, gpu):
        assert b.embeddings.is_cuda and a.image_grid_thw == b.image_grid_thw
        torch.testing.assert_close(b.embeddings.cpu(), a.embeddings, rtol=1e-4, atol=1e-4)
    pool = EmbeddingPool(16 << 20, device="cuda")
    try:
        item = gpu[1]
        handle = pool.publish(item.embeddings)
        layout = LayoutMetadata("k", "image", "m", "float32", tuple(item.embeddings.shape), item.image_grid_thw, handle)
        pulled = EmbeddingConsumer().pull(layout)
        assert torch.equal(pulled, item.embeddings.cpu())
    finally:
        pool.close()
