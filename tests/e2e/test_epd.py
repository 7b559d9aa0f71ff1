"""E2E: E+PD (``epd`` -> ``encoder`` + ``pd``) in a real tritonserver, against the ``llm`` baseline."""
from __future__ import annotations

import base64
import time
import urllib.request

import pytest
import tritonclient.http as httpclient

from backend.triton.counter_batch import CounterBatch
from backend.protocol.modality import IMAGE
from clients.triton_client import GenerateError, GenerateInputs, GenerateResult, generate
from tests.images import image_bytes
from tests.e2e.conftest import metric, metrics

pytestmark = pytest.mark.e2e

PH = IMAGE.placeholder
CHAT = "<|im_start|>user\n{images}{text}<|im_end|>\n<|im_start|>assistant\n"
GREEDY = {"temperature": 0.0, "max_tokens": 16}

SIZES = [(64, 48), (48, 64), (112, 112), (200, 150), (30, 90), (160, 40), (28, 28), (300, 300)]


def img(i: int, fmt: str = "PNG") -> bytes:
    w, h = SIZES[i % len(SIZES)]
    return image_bytes(w, h, seed=100 + i, fmt=fmt)


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def chat(text: str, *items: bytes) -> list[dict]:
    return [{"role": "user", "content": [*({"type": "image"} for _ in items), {"type": "text", "text": text}]}]


# 24 varied requests: 0-4 images of different sizes and aspect ratios, text_input and messages,
# multi-turn, data URLs, JPEG, streaming and not.
CASES = {
    "one_image_landscape": dict(prompt=CHAT.format(images=PH, text="What is this?"), images=[img(0)]),
    "one_image_portrait": dict(prompt=CHAT.format(images=PH, text="What is this?"), images=[img(1)]),
    "one_image_square": dict(prompt=CHAT.format(images=PH, text="Describe."), images=[img(2)], stream=False),
    "one_image_large_jpeg": dict(prompt=CHAT.format(images=PH, text="Colours?"), images=[img(3, "JPEG")]),
    "one_image_tall_thin": dict(prompt=CHAT.format(images=PH, text="Shape?"), images=[img(4)]),
    "one_image_wide_thin": dict(prompt=CHAT.format(images=PH, text="Shape?"), images=[img(5)], stream=False),
    "one_image_minimum": dict(prompt=CHAT.format(images=PH, text="Tiny?"), images=[img(6)]),
    "one_image_resized_down": dict(prompt=CHAT.format(images=PH, text="Big?"), images=[img(7)]),
    "auto_placeholder": dict(prompt="What is in the picture?", images=[img(8)]),
    "two_images": dict(prompt=CHAT.format(images=PH + PH, text="Compare."), images=[img(0), img(2)]),
    "two_images_same": dict(prompt=CHAT.format(images=PH + PH, text="Same?"), images=[img(1), img(1)], stream=False),
    "three_images": dict(prompt=CHAT.format(images=PH * 3, text="Which?"), images=[img(3), img(4), img(5)]),
    "four_images": dict(prompt=CHAT.format(images=PH * 4, text="All four."), images=[img(i) for i in (0, 5, 6, 7)]),
    "text_only": dict(prompt=CHAT.format(images="", text="Tell me a story.")),
    "text_only_plain": dict(prompt="Once upon a time", stream=False),
    "chat_one_image": dict(messages=chat("What is in the image?", img(2)), images=[img(2)]),
    "chat_two_images": dict(messages=chat("Compare them.", img(0), img(4)), images=[img(0), img(4)], stream=False),
    "chat_text_only": dict(messages=[{"role": "user", "content": "Hello, who are you?"}]),
    "chat_data_url": dict(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(img(9))}}, {"type": "text", "text": "Describe."}]}]),
    "chat_data_url_and_tensor": dict(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(img(10))}}, {"type": "image"},
        {"type": "text", "text": "Both?"}]}], images=[img(11)]),
    "chat_multi_turn": dict(messages=[
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image"}]},
        {"role": "assistant", "content": "I see it."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this one?"}]}],
        images=[img(12), img(13)]),
    "chat_multi_turn_text_after_image": dict(messages=[
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "First."}]},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "Now say more."}], images=[img(14)], stream=False),
    "longer_output": dict(prompt=CHAT.format(images=PH, text="Go on."), images=[img(15)],
                          sampling={"temperature": 0.0, "max_tokens": 40, "ignore_eos": True}),
    "stop_string_and_seed": dict(prompt=CHAT.format(images=PH, text="Stop?"), images=[img(16)],
                                 sampling={"temperature": 0.0, "max_tokens": 24, "seed": 7, "stop": ["e"]}),
}


def ask(server, model: str, protocol: str = "grpc", cancel_after_chunks=None, **inputs) -> GenerateResult:
    """Cancels are in band (``epd_cancel``): cancelling the gRPC stream risks Triton 2.51's frontend deadlock
    (docs/results/robustness.md); ``tests/e2e/test_llm.py`` covers a stream cancel once."""
    inputs.setdefault("sampling", GREEDY)
    url = server.grpc_url if protocol == "grpc" else server.http_url
    extra = {} if cancel_after_chunks is None else {"cancel_after_chunks": cancel_after_chunks, "cancel_via": "request"}
    return generate(url, model, GenerateInputs(**inputs), protocol=protocol, timeout=120, **extra)


@pytest.fixture(scope="module")
def baseline(server):
    return {name: ask(server, "llm", **inputs) for name, inputs in CASES.items()}


def test_epd_models_are_ready(server):
    client = httpclient.InferenceServerClient(server.http_url)
    for model in ("encoder", "pd", "epd", "prefill", "decode", "epd_disagg"):
        assert client.is_model_ready(model), model


def test_baseline_depends_on_the_image(baseline):
    assert baseline["one_image_landscape"].text != baseline["auto_placeholder"].text
    assert baseline["two_images"].text != baseline["two_images_same"].text


P_D = {"epd_encode": False}  # P/D: no encoder stage; prefill and decode process the media themselves


# E+PD; E/P/D (encoders -> prefill -> NIXL KV -> decode); P/D, the same prefill and decode without the encoders
@pytest.mark.parametrize("model, parameters", [("epd", None), ("epd_disagg", None), ("epd_disagg", P_D)],
                         ids=["E+PD", "E/P/D", "P/D"])
@pytest.mark.parametrize("name", list(CASES))
def test_epd_returns_the_baseline_tokens(server, baseline, name, model, parameters):
    got = ask(server, model, **CASES[name], parameters=parameters)
    want = baseline[name]
    assert got.text == want.text
    assert (got.num_input_tokens, got.num_output_tokens, got.finish_reason) == (
        want.num_input_tokens, want.num_output_tokens, want.finish_reason)


def test_a_different_image_changes_the_epd_output(server):
    a = ask(server, "epd", prompt="Describe it.", images=[image_bytes(64, 48, seed=1)])
    b = ask(server, "epd", prompt="Describe it.", images=[image_bytes(64, 48, seed=2)])
    assert a.text != b.text


def test_http_streaming_through_epd(server, baseline):
    got = ask(server, "epd", "http", **CASES["one_image_landscape"])
    assert got.text == baseline["one_image_landscape"].text and len(got.chunks) > 1


def _wait_for(read, condition, seconds: float = 5.0):
    deadline = time.monotonic() + seconds
    while True:
        value = read()
        if condition(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


def test_stage_metrics_move_by_the_right_amounts(server):
    """Encoder items and pool leases (refreshed once a second) and pd's pulled bytes, after one request."""
    # an item is encoded, or served from an encoder instance's cache (earlier tests sent the same images)
    items = lambda: (metric(server, "epd_encoder_items_total", model="encoder")
                     + metric(server, "epd_encoder_cache_hits_total", model="encoder"))
    released = lambda: metric(server, "epd_pool_released_total", model="encoder")
    leases = lambda: metric(server, "epd_pool_leases", model="encoder")
    moved = lambda: metric(server, "epd_transfer_bytes_total", model="pd")
    settled = None
    while settled != (items(), released()):  # let earlier tests' work reach the metrics first
        settled = (items(), released())
        time.sleep(1.5)
    open_before, moved_before = leases(), moved()
    result = ask(server, "epd", **CASES["four_images"])
    assert _wait_for(items, lambda v: v == settled[0] + 4) == settled[0] + 4
    want = moved_before + result.timings["transfer_bytes"]  # counters come in batches (CounterBatch)
    assert _wait_for(moved, lambda v: v >= want) == want > moved_before
    assert _wait_for(released, lambda v: v >= settled[1] + 4) >= settled[1] + 4  # consumers read every lease
    assert _wait_for(leases, lambda v: v <= open_before) <= open_before
    assert metric(server, "epd_pool_capacity_bytes", model="encoder") > 0
    # each instance has series of its own (metric_labels): two instances of one model never share a metric
    assert metric(server, "epd_transfer_bytes_total", model="pd", instance="pd_0_0") == want
    for model in ("pd", "epd"):
        assert metric(server, "epd_requests_total", model=model, instance=f"{model}_0_0", outcome="ok") >= 1


VLLM_COUNTERS = ("prompt_tokens_total", "generation_tokens_total") + tuple(
    f"{name}_{part}_total" for name in ("time_to_first_token", "time_per_output_token", "queue_time", "prefill_time",
                                        "decode_time") for part in ("seconds", "count"))


def _vllm_counters(server, model: str) -> dict[str, float]:
    """One scrape: read one by one, the last counter (what ``_moved`` waits on) could move after the first was read."""
    values = metrics(server, [f"epd_vllm_{name}" for name in VLLM_COUNTERS], model=model)
    return {name: values[f"epd_vllm_{name}"] for name in VLLM_COUNTERS}


def _moved(server, model: str, before: dict, want_requests: int) -> dict[str, float]:
    """The counters' change, once the engine's stat logger has seen ``want_requests`` more requests finish."""
    after = _wait_for(lambda: _vllm_counters(server, model),
                      lambda c: c["decode_time_count_total"] >= before["decode_time_count_total"] + want_requests)
    return {name: after[name] - before[name] for name in VLLM_COUNTERS}


def test_vllm_request_metrics_move_by_the_right_amounts(server):
    """vLLM's own metrics of llm, pd, prefill and decode after known requests: token counters move by the
    counts the clients got back, one TTFT / queue / prefill / decode sample per request, one time-per-output-
    token sample per token after the first; and the times are positive and within what the client saw."""
    models = ("llm", "pd", "prefill", "decode")
    time.sleep(2 * CounterBatch.FLUSH_SECONDS)  # earlier tests' figures are in (vLLM records them after the answer)
    before = {model: _vllm_counters(server, model) for model in models}
    long = CASES["longer_output"]  # 40 tokens, ignore_eos
    llm_a, llm_b = ask(server, "llm", **long), ask(server, "llm", **CASES["two_images"])
    via_pd = ask(server, "epd", **CASES["four_images"])
    via_pd_decode = ask(server, "epd_disagg", **long)
    moved = {model: _moved(server, model, before[model], 2 if model == "llm" else 1) for model in models}

    llm = moved["llm"]
    assert llm["prompt_tokens_total"] == llm_a.num_input_tokens + llm_b.num_input_tokens
    assert llm["generation_tokens_total"] == llm_a.num_output_tokens + llm_b.num_output_tokens
    assert llm["time_per_output_token_count_total"] == llm_a.num_output_tokens + llm_b.num_output_tokens - 2
    assert llm["time_to_first_token_count_total"] == llm["queue_time_count_total"] == 2
    assert 0 < llm["time_to_first_token_seconds_total"] < llm_a.total + llm_b.total
    assert 0 < llm["time_per_output_token_seconds_total"] and 0 <= llm["queue_time_seconds_total"]
    assert 0 < llm["prefill_time_seconds_total"] and 0 < llm["decode_time_seconds_total"]

    for model, result in (("pd", via_pd), ("decode", via_pd_decode)):
        got = moved[model]
        assert got["prompt_tokens_total"] == result.num_input_tokens, model
        assert got["generation_tokens_total"] == result.num_output_tokens, model
        assert got["time_per_output_token_count_total"] == result.num_output_tokens - 1, model
        assert got["time_to_first_token_count_total"] == 1 and 0 < got["time_to_first_token_seconds_total"] < result.total
    prefill = moved["prefill"]  # prefill runs each request for one token
    assert prefill["prompt_tokens_total"] == via_pd_decode.num_input_tokens
    assert prefill["generation_tokens_total"] == 1 and prefill["time_per_output_token_count_total"] == 0


HISTOGRAMS = ("epd_request_ttft_seconds", "epd_request_duration_seconds", "epd_encode_duration_seconds",
              "epd_transfer_duration_seconds", "epd_vllm_queue_duration_seconds")


def _histograms(server) -> dict[tuple[str, str, str], float]:
    """(series, model, le) -> value over every model's instances, ``le`` empty for _sum and _count: one scrape."""
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    out: dict[tuple[str, str, str], float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if not name.startswith(HISTOGRAMS):
            continue
        labels = dict(part.split("=", 1) for part in line.split("{", 1)[1].rsplit("}", 1)[0].split(","))
        key = (name, labels["model"].strip('"'), labels.get("le", "").strip('"'))
        out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_latency_histograms_as_clients_see_them(server):
    """Prometheus histograms (Triton 2.51's Python-backend HISTOGRAM kind): one TTFT and one end-to-end sample per
    request at llm, epd and epd_disagg, within what the client measured; encode and transfer samples equal to the
    request's own timings; vLLM's queue time as the summary counter has it; cumulative buckets up to +Inf."""
    time.sleep(2 * CounterBatch.FLUSH_SECONDS)
    before = _histograms(server)
    vllm_before = metrics(server, ["epd_vllm_queue_time_seconds_total"], model="llm")["epd_vllm_queue_time_seconds_total"]
    results = {model: ask(server, model, **CASES["one_image_landscape"]) for model in ("llm", "epd", "epd_disagg")}
    moved = lambda h: {k: v - before.get(k, 0.0) for k, v in h.items()}
    delta = moved(_wait_for(lambda: _histograms(server), lambda h: all(
        moved(h).get(("epd_request_duration_seconds_count", m, ""), 0) >= 1 for m in results)
        and moved(h).get(("epd_vllm_queue_duration_seconds_count", "llm", ""), 0) >= 1))
    for model, result in results.items():
        for name, bound in (("epd_request_ttft_seconds", result.ttft), ("epd_request_duration_seconds", result.total)):
            assert delta[(f"{name}_count", model, "")] == 1, (name, model)
            assert 0 < delta[(f"{name}_sum", model, "")] <= bound, (name, model, bound)
            assert delta[(f"{name}_bucket", model, "+Inf")] == 1
            buckets = sorted((float(le), value) for (series, m, le), value in delta.items()
                             if series == f"{name}_bucket" and m == model and le != "+Inf")
            assert [v for _, v in buckets] == sorted(v for _, v in buckets) and buckets[-1][1] == 1  # cumulative
            first = next(le for le, value in buckets if value == 1)
            assert delta[(f"{name}_sum", model, "")] <= first  # the sample is in the first bucket that counts it
    for model in ("epd", "epd_disagg"):
        timings = results[model].timings
        assert delta[("epd_encode_duration_seconds_count", model, "")] == 1
        assert abs(delta[("epd_encode_duration_seconds_sum", model, "")] - timings["encode_ms"] / 1000) < 1e-6
        assert abs(delta[("epd_transfer_duration_seconds_sum", model, "")] - timings["transfer_ms"] / 1000) < 1e-6
    assert delta[("epd_transfer_duration_seconds_count", "pd", "")] == 1  # pd pulled epd's item
    assert delta.get(("epd_encode_duration_seconds_count", "llm", ""), 0) == 0  # llm has no encoder stage
    vllm_moved = metrics(server, ["epd_vllm_queue_time_seconds_total"], model="llm")["epd_vllm_queue_time_seconds_total"] - vllm_before
    assert delta[("epd_vllm_queue_duration_seconds_count", "llm", "")] == 1
    assert abs(delta[("epd_vllm_queue_duration_seconds_sum", "llm", "")] - vllm_moved) < 1e-6


def test_pd_is_metadata_only(server):
    """What reaches pd has no media: pd's interface has no `image` input (`original_media` is for
    metadata-only off), pd refuses media URLs, and after epd requests with images (metadata-only on) pd
    has decoded nothing (while llm decodes every image)."""
    meta = httpclient.InferenceServerClient(server.http_url).get_model_metadata("pd")
    names = {i["name"] for i in meta["inputs"]}
    assert "image" not in names and "image_layouts" in names
    with pytest.raises(GenerateError) as info:
        ask(server, "pd", messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(img(0))}}]}])
    assert "metadata-only" in info.value.message
    before = {m: metric(server, "epd_media_decodes_total", model=m) for m in ("llm", "pd")}  # pd decodes with metadata-only off
    ask(server, "epd", **CASES["four_images"])
    ask(server, "llm", **CASES["four_images"])
    llm_decodes = _wait_for(lambda: metric(server, "epd_media_decodes_total", model="llm"), lambda v: v >= before["llm"] + 4)
    time.sleep(2 * CounterBatch.FLUSH_SECONDS)  # the other models' counts, had they moved, are in too
    assert metric(server, "epd_media_decodes_total", model="pd") == before["pd"]
    assert metric(server, "epd_media_decodes_total", model="epd") == 0
    assert llm_decodes == before["llm"] + 4


@pytest.mark.parametrize("model, consumers", [("epd", ("pd",)), ("epd_disagg", ("prefill", "decode"))])
def test_metadata_only_off_gives_the_same_tokens_and_moves_media_work_downstream(server, baseline, model, consumers):
    """Naive EPD (request parameter epd_metadata_only=false): same tokens as llm; the consumers decode
    every item themselves (their decode counters move by the item count each) and report the time
    (media_ms); with metadata-only on (the default) they decode nothing and report no media time."""
    case = CASES["chat_data_url_and_tensor"]  # a data URL and a tensor image: both reach the consumers as bytes
    decodes = lambda: {c: metric(server, "epd_media_decodes_total", model=c) for c in consumers}
    before = decodes()
    on = ask(server, model, **case)
    time.sleep(2 * CounterBatch.FLUSH_SECONDS)  # counters come in batches (CounterBatch)
    assert decodes() == before and "media_ms" not in on.timings
    off = ask(server, model, **case, parameters={"epd_metadata_only": False})
    assert (off.text, off.num_input_tokens, off.num_output_tokens) == (
        baseline["chat_data_url_and_tensor"].text, baseline["chat_data_url_and_tensor"].num_input_tokens,
        baseline["chat_data_url_and_tensor"].num_output_tokens)
    want = {c: before[c] + 2 for c in consumers}
    assert _wait_for(decodes, lambda v: v == want) == want
    assert 0 < off.timings["media_ms"] < off.timings["total_ms"]
    with pytest.raises(GenerateError) as info:
        ask(server, model, **case, parameters={"epd_metadata_only": "no"})
    assert info.value.message.startswith("parameters.epd_metadata_only: expected a bool"), info.value.message


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_bad_media_through_epd_names_the_field(server, protocol):
    with pytest.raises(GenerateError) as info:
        ask(server, "epd", protocol, prompt="x", images=[img(0), b"\x89PNG\r\n\x1a\n broken"])
    assert info.value.message.startswith("image[1]: cannot decode image"), info.value.message
    if protocol == "http":
        assert info.value.status == "400"
    with pytest.raises(GenerateError) as info:
        ask(server, "epd", protocol, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"nope").decode()}}]}])
    assert info.value.message.startswith("messages[0].content[0].image_url: cannot decode image"), info.value.message
    assert ask(server, "epd", **CASES["one_image_landscape"]).finish_reason is not None  # still serving


def test_timing_breakdown(server):
    got = ask(server, "epd", **CASES["two_images"])
    t = got.timings
    assert t["items"] == 2 and t["transfer_bytes"] > 0
    assert 0 < t["encode_ms"] < t["total_ms"] and 0 < t["transfer_ms"] < t["generate_ms"] <= t["total_ms"]
    assert ask(server, "epd", **CASES["text_only"]).timings["items"] == 0


def _encoder_counts(server) -> tuple[float, float]:
    values = metrics(server, ("nv_inference_count", "nv_inference_exec_count"), model="encoder")  # one scrape
    return values["nv_inference_count"], values["nv_inference_exec_count"]


def test_encoder_batches_items_of_concurrent_requests(server, baseline):
    """Triton's dynamic batcher hands the encoder items of several requests in one execute (one
    tower forward): inferences grow faster than executions."""
    from concurrent.futures import ThreadPoolExecutor

    names = ["four_images", "three_images", "two_images", "chat_two_images"] * 2
    before = _encoder_counts(server)
    with ThreadPoolExecutor(len(names)) as pool:
        results = list(pool.map(lambda n: ask(server, "epd", **CASES[n]), names))
    assert [r.text for r in results] == [baseline[n].text for n in names]
    after = _encoder_counts(server)
    items, executions = after[0] - before[0], after[1] - before[1]
    assert items == 22 and executions < items, (items, executions)


def _tokens_after_cancel(server, orchestrator: str, stage: str, image: bytes) -> float:
    """Cancel a 3000-token request through ``orchestrator`` after 3 chunks; return the tokens ``stage``
    generated for it, once its request has ended (aborted) and the count has settled. The stage's request ends
    within 3 s: the orchestrator's in-band cancel worked (its fallback, reading the stream to its end and then
    cancelling it, takes over only after 5 s)."""
    before = metric(server, "epd_generated_tokens_total", model=stage)
    cancelled = lambda: metric(server, "epd_requests_total", model=stage, outcome="cancelled")
    cancels_before = cancelled()
    result = ask(server, orchestrator, prompt="Count.", images=[image], stream=True, cancel_after_chunks=3,
                 sampling={"max_tokens": 3000, "ignore_eos": True})
    assert result.cancelled
    assert _wait_for(cancelled, lambda n: n > cancels_before, seconds=3) == cancels_before + 1
    deadline, generated = time.monotonic() + 30, None
    while time.monotonic() < deadline:
        now = metric(server, "epd_generated_tokens_total", model=stage)
        if now > before and now == generated:
            break
        generated = now
        time.sleep(0.5)
    return generated - before


def test_cancelling_epd_aborts_the_pd_request(server):
    generated = _tokens_after_cancel(server, "epd", "pd", img(0))
    assert 3 <= generated < 1000, f"pd generated {generated} tokens for a request cancelled after 3"


def test_cancelling_e_p_d_aborts_the_decode_request(server):
    """A cancel during decode stops decode's engine request, and the KV goes back on both sides: decode's
    (aborted) and prefill's (freed once decode read it), as vLLM's scheduler stats report it."""
    from concurrent.futures import ThreadPoolExecutor

    generated = _tokens_after_cancel(server, "epd_disagg", "decode", img(1))
    assert 3 <= generated < 1000, f"decode generated {generated} tokens for a request cancelled after 3"
    usage = lambda: {m: metric(server, "epd_vllm_kv_cache_usage", model=m) for m in ("prefill", "decode")}
    seen = []  # decode's usage while a request cancelled after 1000 tokens runs: the gauge does move
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(ask, server, "epd_disagg", prompt="Count.", images=[img(2)], stream=True,
                              cancel_after_chunks=1000, sampling={"max_tokens": 3000, "ignore_eos": True})
        while not running.done():
            seen.append(usage()["decode"])
            time.sleep(0.05)
        assert running.result().cancelled
    assert max(seen) > 0, seen
    assert _wait_for(usage, lambda v: not any(v.values()), seconds=10) == {"prefill": 0.0, "decode": 0.0}
    assert ask(server, "epd_disagg", **CASES["one_image_landscape"]).finish_reason is not None


def test_perf_analyzer_drives_epd_with_the_request_parameters_of_the_rows(server, tmp_path):
    """perf_analyzer as the benchmark's load generator (``clients.bench.perf_analyzer.load_level``): every request
    streams to a final response, and a row's request parameters reach the orchestrator (naive rows: pd decodes
    every image itself, so its decode counter moves by the request count; metadata-only rows: it stays)."""
    from clients.bench.perf_analyzer import load_level

    requests = [GenerateInputs(prompt="Describe it.", images=[img(i + 40)], sampling={"temperature": 0.0, "max_tokens": 4,
                                                                                       "ignore_eos": True})
                for i in range(3)]
    decodes = lambda: metric(server, "epd_media_decodes_total", model="pd")
    for parameters, moved in ((None, 0), ({"epd_metadata_only": False}, 3)):
        before = decodes()
        for r in requests:
            r.parameters = parameters
        samples, errors, wall, _ = load_level(server.grpc_url, "epd", 2, requests, tmp_path / str(moved), max_tokens=4)
        assert (len(samples), errors) == (3, 0) and wall > 0
        assert all(s.tokens == 4 and 0 < s.ttft <= s.latency for s in samples), samples
        time.sleep(2 * CounterBatch.FLUSH_SECONDS)  # counters come in batches (CounterBatch)
        assert _wait_for(decodes, lambda v: v == before + moved) == before + moved


def test_p_d_skips_the_encoders_and_its_engines_process_the_media(server, baseline):
    """epd_encode=false on E/P/D: the encoder is not asked, prefill and decode each decode every image
    themselves, and the tokens are E/P/D's; E+PD's pd takes metadata-only media, so epd refuses it there."""
    case = CASES["chat_data_url_and_tensor"]  # a data URL and a tensor image
    counts = lambda: {m: metric(server, "epd_media_decodes_total", model=m) for m in ("prefill", "decode")}
    encoder_before, before = _encoder_counts(server)[0], counts()
    got = ask(server, "epd_disagg", **case, parameters=P_D)
    assert got.text == ask(server, "epd_disagg", **case).text == baseline["chat_data_url_and_tensor"].text
    assert got.timings["items"] == 0 and "encoders" not in got.timings and got.timings["prefill_ms"] > 0
    want = {m: before[m] + 2 for m in before}
    assert _wait_for(counts, lambda v: v == want) == want
    assert _encoder_counts(server)[0] == encoder_before + 2  # the second request's two items only
    with pytest.raises(GenerateError) as info:
        ask(server, "epd", **case, parameters=P_D)
    assert info.value.message.startswith("parameters.epd_encode: false needs E/P/D"), info.value.message
    with pytest.raises(GenerateError) as info:
        ask(server, "epd_disagg", **case, parameters={"epd_encode": "no"})
    assert info.value.message.startswith("parameters.epd_encode: expected a bool"), info.value.message
