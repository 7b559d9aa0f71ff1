"""E2E: E/P/D with its orchestrator colocated with decode (``stages.decode.orchestrator: colocated``,
topologies/cpu-e-p-d-colocated-decode.yaml): ``epd`` hosts the orchestrator beside decode's engine (KV consumer),
``prefill`` is a model of its own asked over gRPC, ``encoder`` over BLS; ``llm`` beside it in the same server. The same
tokens as ``llm`` for varied requests (streaming and not, chat, several images, a text-only one), concurrent requests,
log probabilities; a client cancel aborts the request; the OpenAI endpoint in its process (``openai_port``) answers as
its gRPC; the server stops clean."""
from __future__ import annotations

import asyncio
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import tritonclient.http as httpclient

from backend.deploy.ports import free_ports
from backend.deploy.render import render
from backend.deploy.topology import StageSpec, load
from clients.local_server import ROOT, Ports, TritonServer
from tests.e2e.conftest import assert_same_logprobs, metric
from tests.e2e.test_epd import CASES, ask

pytestmark = pytest.mark.e2e

NAMES = ["one_image_landscape", "one_image_square", "two_images", "three_images", "chat_one_image", "text_only",
         "auto_placeholder"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    repo = tmp_path_factory.mktemp("colocated-decode") / "repo"
    topology = load(ROOT / "topologies" / "cpu-e-p-d-colocated-decode.yaml", "cpu")
    *server_ports, openai_port = free_ports(4)
    render(dataclasses.replace(topology, serve=("baseline", "E/P/D"), stages={**topology.stages, "llm": StageSpec()}),
           repo)
    with open(repo / "epd" / "config.pbtxt", "a") as config:  # what topology openai_port renders
        config.write(f'parameters {{ key: "openai_port" value: {{ string_value: "{openai_port}" }} }}\n')
    with TritonServer(repo, ports=Ports(*server_ports), log_path=repo.parent / "server.log") as server:
        yield server, f"http://127.0.0.1:{openai_port}"
    assert not server.stragglers, f"processes outlived tritonserver: {server.stragglers}"
    assert not server.leftover_shm, f"stubs killed at exit left their /dev/shm regions: {server.leftover_shm}"


@pytest.fixture(scope="module")
def baseline(served):
    server, _ = served
    return {name: ask(server, "llm", **CASES[name]) for name in NAMES}


def test_epd_hosts_the_orchestrator_and_decode(served):
    server, _ = served
    client = httpclient.InferenceServerClient(server.http_url)
    ready = {m["name"] for m in client.get_model_repository_index() if m.get("state") == "READY"}
    assert ready == {"llm", "encoder", "prefill", "epd"}  # no decode model: its engine runs in epd


@pytest.mark.parametrize("name", NAMES)
def test_the_baseline_tokens(served, baseline, name):
    server, _ = served
    got, want = ask(server, "epd", **CASES[name]), baseline[name]
    assert (got.text, got.num_input_tokens, got.num_output_tokens, got.finish_reason) == (
        want.text, want.num_input_tokens, want.num_output_tokens, want.finish_reason)
    if CASES[name].get("images"):
        assert got.timings["items"] == len(CASES[name]["images"]) and got.timings["prefill_ms"] > 0


def test_concurrent_requests_and_logprobs(served, baseline):
    server, _ = served
    names = NAMES * 2
    with ThreadPoolExecutor(len(names)) as pool:
        results = list(pool.map(lambda n: ask(server, "epd", **CASES[n]), names))
    assert [r.text for r in results] == [baseline[n].text for n in names]
    sampling = {"temperature": 0.0, "max_tokens": 8, "logprobs": 3}
    want = ask(server, "llm", **CASES["chat_one_image"], sampling=sampling)
    got = ask(server, "epd", **CASES["chat_one_image"], sampling=sampling)
    assert_same_logprobs(got.logprobs, want.logprobs)


def test_a_cancel_aborts_the_request(served):
    """The client's cancel reaches the engine in epd's own process: it stops sampling (its generated-token count
    settles far below the 3,000 asked for) and the request counts as cancelled."""
    server, _ = served
    sampled = lambda: metric(server, "epd_vllm_generation_tokens_total", model="epd")
    cancelled = lambda: metric(server, "epd_requests_total", model="epd", outcome="cancelled")
    tokens_before, cancelled_before = sampled(), cancelled()
    result = ask(server, "epd", prompt="Count.", images=[CASES["one_image_landscape"]["images"][0]], stream=True,
                 cancel_after_chunks=3, sampling={"max_tokens": 3000, "ignore_eos": True})
    assert result.cancelled
    deadline, generated = time.monotonic() + 30, None
    while time.monotonic() < deadline:  # the engine stops sampling for it: the count settles
        now = sampled()
        if now > tokens_before and now == generated and cancelled() > cancelled_before:
            break
        generated = now
        time.sleep(0.5)
    assert cancelled() == cancelled_before + 1
    assert 3 <= generated - tokens_before < 1000, f"the engine sampled {generated - tokens_before} tokens after a cancel"
    assert ask(server, "epd", **CASES["text_only"]).text  # and it keeps serving


def test_the_openai_endpoint_in_its_process_answers_as_llm(served):
    from clients.bench.side_client import request_set, run_grpc, run_openai

    server, base = served
    requests = request_set(0, 3, 96)
    samples, errors, _ = asyncio.run(run_openai(base, "epd", requests, 3, 8))
    want, want_errors, _ = asyncio.run(run_grpc(server.grpc_url, "llm", requests, 3, 8))
    assert not errors and not want_errors
    assert {s.index: s.text for s in samples} == {s.index: s.text for s in want}
