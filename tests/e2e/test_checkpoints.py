"""E2E: a real checkpoint's layout served the documented way. Checkpoints shaped like Qwen2-VL-2B-Instruct and
Qwen2.5-VL-3B-Instruct (their own config.json, image processor, generation config and chat template, in
tests/data/checkpoints: rope scaling, window attention, tied embeddings, the processor's 3136..12845056 pixels;
two layers, random weights; ``devtools.tiny.model.build_like``) go through
``backend.deploy.local_server --topology topologies/checkpoint-cpu.yaml --checkpoint DIR``, and ``epd`` gives ``llm``'s
tokens on images of several sizes, in prompts and chat messages, one and two per request."""
from __future__ import annotations

import base64
import os

import pytest

from backend.deploy.local_server import ROOT, TritonServer, VENV
from backend.protocol.generate import GenerateInputs
from clients.triton_client import generate
from devtools.tiny.model import build_like
from tests.e2e.conftest import _shm, settled_orphans
from tests.images import image_bytes

pytestmark = [pytest.mark.e2e, pytest.mark.memory_heavy]

PH = "<|vision_start|><|image_pad|><|vision_end|>"
GREEDY = {"temperature": 0.0, "max_tokens": 12}
SIZES = [(200, 150), (56, 56), (448, 336), (90, 300)]


def _cases() -> list[GenerateInputs]:
    cases = [GenerateInputs(messages=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}],
                            images=[image_bytes(*size, seed=i)], sampling=GREEDY) for i, size in enumerate(SIZES)]
    url = "data:image/png;base64," + base64.b64encode(image_bytes(120, 80, seed=9)).decode()
    cases.append(GenerateInputs(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "And this one?"}]}], sampling=GREEDY))
    cases.append(GenerateInputs(prompt=f"{PH}{PH}Compare.", images=[image_bytes(64, 48, seed=3), image_bytes(300, 200, seed=4)],
                                sampling=GREEDY))
    return cases


@pytest.mark.parametrize("name", ["Qwen2-VL-2B-Instruct", "Qwen2.5-VL-3B-Instruct"])
def test_a_real_checkpoint_s_shape_serves_epd_with_llm_s_tokens(name, tmp_path):
    checkpoint = ROOT / "models" / "like" / name
    build_like(ROOT / "tests" / "data" / "checkpoints" / name, checkpoint)
    # the stand-in has 2 of the real 28 / 36 layers: 1/14 of the topology's 2 GiB of KV holds as many tokens (vLLM
    # zero-fills the KV cache at start: 2 GiB an engine cost ~30 s of CPU on the 2-core machine, docs/results/ci-time.md)
    argv = [str(VENV / "bin" / "python"), "-m", "backend.deploy.local_server", "--topology",
            str(ROOT / "topologies" / "checkpoint-cpu.yaml"), "--checkpoint", str(checkpoint),
            "--engine-arg", f"kv_cache_memory_bytes={(2 << 30) // 14}"]
    before = _shm()
    server = TritonServer(env=dict(os.environ), argv=argv, log_path=tmp_path / "server.log")  # the harness's ports
    with server:
        answers = [(generate(server.grpc_url, "llm", case, timeout=300), generate(server.grpc_url, "epd", case, timeout=300))
                   for case in _cases()]
    assert not server.stragglers and not server.leftover_shm, (server.stragglers, server.leftover_shm)
    assert not (left := settled_orphans(before)), left
    for (llm, epd), case in zip(answers, _cases()):
        assert (epd.text, epd.num_output_tokens) == (llm.text, llm.num_output_tokens), case.prompt or case.messages
        assert epd.timings["items"] == (len(case.images) or 1) and epd.timings["transfer_bytes"] > 0  # via the encoder
    assert len({llm.text for llm, _ in answers if llm.text}) >= 3  # the answers depend on the image
    # the checkpoint's processor resized each image as the real one would: more pixels, more image tokens
    tokens = [llm.num_input_tokens for llm, _ in answers[:len(SIZES)]]
    assert tokens[2] > tokens[0] > tokens[1], tokens
    rendered = (ROOT / ".cache" / "repositories" / "checkpoint-cpu" / "encoder" / "config.pbtxt").read_text()
    assert 'key: "encoder_dtype" value: { string_value: "float32" }' in rendered  # the engines' dtype, not bfloat16
