"""E2E: a 2E+1P+1D rendering (topologies/cpu-e-p-d.yaml) in its own tritonserver serves concurrent
requests with ``llm``'s tokens (the session server's, same checkpoint and engine arguments; ``llm`` itself is checked
against the in-process vLLM reference in test_llm.py), with items spread over both encoder instances."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from backend.deploy.local_server import ROOT, TritonServer
from backend.deploy.render import render
from backend.deploy.topology import load
from backend.protocol.generate import GenerateInputs
from clients.triton_client import generate
from tests.images import image_bytes

pytestmark = pytest.mark.e2e

PH = "<|vision_start|><|image_pad|><|vision_end|>"
CASES = [dict(prompt=f"<|im_start|>user\n{PH}{PH}Compare {i}.<|im_end|>\n<|im_start|>assistant\n",
              images=[image_bytes(64 + 8 * i, 48, seed=200 + i), image_bytes(112, 56 + 8 * i, seed=300 + i)])
         for i in range(8)]
GREEDY = {"temperature": 0.0, "max_tokens": 12}


@pytest.fixture(scope="module")
def two_encoder_server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("two-encoders") / "repo"
    render(load(ROOT / "topologies" / "cpu-e-p-d.yaml", "cpu"), repo)
    with TritonServer(repo, log_path=repo.parent / "server.log") as server:
        yield server
    assert not server.stragglers, f"processes outlived tritonserver: {server.stragglers}"
    # every model unloads (two encoder instances once shared their metrics and aborted at unload: 60 s stops)
    assert server.stop_seconds < 25, f"stop took {server.stop_seconds:.0f} s; see {repo.parent / 'server.log'}"


def test_two_encoders_serve_concurrent_requests(two_encoder_server, server):
    expected = [generate(server.grpc_url, "llm", GenerateInputs(sampling=GREEDY, **case), timeout=120).text
                for case in CASES]
    url = two_encoder_server.grpc_url
    ask = lambda case: generate(url, "epd", GenerateInputs(sampling=GREEDY, **case), timeout=120)
    with ThreadPoolExecutor(len(CASES)) as pool:
        results = list(pool.map(ask, CASES * 2))
    assert [r.text for r in results] == expected * 2
    encoders = {name for r in results for name in r.timings["encoders"]}
    assert len(encoders) == 2, encoders  # both encoder instances produced embeddings
    assert all(r.timings["prefill_ms"] > 0 for r in results)
