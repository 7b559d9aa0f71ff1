"""E2E: audio through E+PD (``epd``), E/P/D (``epd_disagg``) and P/D in one real tritonserver serving the tiny
Qwen2-Audio (``topologies/cpu-audio.yaml``), against the ``llm`` baseline (vLLM's own audio processing of the decoded
waveform): the same tokens on varied audio (lengths, sample rates, channels, formats, several items, multi-turn),
media never decoded by pd / prefill / decode with metadata-only on, and hostile audio refused naming the item while
the server serves on."""
from __future__ import annotations

import base64
import time

import pytest

from backend.deploy.local_server import ROOT, TritonServer
from backend.deploy.render import render
from backend.deploy.topology import load
from backend.protocol.modality import AUDIO
from backend.triton.counter_batch import CounterBatch
from clients.triton_client import GenerateError
from tests.audios import hostile_audio, make_audio
from tests.e2e.conftest import EPD_DEPLOYMENTS, _shm_of_this_process, assert_same_answer, asker, held_shm, left_behind, \
    metric, openai_endpoint

pytestmark = pytest.mark.e2e

CHAT = "<|im_start|>user\n{media}{text}<|im_end|>\n<|im_start|>assistant\n"
GREEDY = {"temperature": 0.0, "max_tokens": 8}
A = {"type": "audio"}


def clip(i: int) -> bytes:
    """Varied clips: (seconds, rate, channels, format)."""
    seconds, rate, channels, fmt = [(2.0, 16_000, 1, "WAV"), (0.7, 8_000, 1, "WAV"), (1.5, 44_100, 2, "WAV"),
                                    (3.0, 16_000, 1, "FLAC"), (33.0, 8_000, 1, "WAV"), (1.0, 22_050, 2, "WAV")][i % 6]
    return make_audio(seconds, rate, channels, seed=400 + i, file_format=fmt)


def user(*parts, text: str = "What is this sound?") -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def input_audio(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def audio_url(data: bytes) -> dict:
    return {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + base64.b64encode(data).decode()}}


CASES = {
    "wav_16k": dict(messages=user(A), audios=[clip(0)]),
    "short_8k": dict(messages=user(A), audios=[clip(1)], stream=False),
    "stereo_44k": dict(messages=user(A), audios=[clip(2)]),
    "flac": dict(messages=user(A), audios=[clip(3)]),
    "past_the_30s_window": dict(messages=user(A), audios=[clip(4)]),  # cut to 30 s by the feature extractor
    "input_audio": dict(messages=user(input_audio(clip(5)))),
    "audio_url": dict(messages=user(audio_url(clip(1)))),
    "three_audios": dict(messages=user(A, A, input_audio(clip(2)), text="Compare."), audios=[clip(0), clip(5)]),
    "text_input": dict(prompt=CHAT.format(media="Audio 1: " + AUDIO.placeholder + "\n", text="Describe."),
                       audios=[clip(3)]),
    "auto_placeholder": dict(prompt="What is in the clip?", audios=[clip(2)]),
    "multi_turn": dict(messages=[
        {"role": "user", "content": [A, {"type": "text", "text": "Listen."}]},
        {"role": "assistant", "content": "I hear it."},
        {"role": "user", "content": [{"type": "text", "text": "And this?"}, A]}], audios=[clip(1), clip(0)]),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("audio") / "repo"
    render(load(ROOT / "topologies" / "cpu-audio.yaml", "cpu"), repo)
    with TritonServer(repo, log_path=repo.parent / "server.log") as srv:
        yield srv
        held = held_shm(srv.proc.pid) - _shm_of_this_process()
    assert not srv.stragglers, f"processes outlived tritonserver: {srv.stragglers}"
    assert not (leaked := left_behind(held)), f"/dev/shm entries leaked by the server: {sorted(leaked)}"


ask = asker(GREEDY)


@pytest.fixture(scope="module")
def baseline(server):
    return {name: ask(server, "llm", **inputs) for name, inputs in CASES.items()}


def test_the_baseline_depends_on_the_audio(server, baseline):
    assert len({baseline[name].text for name in ("wav_16k", "short_8k", "stereo_44k", "flac")}) > 1
    assert baseline["three_audios"].num_input_tokens > baseline["wav_16k"].num_input_tokens
    # past 30 s the feature extractor keeps 3000 frames: 750 audio tokens, the most one item gets
    assert baseline["past_the_30s_window"].num_input_tokens > baseline["flac"].num_input_tokens + 600


@EPD_DEPLOYMENTS
@pytest.mark.parametrize("name", list(CASES))
def test_epd_returns_the_baseline_tokens(server, baseline, name, model, parameters):
    assert_same_answer(ask(server, model, **CASES[name], parameters=parameters), baseline[name])


def test_a_different_audio_changes_the_epd_output(server, baseline):
    for model in ("epd", "epd_disagg"):
        got = ask(server, model, messages=user(A), audios=[make_audio(2.0, 16_000, seed=999)])
        assert got.text != baseline["wav_16k"].text, model


def _settled(read):
    """``read()`` once the counters it reads have been handed to Triton (they come in batches)."""
    time.sleep(2 * CounterBatch.FLUSH_SECONDS)
    return read()


def test_the_consumers_decode_no_audio(server):
    """Metadata-only on: pd, prefill and decode (and the orchestrator) decode nothing for audio requests (the encoder
    does), while llm decodes every audio item."""
    consumers = ("pd", "prefill", "decode", "epd")
    counts = lambda: {m: metric(server, "epd_media_decodes_total", model=m) for m in consumers}
    before = _settled(counts)
    llm_before = metric(server, "epd_media_decodes_total", model="llm")
    fresh = [make_audio(1.2, 16_000, seed=501), make_audio(0.9, 44_100, 2, seed=502)]  # not in the encoder's cache
    for model in ("epd", "epd_disagg"):
        ask(server, model, messages=user(A, input_audio(fresh[1])), audios=fresh[:1])
    ask(server, "llm", messages=user(A, A), audios=fresh)
    assert _settled(counts) == before
    assert metric(server, "epd_media_decodes_total", model="llm") == llm_before + 2


def test_metadata_only_off_decodes_the_audio_downstream_with_the_same_tokens(server, baseline):
    before = _settled(lambda: metric(server, "epd_media_decodes_total", model="pd"))
    off = ask(server, "epd", **CASES["three_audios"], parameters={"epd_metadata_only": False})
    want = baseline["three_audios"]
    assert (off.text, off.num_input_tokens, off.num_output_tokens) == (want.text, want.num_input_tokens,
                                                                       want.num_output_tokens)
    assert _settled(lambda: metric(server, "epd_media_decodes_total", model="pd")) == before + 3
    assert 0 < off.timings["media_ms"] < off.timings["total_ms"]


@pytest.fixture(scope="module")
def hostile():
    return hostile_audio()


@pytest.mark.parametrize("kind", list(hostile_audio()))
@pytest.mark.parametrize("model", ["llm", "epd", "epd_disagg"])
def test_hostile_audio_is_invalid_naming_the_item_and_the_server_serves_on(server, hostile, model, kind):
    data, fragment = hostile[kind]
    with pytest.raises(GenerateError) as info:
        ask(server, model, messages=user(A, A), audios=[clip(1), data])
    assert info.value.message.startswith("audio[1]: ") and fragment in info.value.message, info.value.message
    with pytest.raises(GenerateError) as info:
        ask(server, model, "http", messages=user(input_audio(data)))
    assert info.value.status == "400"
    assert info.value.message.startswith("messages[0].content[0].input_audio.data: ") and \
        fragment in info.value.message, info.value.message
    assert ask(server, model, **CASES["short_8k"]).finish_reason is not None  # still serving


def test_too_many_audios_and_bad_parts_are_refused(server):
    for model in ("llm", "epd"):
        with pytest.raises(GenerateError) as info:
            ask(server, model, prompt="x", audios=[clip(1)] * 4)
        assert info.value.message.startswith("audio: 4 audios, over the per-request limit of 3"), info.value.message
        with pytest.raises(GenerateError) as info:
            ask(server, model, messages=user({"type": "input_audio", "input_audio": {"data": "not base64!"}}))
        assert info.value.message.startswith("messages[0].content[0].input_audio.data: not valid base64")
        with pytest.raises(GenerateError) as info:  # a valid WAV under a format the decoder does not know
            ask(server, model, "http", messages=user(input_audio(clip(1), fmt="xyz")))
        assert info.value.status == "400" and info.value.message.startswith(
            "messages[0].content[0].input_audio.format: unknown format 'xyz'"), info.value.message


@pytest.mark.parametrize("case", ["input_audio", "audio_url"])
def test_the_openai_endpoint_takes_audio_parts_with_the_same_tokens(server, baseline, case):
    """``python -m frontend.openai`` in front of this server: the ``openai`` SDK's chat completions with an
    ``input_audio`` / ``audio_url`` part give Triton's generate answer on ``llm``, ``epd`` and ``epd_disagg``,
    streaming and not."""
    openai = pytest.importorskip("openai")
    with openai_endpoint(server.grpc_url) as base:
        sdk = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        for model in ("llm", "epd", "epd_disagg"):
            whole = sdk.chat.completions.create(model=model, messages=CASES[case]["messages"], **GREEDY)
            assert whole.choices[0].message.content == baseline[case].text, model
            assert whole.usage.prompt_tokens == baseline[case].num_input_tokens, model
            chunks = sdk.chat.completions.create(model=model, messages=CASES[case]["messages"], stream=True, **GREEDY)
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == baseline[case].text, model


def test_differential_cases_answer_as_llm(server):
    """The differential harness's bounded run (``tests.differential.bounded``) on this server (Qwen2-Audio)."""
    from tests.differential import bounded

    bounded.check(server.grpc_url, "qwen2_audio")
