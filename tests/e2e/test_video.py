"""E2E: videos through E+PD (``epd``), E/P/D (``epd_disagg``) and P/D in a real tritonserver, against the ``llm``
baseline (vLLM processing the video itself): the same tokens, media never decoded by pd / prefill / decode with
metadata-only on, and hostile videos refused naming the item while the server serves on."""
from __future__ import annotations

import base64
import time

import pytest

from backend.protocol.modality import IMAGE, VIDEO
from backend.triton.counter_batch import CounterBatch
from clients.triton_client import GenerateError
from tests.e2e.conftest import EPD_DEPLOYMENTS, P_D, assert_same_answer, asker, metric
from tests.images import image_bytes
from tests.videos import make_video

pytestmark = pytest.mark.e2e

CHAT = "<|im_start|>user\n{media}{text}<|im_end|>\n<|im_start|>assistant\n"
GREEDY = {"temperature": 0.0, "max_tokens": 16}

# sizes, lengths and frame rates: (width, height, frames, fps)
CLIPS = [(160, 120, 45, 15), (96, 160, 30, 12), (64, 64, 8, 4), (200, 100, 60, 30), (112, 112, 20, 10)]


def vid(i: int) -> bytes:
    w, h, frames, fps = CLIPS[i % len(CLIPS)]
    return make_video(w, h, frames=frames, fps=fps, seed=200 + i)


def video_url(data: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


def user(*parts, text: str = "What happens?") -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


V = {"type": "video"}
CASES = {
    "one_video": dict(messages=user(V), videos=[vid(0)]),
    "portrait_video": dict(messages=user(V), videos=[vid(1)], stream=False),
    "short_slow_video": dict(messages=user(V), videos=[vid(2)]),
    "fast_wide_video": dict(messages=user(V), videos=[vid(3)]),
    "video_url": dict(messages=user({"type": "video_url", "video_url": {"url": video_url(vid(4))}})),
    "two_videos": dict(messages=user(V, V, text="Compare."), videos=[vid(0), vid(2)]),
    "image_and_video": dict(messages=user({"type": "image"}, V, text="Both?"), images=[image_bytes(64, 48, seed=3)],
                            videos=[vid(1)]),
    "text_input_video": dict(prompt=CHAT.format(media=VIDEO.placeholder + IMAGE.placeholder, text="Describe."),
                             videos=[vid(3)], images=[image_bytes(48, 64, seed=4)]),
    "auto_placeholder": dict(prompt="What is in the clip?", videos=[vid(4)], stream=False),
    "multi_turn": dict(messages=[
        {"role": "user", "content": [V, {"type": "text", "text": "Look."}]},
        {"role": "assistant", "content": "I see it."},
        {"role": "user", "content": [{"type": "text", "text": "And now?"}, V]}], videos=[vid(2), vid(0)]),
}


ask = asker(GREEDY)


@pytest.fixture(scope="module")
def baseline(server):
    return {name: ask(server, "llm", **inputs) for name, inputs in CASES.items()}


def test_the_baseline_depends_on_the_video(server, baseline):
    other = ask(server, "llm", messages=user(V), videos=[make_video(160, 120, frames=45, fps=15, seed=999)])
    assert other.text != baseline["one_video"].text
    assert baseline["two_videos"].text != baseline["one_video"].text


@EPD_DEPLOYMENTS
@pytest.mark.parametrize("name", list(CASES))
def test_epd_returns_the_baseline_tokens(server, baseline, name, model, parameters):
    assert_same_answer(ask(server, model, **CASES[name], parameters=parameters), baseline[name])


def test_a_different_video_changes_the_epd_output(server, baseline):
    got = ask(server, "epd", messages=user(V), videos=[make_video(160, 120, frames=45, fps=15, seed=999)])
    assert got.text != baseline["one_video"].text


SLOW = {"media_io_kwargs": '{"video": {"fps": 1}}'}  # vLLM's per-request media_io_kwargs: sample 1 frame a second


@pytest.fixture(scope="module")
def slow_baseline(server):
    return ask(server, "llm", messages=user(V), videos=[vid(0)], parameters=SLOW)


def test_the_baseline_samples_as_the_request_s_media_io_kwargs_say(server, baseline, slow_baseline):
    assert slow_baseline.num_input_tokens < baseline["one_video"].num_input_tokens  # 3 s at 1 fps: 4 frames (the least), not 6


@pytest.mark.parametrize("model, parameters", [("epd", SLOW), ("epd_disagg", SLOW), ("epd_disagg", {**SLOW, **P_D}),
                                               ("epd", {**SLOW, "epd_metadata_only": False})],
                         ids=["E+PD", "E/P/D", "P/D", "E+PD-naive"])
def test_epd_samples_as_the_request_s_media_io_kwargs_say(server, baseline, slow_baseline, model, parameters):
    """The same video asked with the default sampling first (its embeddings are then in the encoder's cache and the
    consumer's), then at 1 fps: the tokens of llm at 1 fps, never the cached embeddings of the default sampling."""
    assert_same_answer(ask(server, model, messages=user(V), videos=[vid(0)]), baseline["one_video"])
    assert_same_answer(ask(server, model, messages=user(V), videos=[vid(0)], parameters=parameters), slow_baseline)


@pytest.mark.parametrize("model", ["llm", "epd", "epd_disagg"])
def test_bad_media_io_kwargs_are_invalid_naming_the_option(server, model):
    with pytest.raises(GenerateError) as info:
        ask(server, model, "http", messages=user(V), videos=[vid(2)],
            parameters={"media_io_kwargs": '{"video": {"fps": -1}}'})
    assert info.value.status == "400", info.value.status  # INVALID_ARG
    assert info.value.message.startswith("parameters.media_io_kwargs.video.fps: expected a number"), info.value.message
    assert ask(server, model, **CASES["short_slow_video"]).finish_reason is not None  # still serving


def _settled(read):
    """``read()`` once the counters it reads have been handed to Triton (they come in batches)."""
    time.sleep(2 * CounterBatch.FLUSH_SECONDS)
    return read()


def test_the_consumers_decode_no_video(server):
    """Metadata-only on: pd, prefill and decode (and the orchestrator) decode nothing for video requests (the
    encoder does), while llm decodes every video."""
    consumers = ("pd", "prefill", "decode", "epd")
    counts = lambda: {m: metric(server, "epd_media_decodes_total", model=m) for m in consumers}
    before = _settled(counts)  # after the counts of earlier requests (P/D decodes in prefill and decode) came in
    llm_before = metric(server, "epd_media_decodes_total", model="llm")
    fresh = [vid(5), vid(6)]  # not in the encoder's cache: encoded, not only published again
    for model in ("epd", "epd_disagg"):
        ask(server, model, messages=user(V, V), videos=fresh)
        ask(server, model, **CASES["image_and_video"])
    ask(server, "llm", messages=user(V, V), videos=fresh)
    assert _settled(counts) == before
    assert metric(server, "epd_media_decodes_total", model="llm") == llm_before + 2


@pytest.mark.parametrize("model, consumers", [("epd", ("pd",)), ("epd_disagg", ("prefill", "decode"))])
def test_metadata_only_off_decodes_the_video_downstream_with_the_same_tokens(server, baseline, model, consumers):
    counts = lambda: {c: metric(server, "epd_media_decodes_total", model=c) for c in consumers}
    before = _settled(counts)
    off = ask(server, model, **CASES["image_and_video"], parameters={"epd_metadata_only": False})
    want = baseline["image_and_video"]
    assert (off.text, off.num_input_tokens, off.num_output_tokens) == (want.text, want.num_input_tokens,
                                                                       want.num_output_tokens)
    assert _settled(counts) == {c: before[c] + 2 for c in consumers}  # the image and the video, in each consumer
    assert 0 < off.timings["media_ms"] < off.timings["total_ms"]


def _hostile():
    good = vid(0)
    return {
        "truncated": (good[: len(good) // 2], "cannot decode video"),
        "corrupt": (good[:32] + bytes(range(256)) * 8, "cannot decode video"),
        "zero_frames": (make_video(64, 64, frames=0), "cannot decode video"),
        "frame_over_pixel_limit": (make_video(4100, 4000, frames=1, fps=1), "over the 16000000-pixel limit"),
        # an AVI whose stream names a codec FFmpeg has no decoder for (MJPG's fourcc overwritten)
        "unsupported_codec": (make_video(64, 64, frames=4, fourcc="MJPG", suffix=".avi").replace(b"MJPG", b"QQQQ"),
                              "cannot decode video"),
        "header_claims_hours": (make_video(32, 32, frames=40, fps=0.01), "video is 4000.0 s long, over the 600-second"),
    }


@pytest.fixture(scope="module")
def hostile():
    return _hostile()


@pytest.mark.parametrize("kind", ["truncated", "corrupt", "zero_frames", "frame_over_pixel_limit", "unsupported_codec",
                                  "header_claims_hours"])
@pytest.mark.parametrize("model", ["llm", "epd", "epd_disagg"])
def test_hostile_videos_are_invalid_naming_the_item_and_the_server_serves_on(server, hostile, model, kind):
    data, fragment = hostile[kind]
    with pytest.raises(GenerateError) as info:
        ask(server, model, messages=user(V, V), videos=[vid(2), data])
    assert info.value.message.startswith("video[1]: ") and fragment in info.value.message, info.value.message
    with pytest.raises(GenerateError) as info:
        ask(server, model, "http", messages=user({"type": "video_url", "video_url": {"url": video_url(data)}}))
    assert info.value.status == "400"
    assert info.value.message.startswith("messages[0].content[0].video_url: ") and fragment in info.value.message, \
        info.value.message
    assert ask(server, model, **CASES["short_slow_video"]).finish_reason is not None  # still serving


def test_too_many_videos_are_refused(server):
    for model in ("llm", "epd"):
        with pytest.raises(GenerateError) as info:
            ask(server, model, prompt="x", videos=[vid(2)] * 3)
        assert info.value.message.startswith("video: 3 videos, over the per-request limit of 2"), info.value.message


def test_audio_is_refused_by_a_checkpoint_without_audio(server):
    """The tiny Qwen2-VL has no audio tower: llm's vLLM refuses the item, epd's encoder before decoding it."""
    from tests.audios import make_audio

    expected = {"llm": "audio: At most 0 audio(s)", "epd": "audio[0]: this checkpoint's encoder takes image and video, "
                                                            "not audio"}
    for model, start in expected.items():
        with pytest.raises(GenerateError) as info:
            ask(server, model, messages=user({"type": "audio"}), audios=[make_audio(1.0)])
        assert info.value.message.startswith(start), info.value.message
