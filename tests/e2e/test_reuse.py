"""E2E: demand-aware encoding and conversations kept across turns (docs/reuse.md) in a real tritonserver on
``topologies/cpu-reuse.yaml``: E+PD through the proxy orchestrator ``epd`` (it asks ``pd`` over gRPC which items it holds), E/P/D
through ``epd_disagg`` colocated with prefill (it asks its own engine's copies in process), the ``llm`` baseline.

The recent-items budget is cut to a few items here (``held_bytes``), and the engines' KV cache to 8,192 tokens, so
other traffic evicts what no conversation keeps. Counts come from the metrics: the encoder's tower outputs (``epd_encoder_items_total``), the orchestrators'
``epd_demand_skipped_total``, the consumers' ``epd_held_hits_total``; and from each final response's timings
(``held``: items sent as the consumer's copy)."""
from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest

from backend.deploy.local_server import ROOT, TritonServer
from backend.deploy.render import render
from backend.deploy.topology import load
from clients.triton_client import GenerateError
from tests.e2e.conftest import _shm_of_this_process, assert_same_answer, held_shm, left_behind, metrics
from tests.e2e.test_epd import _wait_for, ask
from tests.images import image_bytes

pytestmark = pytest.mark.e2e

TOPOLOGY = ROOT / "topologies" / "cpu-reuse.yaml"
RECENT_BYTES = 4 * 12 * 128 * 4  # about four of the test images' embeddings (12 tokens x 128 x float32)
DEPLOYMENTS = ("epd", "epd_disagg")
KV_BYTES = 8 << 20  # 8,192 tokens of the tiny model's KV (1 KiB a token)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("reuse") / "repo"
    topology = load(TOPOLOGY, "cpu")
    # a KV cache of 8,192 tokens (the engines'), so that a little other traffic evicts the prefix caches
    render(replace(topology, reuse={**topology.reuse, "held_bytes": RECENT_BYTES},
                   engine_args={**topology.engine_args, "kv_cache_memory_bytes": KV_BYTES}), repo)
    with TritonServer(repo, log_path=repo.parent / "server.log") as server:
        yield server
        held = held_shm(server.proc.pid) - _shm_of_this_process()
    assert not server.stragglers, f"processes outlived tritonserver: {server.stragglers}"
    assert not (leaked := left_behind(held)), f"/dev/shm entries leaked by the server: {sorted(leaked)}"


def screenshot(seed: int) -> bytes:
    return image_bytes(96, 80, seed=20_000 + seed)


def turn(images: list[bytes], text: str) -> dict:
    """A user turn with its images first (an agent re-sending its earlier screenshots and one new one)."""
    return dict(messages=[{"role": "user", "content": [*({"type": "image"} for _ in images), {"type": "text", "text": text}]}],
                images=images)


def encodes(server) -> float:
    """The items the encoder was asked for so far (tower outputs + items its own cache served), once the counters
    stopped moving (they are batched)."""
    last = None
    for _ in range(10):
        now = sum(metrics(server, ("epd_encoder_items_total", "epd_encoder_cache_hits_total"), model="encoder").values())
        if now == last:
            return now
        last = now
        time.sleep(1.2)
    return last


def converse(server, model: str, seeds: list[int], session: str | None, demand_aware: bool | None = None):
    """One conversation: turn k sends the screenshots of seeds[:k+1]; per turn, (result, items the encoder was asked
    for)."""
    parameters = {**({"session_id": session} if session else {}),
                  **({"epd_demand_aware": demand_aware} if demand_aware is not None else {})}
    out, before = [], encodes(server)
    for k in range(len(seeds)):
        result = ask(server, model, parameters=parameters or None,
                     **turn([screenshot(s) for s in seeds[:k + 1]], f"step {k}: what changed?"))
        after = encodes(server)  # also the next turn's "before": one settled reading per turn
        out.append((result, after - before))
        before = after
    return out


@pytest.mark.parametrize("model", DEPLOYMENTS)
def test_each_turn_encodes_only_its_new_screenshot_and_gives_the_llm_tokens(server, model):
    seeds = [100 + 10 * DEPLOYMENTS.index(model) + i for i in range(3)]
    turns = converse(server, model, seeds, session=f"agent-{model}")
    for k, (result, encoded) in enumerate(turns):
        assert encoded == 1, f"turn {k} of {model} encoded {encoded} items (only its new screenshot is new)"
        assert result.timings["held"] == k and result.timings["items"] == k + 1, result.timings
        assert result.timings["cached_tokens"] >= 0  # the consumer's engine reports its prefix-cache hits
        want = ask(server, "llm", **turn([screenshot(s) for s in seeds[:k + 1]], f"step {k}: what changed?"))
        assert_same_answer(result, want)


def test_a_request_can_turn_demand_aware_encoding_off_and_gets_the_same_tokens(server):
    on = converse(server, "epd", [200, 201, 202], session="on")
    off = converse(server, "epd", [210, 211, 212], session=None, demand_aware=False)
    assert [encoded for _, encoded in on] == [1, 1, 1]
    assert [encoded for _, encoded in off] == [1, 2, 3]  # every screenshot goes to the encoder again
    assert all("held" not in r.timings and "lookup_ms" not in r.timings for r, _ in off)
    again = converse(server, "epd", [200, 201, 202], session=None, demand_aware=False)  # the same turns as "on"
    for (a, _), (b, _) in zip(on, again):
        assert_same_answer(a, b)


def test_a_conversation_keeps_its_items_through_other_traffic_and_one_without_a_session_does_not(server):
    kept = converse(server, "epd", [300], session="paused-agent")
    loose = converse(server, "epd", [301], session=None)
    for seed in range(310, 318):  # other users' new screenshots: more than the recent-items budget holds
        ask(server, "epd", **turn([screenshot(seed)], "what is this?"))
    before = metrics(server, ("epd_demand_skipped_total", "epd_held_hits_total"))
    again_kept = ask(server, "epd", parameters={"session_id": "paused-agent"},
                     **turn([screenshot(300), screenshot(302)], "step 1: what changed?"))
    again_loose = ask(server, "epd", **turn([screenshot(301), screenshot(303)], "step 1: what changed?"))
    assert again_kept.timings["held"] == 1, "the paused conversation's screenshot was evicted by other traffic"
    assert again_loose.timings["held"] == 0, "an item of no conversation outlived the recent-items budget"
    assert kept[0][0].text and loose[0][0].text
    time.sleep(1.0)
    after = metrics(server, ("epd_demand_skipped_total", "epd_held_hits_total"))
    assert after["epd_demand_skipped_total"] - before["epd_demand_skipped_total"] == 1
    assert after["epd_held_hits_total"] - before["epd_held_hits_total"] == 1


@pytest.mark.parametrize("model", DEPLOYMENTS)
def test_a_conversation_s_kv_is_kept_through_other_traffic_and_one_without_a_session_is_prefilled_again(server, model):
    """``reuse.session_kv_bytes``: the engine that prefills (pd's; E/P/D's prefill, its connector beside NIXL's under
    vLLM's MultiConnector) keeps the KV of conversations' prompts (``backend.engine.session_kv``). After other
    traffic evicted its prefix cache, a conversation's next turn loads its first turn's blocks instead of prefilling
    them (the final response's ``cached_tokens``, whole 128-token blocks: on E/P/D prefill's, which decode reports)
    and one without a session is prefilled again; both answer as ``llm``."""
    notes = " ".join(f"note {i}" for i in range(150))  # several KV blocks of text after the screenshot

    def chat(seeds: list[int], session: str | None):
        inputs = dict(messages=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": notes}]},
                                {"role": "assistant", "content": "click(1, 2)"},
                                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "step 1"}]}][
                          :1 if len(seeds) == 1 else 3], images=[screenshot(s) for s in seeds])
        return ask(server, model, parameters={"session_id": session} if session else None, **inputs), inputs

    base = 400 if model == "epd" else 500  # each deployment its own screenshots and session
    # the engine that prefills and keeps the conversation's KV: pd's; E/P/D's prefill engine is in epd_disagg's
    # model here (its orchestrator colocated with it), so its metrics carry that model's name
    stage = "pd" if model == "epd" else "epd_disagg"
    hit_tokens = lambda: metrics(server, ("epd_vllm_kv_connector_hit_tokens_total",), model=stage)[  # noqa: E731
        "epd_vllm_kv_connector_hit_tokens_total"]
    first, _ = chat([base], f"kv-agent-{model}")
    chat([base + 1], None)
    for i in range(4):  # other users: 4 x ~3,000 tokens, more than the engine's KV cache holds
        ask(server, model, prompt=" ".join(f"w{i}x{j}" for j in range(700)))
    block = 128
    whole = (first.num_input_tokens - 1) // block * block  # the first turn's full blocks
    before = hit_tokens()
    kept, kept_inputs = chat([base, base + 2], f"kv-agent-{model}")
    loaded = _wait_for(hit_tokens, lambda value: value - before >= whole, seconds=6.0)  # counters come in batches
    loose, loose_inputs = chat([base + 1, base + 3], None)
    print(model, "first turn's prompt", first.num_input_tokens, "cached at the next turn: kept",
          kept.timings["cached_tokens"], "without a session", loose.timings["cached_tokens"])
    assert first.num_input_tokens >= 2 * block
    assert kept.timings["cached_tokens"] >= whole, kept.timings
    assert loaded - before >= whole, (before, loaded)  # the engine's metric
    assert loose.timings["cached_tokens"] == 0, "other traffic did not evict the prefix cache: the test sees nothing"
    assert_same_answer(kept, ask(server, "llm", **kept_inputs))
    assert_same_answer(loose, ask(server, "llm", **loose_inputs))


@pytest.mark.parametrize("value", [17, "", "x" * 257])
def test_a_bad_session_id_is_invalid_arg_naming_it(server, value):
    for model in ("epd", "pd"):
        with pytest.raises(GenerateError) as info:
            ask(server, model, parameters={"session_id": value}, prompt="hello")
        assert info.value.message.startswith("parameters.session_id: expected a non-empty string"), (model, info.value)


def test_a_malformed_lookup_is_invalid_arg_and_pd_keeps_serving(server):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    answers = []
    client.start_stream(callback=lambda result, error: answers.append((result, error)))
    for query in ("not json", json.dumps({"keys": "k"})):
        client.async_stream_infer("pd", inputs=[], parameters={"epd_held": query},
                                  outputs=[grpcclient.InferRequestedOutput("text_output")])
    deadline = time.monotonic() + 30
    while len(answers) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    client.stop_stream()
    assert len(answers) == 2 and all(error is not None and "parameters.epd_held" in error.message() for _, error in answers), \
        [error and error.message() for _, error in answers]
    assert ask(server, "epd", **turn([screenshot(400)], "still there?")).text


def _data_url(image: bytes) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(image).decode()


def _chat_turn(seeds: list[int], text: str) -> list[dict]:
    """``turn``'s request as OpenAI chat messages (the screenshots as ``image_url`` parts)."""
    parts = [{"type": "image_url", "image_url": {"url": _data_url(screenshot(s))}} for s in seeds]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def sdk(server):
    """The OpenAI endpoint in front of this module's server, through the ``openai`` SDK."""
    openai = pytest.importorskip("openai")
    from tests.e2e.conftest import openai_endpoint

    with openai_endpoint(server.grpc_url) as base:
        yield openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("model, how", [("epd", "body"), ("epd_disagg", "header")])
def test_a_conversation_over_openai_encodes_only_its_new_screenshot_and_says_so_in_usage(server, sdk, model, how):
    """``session_id`` (vLLM's extra field, or the ``X-Session-Id`` header) through the OpenAI endpoint: every turn's
    ``usage.epd_media`` counts its new screenshot encoded and the earlier ones reused, the encoder is asked for one
    item per turn (its metrics), ``prompt_tokens_details.cached_tokens`` and ``usage.epd_timings`` come back, and the
    text is ``llm``'s."""
    seeds = [500 + 10 * DEPLOYMENTS.index(model) + i for i in range(3)]
    session = {"extra_body": {"session_id": f"sdk-{model}"}} if how == "body" else {
        "extra_headers": {"X-Session-Id": f"sdk-{model}"}}
    for k in range(len(seeds)):
        messages = _chat_turn(seeds[:k + 1], f"step {k}: what changed?")
        before = encodes(server)
        got = sdk.chat.completions.create(model=model, messages=messages, temperature=0.0, max_tokens=8, **session)
        assert encodes(server) - before == 1, f"turn {k}: not only its new screenshot was encoded"
        assert got.usage.model_extra["epd_media"] == {"items": k + 1, "reused": k, "encoded": 1}, got.usage
        assert got.usage.prompt_tokens_details.cached_tokens >= 0
        stages = got.usage.model_extra["epd_timings"]  # the stage times (docs/openai.md); no admission here
        assert 0 < stages["encode_ms"] <= stages["first_chunk_ms"] <= stages["total_ms"] and "queued_ms" not in stages
        want = sdk.chat.completions.create(model="llm", messages=messages, temperature=0.0, max_tokens=8)
        assert (got.choices[0].message.content, got.usage.prompt_tokens) == (
            want.choices[0].message.content, want.usage.prompt_tokens)
    with pytest.raises(pytest.importorskip("openai").BadRequestError) as info:
        sdk.chat.completions.create(model=model, messages=messages, max_tokens=2, extra_body={"session_id": ""})
    assert info.value.body["param"] == "session_id", info.value.body
