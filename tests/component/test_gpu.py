"""GPU paths: the encoder on CUDA, VRAM producer pools read through NIXL and CUDA IPC, vLLM on the GPU through
``EngineHost``, and ``llm`` and ``epd`` served by the real tritonserver on the GPU.

Skipped where no GPU exists (CI); run on the lent GPU machine (docs/results/gpu.md has the commands)."""
from __future__ import annotations

import importlib.util
import os
import time
import uuid
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.component,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[2]


def test_vram_pool_is_read_into_host_memory_through_nixl():
    from backend.transfer.consumer import EmbeddingConsumer
    from devtools.diagnostics.pool_process import ProducerProcess, make_layout

    consumer = EmbeddingConsumer()
    with ProducerProcess(pool_bytes=64 << 20, device="cuda") as producer:
        for rows in (4, 1000, 32768):  # 2 KiB .. 16 MiB
            tensor = torch.randn(rows, 128)
            doc = producer.call("publish", tensor)
            assert doc["transport"] != "shared_memory" and "shm_path" not in doc  # VRAM: no same-host memfd path
            layout = make_layout(doc, tensor)
            assert torch.equal(consumer.pull(layout), tensor)
            assert producer.wait_state(layout.handle.lease_id, None) is None  # released by the notification
        tensor = torch.randn(64, 128)
        layout = make_layout(producer.call("publish", tensor), tensor)
        producer.call("release", layout.handle.lease_id)
        from backend.protocol.errors import Unavailable
        with pytest.raises(Unavailable, match="released or expired"):
            consumer.pull(layout)


def test_encoder_on_gpu_matches_cpu_and_publishes_from_vram():
    from backend.encode.encoder import VisionEncoder
    from backend.protocol.layout import ImageLayout, LayoutMetadata
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
        layout = LayoutMetadata("k", "m", "float32", tuple(item.embeddings.shape), handle, ImageLayout(item.image_grid_thw))
        pulled = EmbeddingConsumer().pull(layout)
        assert torch.equal(pulled, item.embeddings.cpu())
    finally:
        pool.close()


def test_cuda_ipc_pulls_vram_leases_into_vram_and_host_memory():
    from backend.protocol.errors import Unavailable
    from backend.transfer.consumer import EmbeddingConsumer
    from devtools.diagnostics.pool_process import ProducerProcess, make_layout

    to_gpu, to_host = EmbeddingConsumer(device="cuda"), EmbeddingConsumer(device="cpu")
    try:
        with ProducerProcess(pool_bytes=64 << 20, device="cuda") as producer:
            for rows in (4, 1000, 32768):
                tensor = torch.randn(rows, 128)
                for consumer in (to_gpu, to_host):
                    layout = make_layout(producer.call("publish", tensor), tensor)
                    assert layout.handle.transport == "cuda_ipc" and layout.handle.ipc_handle  # same host, VRAM pool
                    pulled = consumer.pull(layout)
                    assert pulled.device.type == consumer.device.type
                    assert torch.equal(pulled.cpu(), tensor)
                    assert producer.wait_state(layout.handle.lease_id, None) is None  # released by the notification
            tensor = torch.randn(64, 128)
            layout = make_layout(producer.call("publish", tensor), tensor)
            producer.call("release", layout.handle.lease_id)
            with pytest.raises(Unavailable, match="released or expired"):
                to_gpu.pull(layout)
        assert to_gpu.readers["cuda_ipc"].mappings  # the dead producer's mapping is still cached until the next pull notices
        with ProducerProcess(pool_bytes=8 << 20, device="cuda") as producer:  # a restarted producer
            tensor = torch.randn(16, 128)
            layout = make_layout(producer.call("publish", tensor), tensor)
            assert torch.equal(to_gpu.pull(layout).cpu(), tensor)
            assert list(to_gpu.readers["cuda_ipc"].mappings) == [layout.handle.agent_name]  # the dead one's mapping was closed
    finally:
        to_gpu.close()
        to_host.close()


def test_packed_encoder_on_gpu_matches_transformers():
    from backend.encode.encoder import VisionEncoder
    from tests.images import make_image

    model = ROOT / "models" / "tiny-qwen2-vl"
    images = [make_image(64, 48, 1), make_image(112, 112, 2), make_image(300, 200, 3)]
    reference = VisionEncoder.load(model, device="cpu", impl="transformers").encode(images)
    fp32 = VisionEncoder.load(model, device="cuda").encode(images)
    bf16 = VisionEncoder.load(model, device="cuda", dtype=torch.bfloat16, compile=True).encode(images)
    for ref, a, b in zip(reference, fp32, bf16):
        assert a.embeddings.is_cuda and a.image_grid_thw == ref.image_grid_thw
        torch.testing.assert_close(a.embeddings.cpu(), ref.embeddings, rtol=1e-4, atol=1e-4)
        scale = ref.embeddings.abs().max()
        assert (b.embeddings.float().cpu() - ref.embeddings).abs().max() <= 0.02 * scale  # bf16 rounding


def test_the_compiled_tower_once_warmed_up_takes_any_batch_without_compiling_again():
    """The compiled block's graph is dynamic in the token and sequence counts and the longest sequence only (the
    widths stay constants: ``packed_tower._token_dynamic``); after ``warm_up`` no batch may compile again (seconds
    of a request's time in the encoder)."""
    from torch._dynamo.utils import counters

    from backend.encode.encoder import VisionEncoder
    from backend.encode.packed_tower import PackedTower

    encoder = VisionEncoder.load(ROOT / "models" / "tiny-qwen2-vl", device="cuda", dtype=torch.bfloat16, compile=True)
    tower = encoder.forward
    assert isinstance(tower, PackedTower)
    before = counters["stats"]["unique_graphs"]
    tower.warm_up()
    warmed = counters["stats"]["unique_graphs"]
    assert warmed > before                                          # the counter sees compiles
    weight = tower.tower.patch_embed.proj.weight
    for grid in ([(1, 64, 64)], [(1, 32, 48), (1, 40, 40), (1, 8, 8)], [(3, 36, 36)], [(1, 70, 62)]):
        tokens = sum(t * h * w for t, h, w in grid)
        pixels = torch.randn(tokens, weight[0].numel(), device="cuda", dtype=torch.bfloat16)
        with torch.inference_mode():  # as the encoder's forward (a plan made outside it has other dispatch keys)
            out = tower.run(pixels, tower._plan(grid, pixels.device), compiled=True)
        assert out.shape[0] == tokens // 4 and torch.isfinite(out).all()
    assert counters["stats"]["unique_graphs"] == warmed


def test_encoder_cuda_graphs_give_the_compiled_forward_s_embeddings():
    """``encoder_cuda_graphs``: each batch padded to a bucket and replayed from its captured graph gives the compiled
    forward's embeddings (bf16: the padding only adds sequences of their own, but other matmul shapes may round
    otherwise); one capture per bucket."""
    from backend.encode.encoder import VisionEncoder
    from backend.encode.tower_graphs import TowerGraphs, bucket_tokens, padded_plan
    from tests.images import make_image

    model = ROOT / "models" / "tiny-qwen2-vl"
    plain = VisionEncoder.load(model, device="cuda", dtype=torch.bfloat16, compile=True)
    graphs = VisionEncoder.load(model, device="cuda", dtype=torch.bfloat16, compile=True, cuda_graphs=True)
    towers = graphs.forward
    assert isinstance(towers, TowerGraphs)
    graphs.warm_up()
    side = 32                                                       # warm-up's grid: one 448 px image's 1,024 patches
    known = set(towers._graphs)                                     # load's width check and warm-up's captures
    assert padded_plan(towers.tower, [(1, side, side)], towers.min_tokens)[1] in known
    assert towers.captures == len(known)
    batches = [[make_image(64, 48, 1)], [make_image(112, 112, 2), make_image(300, 200, 3)],
               [make_image(64, 48, 4), make_image(112, 112, 5), make_image(300, 200, 6)], [make_image(64, 48, 7)]]
    keys = []
    for batch in batches:
        before = towers.captures
        got = graphs.encode(batch)
        for a, b in zip(plain.encode(batch), got):
            assert b.embeddings.is_cuda and a.image_grid_thw == b.image_grid_thw
            scale = a.embeddings.float().abs().max()
            assert (b.embeddings.float() - a.embeddings.float()).abs().max() <= 0.02 * scale
        grid = [item.image_grid_thw for item in got]
        tokens = sum(t * h * w for t, h, w in grid)
        keys.append(padded_plan(towers.tower, grid, bucket_tokens(tokens, towers.min_tokens))[1])
        assert towers.captures == before + (keys[-1] not in known)  # one capture per bucket not seen before
        known.add(keys[-1])
    assert keys[-1] == keys[0] and towers.captures == len(known)    # the last batch's bucket (the first's) replayed


def test_cuda_ipc_pull_many_shares_one_wait_and_names_a_released_item():
    from backend.protocol.errors import Unavailable
    from backend.transfer.consumer import EmbeddingConsumer
    from devtools.diagnostics.pool_process import ProducerProcess, make_layout

    consumer = EmbeddingConsumer(device="cuda")
    try:
        with ProducerProcess(pool_bytes=16 << 20, device="cuda") as producer:
            tensors = [torch.randn(rows, 64) for rows in (3, 500, 40)] * 7  # 21 items: more than the tag slots
            layouts = [make_layout(producer.call("publish", t), t) for t in tensors]
            pulled = consumer.pull_many(layouts)
            assert all(torch.equal(p.cpu(), t) for p, t in zip(pulled, tensors))
            for layout in layouts:  # one notification released them all
                assert producer.wait_state(layout.handle.lease_id, None) is None
            layouts = [make_layout(producer.call("publish", t), t) for t in tensors[:3]]
            producer.call("release", layouts[1].handle.lease_id)
            with pytest.raises(Unavailable, match=r"^image_layouts\[1\]: .*released or expired"):
                consumer.pull_many(layouts, [f"image_layouts[{i}]" for i in range(3)])
            for layout in (layouts[0], layouts[2]):  # the items that were read are released all the same
                assert producer.wait_state(layout.handle.lease_id, None) is None
    finally:
        consumer.close()


@pytest.mark.parametrize("tag_table", [True, False], ids=["tag-table", "trailer-copy"])
def test_cuda_ipc_lease_that_ends_during_the_copy_fails_the_item(tag_table):
    """The producer ends the lease after the consumer enqueued its copy but before the copy ran: the item
    fails, whether the consumer checks the producer's host tag table or copies the trailer tag back."""
    import dataclasses

    from backend.protocol.errors import Unavailable
    from backend.transfer import cuda_ipc
    from backend.transfer.consumer import EmbeddingConsumer
    from devtools.diagnostics.pool_process import ProducerProcess, make_layout

    consumer = EmbeddingConsumer(device="cuda")
    try:
        with ProducerProcess(pool_bytes=16 << 20, device="cuda") as producer:
            tensor = torch.randn(500, 64)
            layout = make_layout(producer.call("publish", tensor), tensor)
            assert layout.handle.tag_table
            if not tag_table:  # a consumer that cannot map the table copies the region's trailer tag back
                layout = dataclasses.replace(layout, handle=dataclasses.replace(layout.handle, tag_table=""))

            class EndsMidCopy:
                synchronize = staticmethod(cuda_ipc.synchronize)

                @staticmethod
                def enqueue_region(src, dst, nbytes, tag_ptr, stream, to_host):
                    assert (tag_ptr is None) == tag_table and not to_host
                    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
                        torch.cuda._sleep(500_000_000)  # ~0.2 s: the copy runs after the release below
                    cuda_ipc.enqueue_region(src, dst, nbytes, tag_ptr, stream, to_host)
                    assert producer.call("release", layout.handle.lease_id)  # returns once the tags are cleared

            consumer.readers["cuda_ipc"].api = EndsMidCopy
            with pytest.raises(Unavailable, match="released or expired during the read"):
                consumer.pull(layout)
            consumer.readers["cuda_ipc"].api = cuda_ipc
            assert consumer.paths["cuda_ipc"] == 0
            tensor = torch.randn(7, 64)
            layout = make_layout(producer.call("publish", tensor), tensor)
            assert torch.equal(consumer.pull(layout).cpu(), tensor)  # the next pull is fine
    finally:
        consumer.close()


def _engine_models() -> list[Path]:
    """The tiny checkpoint, and the checkpoints named in ``EPD_GPU_ENGINE_MODELS`` (os.pathsep-separated: e.g. a
    Qwen2-VL-2B-shaped one with random weights, ``scripts/gpu_real_model.sh``)."""
    extra = [Path(p) for p in os.environ.get("EPD_GPU_ENGINE_MODELS", "").split(os.pathsep) if p]
    return [ROOT / "models" / "tiny-qwen2-vl", *extra]


class _Observer:
    def __init__(self):
        self.deltas = []

    def engine_stats(self, delta) -> None:
        self.deltas.append(delta)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")
@pytest.mark.parametrize("model", _engine_models(), ids=lambda path: path.name)
def test_engine_host_image_embeds_match_pixels(model, monkeypatch):
    """vLLM on the GPU through ``EngineHost`` (its stat logger, its quiet shutdown, the plugin's patches where their
    guards allow; the idle wait is switched on to run it in the EngineCore): ``image_embeds`` from the packed
    encoder (fp32, the checkpoint's weights) give the same greedy tokens as pixel input, and a request fault is
    InvalidInput naming the prompt field."""
    from backend.encode.encoder import VisionEncoder
    from backend.engine.host import EngineHost
    from backend.protocol.errors import InvalidInput
    from backend.request.generate import GenerateRequest
    from tests.images import make_image

    monkeypatch.setenv("EPD_ENGINE_IDLE_WAIT_MS", "2")
    images = [make_image(64, 48, 1), make_image(112, 112, 2), make_image(300, 200, 3), make_image(448, 448, 4)]
    encoded = VisionEncoder.load(model, device="cuda", dtype=torch.float32).encode(images)
    observer = _Observer()
    host = EngineHost.start({"model": str(model), "dtype": "float32", "enforce_eager": True, "enable_mm_embeds": True,
                             "gpu_memory_utilization": 0.3, "max_model_len": 4096, "max_num_seqs": 8,
                             "limit_mm_per_prompt": {"image": 1}}, stats_observer=observer)
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "describe the image"}]}]

    def run(prompt=None, **fields) -> tuple[str, int]:
        request = GenerateRequest(prompt=prompt, conversation=None if prompt else conversation,
                                  sampling={"temperature": 0.0, "max_tokens": 16, "ignore_eos": True},
                                  items=fields.pop("images", ()), **fields)

        async def collect():
            text, produced = "", 0
            async for delta in host.generate(request, uuid.uuid4().hex):
                text, produced = text + delta.text, delta.num_output_tokens
            return text, produced

        return host.submit(collect()).result(timeout=300)

    try:
        outputs = []
        for image, item in zip(images, encoded):
            pixels = run(images=(image,))
            embeds = run(media_embeds={"image": (item.embeddings.cpu(), torch.tensor([item.image_grid_thw]))})
            assert embeds == pixels and pixels[1] == 16
            outputs.append(pixels)
        assert len(set(outputs)) > 1  # the image matters
        assert sum(d.prompt_tokens for d in observer.deltas) > 0
        assert sum(d.ttft.count for d in observer.deltas) == 2 * len(images)
        with pytest.raises(InvalidInput) as raised:
            run(prompt="the image " * 3000)  # longer than max_model_len
        assert raised.value.field == "text_input"
    finally:
        host.shutdown()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")
def test_llm_epd_and_epd_disagg_served_by_tritonserver_on_gpu(tmp_path):
    """``llm``, ``epd`` (E+PD: the encoder KIND_GPU with VRAM leases, ``pd`` on the GPU) and ``epd_disagg`` (E/P/D:
    prefill and decode on the GPU, KV through NIXL in VRAM) of topologies/checkpoint-gpu.yaml through the real
    tritonserver, in fp32: the same greedy tokens on 3 images; every embedding pulled device to device (CUDA IPC,
    counted by ``epd_transfer_items_total{path}``) and no media decoded downstream of the encoder.

    Each engine has an explicit KV budget (the topology's; 8 GiB here): two engines started together on one GPU with
    only ``gpu_memory_utilization`` failed there (vLLM 0.26.0, 2026-12-01: "Available KV cache memory: -0.11 GiB").
    ``EPD_GPU_SERVE_MODEL`` names another checkpoint."""
    from backend.deploy.local_server import TritonServer, triton_home
    from backend.deploy.render import render
    from backend.deploy.topology import load
    from backend.protocol.generate import GenerateInputs
    from clients.triton_client import generate_grpc
    from tests.e2e.conftest import metric
    from tests.images import image_bytes

    try:
        triton_home()
    except FileNotFoundError:
        pytest.skip("needs tritonserver in .venv (scripts/gpu_triton_env.sh)")
    model = Path(os.environ.get("EPD_GPU_SERVE_MODEL") or ROOT / "models" / "tiny-qwen2-vl")
    served = load(ROOT / "topologies" / "checkpoint-gpu.yaml", checkpoint=model).only(
        ("baseline", "E+PD", "E/P/D"), engine_args={"dtype": "float32", "enforce_eager": True, "max_model_len": 4096,
                                                    "kv_cache_memory_bytes": 8 << 30})
    render(served, tmp_path / "repo")
    content = [{"type": "image"}, {"type": "text", "text": "describe the image"}]
    sizes = [(64, 48), (300, 200), (448, 448)]
    with TritonServer(tmp_path / "repo", log_path=tmp_path / "server.log") as server:
        for seed, (width, height) in enumerate(sizes):
            inputs = GenerateInputs(messages=[{"role": "user", "content": content}],
                                    images=[image_bytes(width, height, seed)],
                                    sampling={"temperature": 0.0, "max_tokens": 16, "ignore_eos": True})
            llm = generate_grpc(server.grpc_url, "llm", inputs)
            for name in ("epd", "epd_disagg"):
                got = generate_grpc(server.grpc_url, name, inputs)
                print(f"{width}x{height}: llm TTFT {llm.ttft:.3f} s, {name} TTFT {got.ttft:.3f} s, stages {got.timings}")
                assert (got.text, got.num_output_tokens) == (llm.text, 16), name
        time.sleep(2)  # counters come in batches (CounterBatch.FLUSH_SECONDS)
        for puller in ("pd", "prefill"):
            paths = {p: metric(server, "epd_transfer_items_total", model=puller, path=p)
                     for p in ("cuda_ipc", "shared_memory", "nixl")}
            print(puller, paths)
            assert paths == {"cuda_ipc": len(sizes), "shared_memory": 0, "nixl": 0}, puller
        for stage in ("pd", "prefill", "decode"):
            assert metric(server, "epd_media_decodes_total", model=stage) == 0, stage
