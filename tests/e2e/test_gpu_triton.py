"""The real tritonserver on a GPU machine: the `encoder` as KIND_GPU (rendered from
topologies/gpu-e-p-d.yaml; VRAM leases) and a test consumer model on the GPU that pulls the embeddings
into its GPU memory and checks them against transformers' tower run on the same image.

Skipped without a GPU (CI); run on the lent GPU machine (docs/results/gpu.md has the command)."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ROOT = Path(__file__).resolve().parents[2]


def _repository(out: Path) -> Path:
    from backend.deploy.render import render_files
    from backend.deploy.topology import load
    # the encoder's tower runs in the engines' dtype (bfloat16 in that topology): float32 here, so the pulled
    # embeddings can be held to the fp32 reference's 1e-4 (bf16 embeddings were 1.5e-2 off it on the H200)
    topology = load(ROOT / "topologies" / "gpu-e-p-d.yaml", machine="gpu")
    topology = topology.only(topology.serve, engine_args={"dtype": "float32"})
    for relative, text in render_files(topology, out).items():
        if relative.startswith("encoder/"):
            (out / relative).parent.mkdir(parents=True, exist_ok=True)
            (out / relative).write_text(text)
    check = out / "embedding_check"
    shutil.copytree(ROOT / "tests" / "gpu_models" / "embedding_check", check)
    config = check / "config.pbtxt"
    config.write_text(config.read_text().replace("MODEL_DIR", str(topology.checkpoint.resolve())))
    return out


def test_gpu_encoder_leases_are_pulled_into_gpu_memory_through_triton(tmp_path):
    import tritonclient.grpc as grpcclient
    from backend.deploy.local_server import TritonServer
    from tests.e2e.conftest import orphaned_shm
    from tests.images import make_image
    import io
    import os

    assert "KIND_GPU" in (_repository(tmp_path / "repo") / "encoder" / "config.pbtxt").read_text()
    before = set(os.listdir("/dev/shm"))
    with TritonServer(tmp_path / "repo", log_path=tmp_path / "server.log") as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        for width, height, seed in [(64, 48, 1), (112, 112, 2), (300, 200, 3), (448, 448, 4)]:
            buf = io.BytesIO()
            make_image(width, height, seed).save(buf, format="PNG")
            image = np.array([buf.getvalue()], dtype=np.object_)
            inp = grpcclient.InferInput("image", [1, 1], "BYTES")  # the encoder batches: [batch, items]
            inp.set_data_from_numpy(image.reshape(1, 1))
            layout = client.infer("encoder", [inp]).as_numpy("layout").reshape(-1)
            a = grpcclient.InferInput("image", [1], "BYTES")
            a.set_data_from_numpy(image)
            b = grpcclient.InferInput("layout", [1], "BYTES")
            b.set_data_from_numpy(layout)
            result = client.infer("embedding_check", [a, b])
            diff = float(result.as_numpy("max_abs_diff")[0])
            path = result.as_numpy("path")[0].decode()
            device = result.as_numpy("device")[0].decode()
            print(f"{width}x{height}: path {path}, pulled to {device}, max abs diff {diff:.2e}")
            assert path == "cuda_ipc" and device.startswith("cuda")
            assert diff <= 1e-4  # fp32 tower (TF32 off) on both sides
        stats = client.get_inference_statistics("encoder")
        assert stats.model_stats[0].inference_stats.success.count == 4
    assert not orphaned_shm(set(os.listdir("/dev/shm")) - before)
