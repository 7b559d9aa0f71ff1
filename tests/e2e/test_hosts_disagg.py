"""E2E: E/P/D across three hosts (topologies/hosts-e-p-d.yaml: the encoders with the orchestrator, prefill, decode),
each a network namespace with its own tritonserver: embeddings encoder host -> prefill host and KV prefill host ->
decode host over NIXL/UCX TCP; the same tokens as ``llm``."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from backend.deploy.topology import load
from clients.triton_client import GenerateResult
from tests.e2e.conftest import assert_same_answer
from tests.e2e.netns_fixture import checked_network
from tests.e2e.test_hosts import GREEDY, request
from tests.hosts_deploy import HostsDeployment

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e, pytest.mark.netns, pytest.mark.memory_heavy]


def test_e_p_d_across_three_hosts_gives_llm_s_tokens_with_embeddings_and_kv_over_nixl(server, tmp_path):
    from tests.e2e.conftest import asker

    ask = asker(GREEDY)
    topology = load(ROOT / "topologies/hosts-e-p-d.yaml", machine="cpu")
    with checked_network(HostsDeployment.addresses(topology)) as net, \
            HostsDeployment(topology, net, tmp_path) as deployed:
        futures = [deployed.submit("epd", request(i)) for i in range(4)]
        for i, future in enumerate(futures):
            got = future.result()
            assert isinstance(got, GenerateResult), got
            want = request(i)
            assert_same_answer(got, ask(server, "llm", prompt=want.prompt, images=want.images))
            assert got.timings["prefill_replica"] == "10.77.0.3:8001"
            assert got.timings["decode_replica"] == "10.77.0.4:8001"
        time.sleep(1.5)  # counters are flushed in batches
        assert deployed.metric("prefill-1", "epd_transfer_items_total", model="prefill", path="nixl") == 4
        assert deployed.metric("prefill-1", "epd_transfer_items_total", model="prefill", path="shared_memory") == 0
        # decode generated every answer's tokens (from prefill's KV: it holds no embeddings to compute them from)
        assert deployed.metric("decode-1", "epd_requests_total", model="decode") >= 4
        # and read that KV from the prefill host: the KV connector's transfers, counted by decode's engine
        assert deployed.metric("decode-1", "epd_vllm_kv_transfers_total", model="decode") >= 4
        assert deployed.metric("decode-1", "epd_vllm_kv_transfer_bytes_total", model="decode") > 0
        assert deployed.metric("decode-1", "epd_vllm_kv_failed_transfers_total", model="decode") == 0
