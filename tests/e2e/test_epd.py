"""E2E: E+PD (``epd`` -> ``encoder`` + ``pd``) in a real tritonserver, against the ``llm`` baseline."""
from __future__ import annotations

import base64
import time

import pytest
import tritonclient.http as httpclient

from backend.protocol.generate import GenerateInputs
from backend.protocol.modality import IMAGE
from backend.triton.counter_batch import CounterBatch
from clients.triton_client import GenerateError, GenerateResult, generate
from tests.e2e.conftest import EPD_DEPLOYMENTS, P_D, assert_same_answer, metric, metrics
from tests.images import image_bytes

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


@EPD_DEPLOYMENTS
@pytest.mark.parametrize("name", list(CASES))
def test_epd_returns_the_baseline_tokens(server, baseline, name, model, parameters):
    assert_same_answer(ask(server, model, **CASES[name], parameters=parameters), baseline[name])


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
