"""E2E: the omni family (Qwen2.5-Omni's thinker, ``backend.encode.families.qwen2_5_omni``): its tiny checkpoint
(``devtools.tiny.omni``: a vision tower and an audio tower in one checkpoint) served by ``topologies/cpu-qwen2.5-omni.yaml``
(llm, epd, epd_disagg) in one real tritonserver. Each encoder holds both towers (``backend.encode.towers``); ``epd``
(E+PD) and ``epd_disagg`` (E/P/D) give ``llm``'s tokens for images, videos, audio, and requests mixing them; the
layouts carry each modality's width; pd, prefill and decode decode no media."""
from __future__ import annotations

import json

import pytest

from backend.deploy.local_server import ROOT
from backend.protocol.generate import GenerateInputs
from clients.triton_client import generate
from devtools.tiny.families import DEFAULT_OUT
from tests.audios import make_audio
from tests.e2e.conftest import assert_same_answer, metric
from tests.e2e.test_families import _encode, family_server, vid
from tests.images import image_bytes

pytestmark = pytest.mark.e2e

GREEDY = {"temperature": 0.0, "max_tokens": 8}
I, V, A = {"type": "image"}, {"type": "video"}, {"type": "audio"}


def user(*parts, text: str = "Describe.") -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def clip(i: int) -> bytes:
    seconds, rate = [(2.0, 16_000), (0.7, 8_000), (1.5, 44_100)][i]
    return make_audio(seconds, rate, 1, seed=500 + i, file_format="WAV")


CASES = {
    "image_a": dict(messages=user(I), images=[image_bytes(200, 150, seed=1)]),
    "image_b": dict(messages=user(I), images=[image_bytes(56, 48, seed=2)]),
    "video": dict(messages=user(V, text="What happens?"), videos=[vid(0)]),
    "video_1.6fps": dict(messages=user(V, text="What happens?"), videos=[vid(1)]),
    "audio_a": dict(messages=user(A, text="What is this sound?"), audios=[clip(0)]),
    "audio_b": dict(messages=user(A, text="What is this sound?"), audios=[clip(1)]),
    "image_and_audio": dict(messages=user(I, A, text="Both?"), images=[image_bytes(120, 80, seed=4)],
                            audios=[clip(2)]),
    "all_three": dict(messages=user(A, I, V, A, text="All?"), images=[image_bytes(90, 160, seed=3)],
                      videos=[vid(1)], audios=[clip(0), clip(1)]),
}


def items(case: dict) -> int:
    return sum(len(case.get(key, ())) for key in ("images", "videos", "audios"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    for _, running in family_server("qwen2_5_omni", "cpu-qwen2.5-omni.yaml", tmp_path_factory):
        yield running


def ask(server, model: str, **inputs):
    inputs.setdefault("sampling", GREEDY)
    return generate(server.grpc_url, model, GenerateInputs(**inputs), timeout=300)


@pytest.fixture(scope="module")
def baseline(server):
    return {name: ask(server, "llm", **case) for name, case in CASES.items()}


def test_the_baseline_depends_on_the_media(baseline):
    for pair in (("image_a", "image_b"), ("video", "video_1.6fps"), ("audio_a", "audio_b")):
        assert baseline[pair[0]].text != baseline[pair[1]].text, pair


@pytest.mark.parametrize("model", ["epd", "epd_disagg"])
def test_epd_returns_the_baseline_tokens(server, baseline, model):
    answers = {name: ask(server, model, **case) for name, case in CASES.items()}
    for name, got in answers.items():
        assert got.timings["items"] == items(CASES[name]), (name, got.timings)
    assert not (wrong := {n: (a.text, baseline[n].text) for n, a in answers.items() if a.text != baseline[n].text}), wrong
    for name, got in answers.items():
        assert_same_answer(got, baseline[name])


def test_the_layouts_carry_each_modality_s_width(server):
    """One encoder model, three modalities: each layout's shape is its tower's output, the width its modality's
    embeddings have in the language model (Qwen2.5-Omni: 128 for all three in the tiny checkpoint)."""
    from backend.encode.checkpoint import embedding_widths

    widths = embedding_widths(ROOT / DEFAULT_OUT["qwen2_5_omni"])
    for modality, data in (("image", image_bytes(64, 64, seed=6)), ("video", vid(2)), ("audio", clip(0))):
        doc = _encode(server, data, modality)
        assert doc["modality"] == modality and doc["shape"][1] == widths[modality], doc
    assert json.loads(json.dumps(widths)) == {"image": 128, "video": 128, "audio": 128}


def test_the_consumers_decode_no_media(server, baseline):
    import time

    from backend.triton.counter_batch import CounterBatch

    time.sleep(2 * CounterBatch.FLUSH_SECONDS)
    for model in ("pd", "prefill", "decode"):
        assert metric(server, "epd_media_decodes_total", model=model) == 0, model
    assert metric(server, "epd_media_decodes_total", model="llm") >= sum(items(c) for c in CASES.values())
